"""Reading typed keys out of parsed TOML while collecting every problem, and the error that lists
them. It knows dicts and types; it knows nothing of clusters (deploy.spec does).
"""

from __future__ import annotations

from typing import Any


class SpecError(ValueError):
    """The spec is malformed or asks for something the cluster cannot hold; lists every problem."""

    def __init__(self, where: str, problems: list[str]) -> None:
        self.where = where
        self.problems = problems
        super().__init__(f"{where}: " + (problems[0] if len(problems) == 1 else "\n  - " + "\n  - ".join(problems)))


class Reader:
    """Reads typed keys out of parsed TOML, collecting problems instead of stopping at the first."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[str] = []

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def raise_if_any(self) -> None:
        if self.problems:
            raise SpecError(self.source, self.problems)

    def section(self, raw: Any, where: str, known: set[str] | None) -> dict[str, Any]:
        if not isinstance(raw, dict):
            self.problem(f"{where}: must be a table, got {type(raw).__name__}")
            return {}
        if known is not None:
            for key in sorted(set(raw) - known):
                self.problem(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        return raw

    def get(self, t: dict[str, Any], where: str, key: str, kind: Any, default: Any) -> Any:
        if key not in t:
            return default
        value = t[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            self.problem(f"{where}: {key} must be {names}, got {value!r}")
            return default
        return value

    def choice(self, t: dict[str, Any], where: str, key: str, allowed: tuple[str, ...], default: str) -> str:
        value = self.get(t, where, key, str, default)
        if value not in allowed:
            self.problem(f"{where}: {key} = {value!r} is not one of {', '.join(allowed)}")
            return default
        return str(value)
