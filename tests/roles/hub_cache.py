"""Test support: put a model folder into a Hugging Face Hub cache the way huggingface_hub stores a
download (blobs by content hash, a snapshot of links per commit, a ref naming the commit), so
tests resolve Hub ids offline. It knows the cache layout; nothing of hfrt.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def put_in_hub_cache(cache: Path, repo_id: str, folder: Path, *, revision: str = "main") -> Path:
    """Every file of `folder` as the snapshot of `repo_id` at `revision` in the Hub cache `cache`
    (HF_HUB_CACHE); returns the snapshot folder (models--org--name/snapshots/<commit>)."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    commit = hashlib.sha1("".join(f"{name}:{d}\n" for name, d in digests.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in files:
        blob = repo / "blobs" / digests[file.name]
        blob.write_bytes(file.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
