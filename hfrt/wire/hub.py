"""Hugging Face Hub ids as `model` options (`org/name`, `org/name@revision`): telling one apart
from other strings, and finding its files in the local Hub cache through huggingface_hub's own
API (downloading them unless HF_HUB_OFFLINE=1 says the cache only), as transformers and vLLM do.

It knows the id syntax, huggingface_hub and its errors; it knows nothing of presets, of what a
model folder must hold or of torch, and never builds cache paths itself. huggingface_hub (a
dependency of transformers) is imported only when a string is read as an id, so the controller
side can import this module without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: what a `model` option may be besides a preset or a folder, for error messages
HUB_ID_FORM = "a Hugging Face Hub id (org/name or org/name@revision)"


class HubError(ValueError):
    """A Hub id that cannot be resolved here: `reason` says why (naming the cache folder where the
    cache was read), and the message names the id too."""

    def __init__(self, hub_id: HubId, reason: str) -> None:
        super().__init__(f"Hugging Face Hub id {str(hub_id)!r}: {reason}")
        self.hub_id, self.reason = hub_id, reason


@dataclass(frozen=True, slots=True)
class HubId:
    """A model repository on the Hub and the revision to use (None: its default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_id(text: str) -> HubId | None:
    """`org/name` or `org/name@revision` → HubId; None for anything else (a preset name, a path
    with more or fewer parts, a name the Hub would refuse). Whether a folder of the same spelling
    exists is the caller's question: a folder wins, as in transformers."""
    repo, at, revision = text.partition("@")
    if repo.count("/") != 1 or (at and not revision.strip()) or revision != revision.strip():
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return HubId(repo, revision or None)


def hub_cache() -> Path:
    """The Hub cache folder huggingface_hub reads and writes (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1): the Hub cache only, no network."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def snapshot_folder(hub_id: HubId, *, cache_only: bool = False) -> Path:
    """The folder of every file of `hub_id` at its revision, in the Hub cache: what is cached is
    used, what is missing is downloaded (only the cache when offline or `cache_only`)."""
    from huggingface_hub import snapshot_download

    local_only = cache_only or offline()
    try:
        return Path(snapshot_download(hub_id.repo_id, revision=hub_id.revision, local_files_only=local_only))
    except Exception as exc:
        raise HubError(hub_id, explain(hub_id, exc, local_only)) from exc


def config_file(hub_id: HubId) -> Path:
    """`hub_id`'s config.json alone (from the cache, else downloaded unless offline): enough to
    check or plan a model without fetching its weights."""
    from huggingface_hub import hf_hub_download

    local_only = offline()
    try:
        return Path(hf_hub_download(hub_id.repo_id, "config.json", revision=hub_id.revision, local_files_only=local_only))
    except Exception as exc:
        raise HubError(hub_id, explain(hub_id, exc, local_only)) from exc


def explain(hub_id: HubId, exc: BaseException, local_only: bool) -> str:
    """Why `hub_id` could not be resolved, in one line (naming the cache folder where it was read)."""
    from huggingface_hub import errors

    if isinstance(exc, errors.RevisionNotFoundError):
        return f"the Hub has no revision {hub_id.revision!r} of {hub_id.repo_id}"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"the Hub has no model {hub_id.repo_id} that this machine may read "
                "(a private or gated one needs a token: HF_TOKEN or `hf auth login`)")
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return "the repository has no config.json (not a transformers model)"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        return _not_cached(hub_id, exc, local_only)
    return f"{type(exc).__name__}: {_first_line(exc)} (Hub cache {hub_cache()})"


def _not_cached(hub_id: HubId, exc: BaseException, local_only: bool) -> str:
    cause = exc.__cause__ or exc.__context__
    if not local_only:
        reason = f"the Hub could not be reached ({_first_line(cause or exc)})"
    elif offline():
        reason = "HF_HUB_OFFLINE=1 allows the cache only"
    else:
        reason = "only the cache was read"
    incomplete = "only partly" if type(exc).__name__ == "IncompleteSnapshotError" else "not"
    revision = "" if hub_id.revision is None else f" --revision {hub_id.revision}"
    return (f"{incomplete} in the Hub cache {hub_cache()}, and {reason}; download it there first "
            f"(`hf download {hub_id.repo_id}{revision}`, or any run with network access)")


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
