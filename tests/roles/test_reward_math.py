"""The `math_verify` reward (roles/reward_fns.py) on answers the numeric regexes get wrong —
fractions against decimals, LaTeX forms, nested `\\boxed{}`, units, thousands separators, equal
expressions — with the regexes' own scores beside it; its timeouts (math-verify's documented 5 s
each, changed by the role's settings); and the `reasoning_gym` registry name. Documented in
docs/roles-and-losses.md ("math_verify")."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

pytest.importorskip("math_verify", reason="math-verify is not installed (pip install -e '.[envs]')")

from hfrt.flows.tasks import numeric_reward  # noqa: E402
from hfrt.roles.reward_fns import MATH_VERIFY_TIMEOUTS, REGISTRY, resolve, score_all  # noqa: E402

#: (ground truth, response, the numeric regexes' score): every one of these is right, and the
#: regex rewards (numeric_match and the data files' default) score them 0
REGEX_MISSES = [
    ("0.5", r"So the probability is \boxed{\frac{1}{2}}."),          # fraction against a decimal
    (r"\frac{1}{2}", r"The answer is $0.5$"),                        # decimal against a fraction
    (r"\frac{7}{2}", r"x = \boxed{3.5}"),
    ("12", r"The area is \boxed{12\text{ cm}^2}"),                   # units (the regex reads the 2 of ^2)
    ("12", r"The area is \boxed{12 \mathrm{cm}^2}."),
    ("1000", r"The total is \boxed{1{,}000}"),                        # LaTeX thousands separator
    ("x^2+2x+1", r"\boxed{(x+1)^2}"),                                 # the same expression, another form
]
#: wrong answers the regexes score 1 (the last number happens to match) and math-verify 0
REGEX_FALSE_RIGHT = [
    ("3/4", r"\boxed{\frac{1}{4}}"),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{1}{2}}"),
]
#: right answers both get right (nested \boxed{}, LaTeX forms, GSM8K's ####, plain numbers)
BOTH_RIGHT = [
    ("2", r"\boxed{\boxed{2}}"),
    (r"\frac{\sqrt{3}}{2}", r"Thus \boxed{\dfrac{\sqrt3}{2}}"),
    (r"\pi/2", r"The angle is \boxed{\frac{\pi}{2}}"),
    ("18", "Janet makes 9 * 2 = 18 dollars. #### 18"),
    ("27", "13 + 14 = 27"),
    ("27", r"\boxed{27}"),
]


@pytest.mark.parametrize(("truth", "response"), REGEX_MISSES)
def test_math_verify_gets_right_what_the_regexes_miss(truth: str, response: str) -> None:
    assert resolve("math_verify")(response, truth) == 1.0
    assert resolve("numeric_match")(response, truth) == 0.0 and numeric_reward(response, truth) == 0.0


@pytest.mark.parametrize(("truth", "response"), REGEX_FALSE_RIGHT)
def test_math_verify_refuses_what_the_regexes_wrongly_accept(truth: str, response: str) -> None:
    assert resolve("math_verify")(response, truth) == 0.0
    assert numeric_reward(response, truth) == 1.0


@pytest.mark.parametrize(("truth", "response"), BOTH_RIGHT)
def test_math_verify_agrees_where_the_regexes_are_right(truth: str, response: str) -> None:
    assert resolve("math_verify")(response, truth) == 1.0 and numeric_reward(response, truth) == 1.0


def test_wrong_and_empty_answers_score_zero() -> None:
    fn = resolve("math_verify")
    assert fn(r"\boxed{6}", "5") == 0.0 and fn("", "5") == 0.0 and fn("no answer at all", "5") == 0.0


def test_an_unparseable_ground_truth_is_a_named_error() -> None:
    errors: list[str] = []
    scores = score_all(resolve("math_verify"), ["1"], ["}{"], name="math_verify", error_score=0.0, errors=errors)
    assert scores == [0.0] and "cannot parse the ground truth '}{'" in errors[0]


def test_timeouts_are_math_verifys_own_and_settings_change_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify

    assert MATH_VERIFY_TIMEOUTS == {"parsing_timeout": 5, "verify_timeout": 5}  # the page's figures
    seen: dict[str, list[Any]] = {"parse": [], "verify": []}
    real_parse, real_verify = math_verify.parse, math_verify.verify
    monkeypatch.setattr(math_verify, "parse", lambda text, **kw: seen["parse"].append(kw["parsing_timeout"]) or real_parse(text, **kw))
    monkeypatch.setattr(math_verify, "verify", lambda g, a, **kw: seen["verify"].append(kw["timeout_seconds"]) or real_verify(g, a, **kw))
    fn = resolve("math_verify")
    assert fn("7", "7") == 1.0 and seen == {"parse": [5, 5], "verify": [5]}
    assert fn("7", "7", settings=MappingProxyType({"parsing_timeout": 2, "verify_timeout": 9})) == 1.0
    assert seen["parse"][-2:] == [2, 2] and seen["verify"][-1] == 9
    with pytest.raises(ValueError, match=r"settings.verify_timeout=0.5 must be a whole number of seconds"):
        fn("7", "7", settings={"verify_timeout": 0.5})


def test_registered_names() -> None:
    assert {"math_verify", "reasoning_gym"} <= set(REGISTRY)


def test_the_pinned_version_is_the_one_the_page_names() -> None:
    import importlib.metadata
    import tomllib
    from pathlib import Path

    extra = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]["envs"]
    assert "math-verify[antlr4_13_2]==0.9.0" in extra and importlib.metadata.version("math-verify") == "0.9.0"  # docs/roles-and-losses.md
