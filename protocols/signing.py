"""Message signing with a per-cluster key: keyed BLAKE2b-256, the MAC mode BLAKE2 was built with
(RFC 7693; Python's hashlib documents it as a faster, simpler replacement for HMAC).

The key comes from the HFRT_KEY environment variable (hex) or a key file (hex text, mode 0600),
never from a command line. This module knows bytes and files; it knows nothing of messages.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV_KEY = "HFRT_KEY"
ENV_KEY_FILE = "HFRT_KEY_FILE"
MIN_KEY_BYTES = 16
SIGNATURE_BYTES = 32


class KeyFileError(ValueError):
    """The cluster key is missing, unreadable or too short."""


def new_key() -> bytes:
    """A fresh random 32-byte cluster key."""
    return secrets.token_bytes(32)


def write_key_file(path: str | os.PathLike[str], key: bytes) -> Path:
    """Write `key` as hex to `path`, readable by its owner only; the file is created whole."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    os.replace(tmp, target)
    return target


def _parse(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise KeyFileError(f"{where}: the cluster key must be hex text") from None
    if len(key) < MIN_KEY_BYTES:
        raise KeyFileError(f"{where}: the cluster key has {len(key)} bytes, need >= {MIN_KEY_BYTES}")
    return key


def load_key(key_file: str | os.PathLike[str] | None = None) -> bytes:
    """Read the cluster key: `key_file` if given, else $HFRT_KEY, else the file named by $HFRT_KEY_FILE."""
    if key_file is None and os.environ.get(ENV_KEY):
        return _parse(os.environ[ENV_KEY], f"${ENV_KEY}")
    if key_file is None:
        key_file = os.environ.get(ENV_KEY_FILE) or None
    if key_file is None:
        raise KeyFileError(f"no cluster key: set ${ENV_KEY} (hex) or ${ENV_KEY_FILE}, or pass a key file")
    path = Path(key_file)
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    return _parse(text, str(path))


class Signer:
    """Keyed BLAKE2b with a 32-byte digest over a message's frames, each prefixed by its 8-byte length.

    The keyed state is made once at construction, so signing a small message costs one hash-state
    copy (HMAC-SHA256, protocol 2's, costs two states and two finalisations), paid on every
    message each way: at 1,024 ranks, thousands per broadcast.
    A key over BLAKE2b's 64-byte limit is hashed to 64 bytes first. Not thread-safe: give each
    thread its own Signer.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise KeyFileError(f"the cluster key has {len(key)} bytes, need >= {MIN_KEY_BYTES}")
        if len(key) > hashlib.blake2b.MAX_KEY_SIZE:
            key = hashlib.blake2b(key).digest()
        self._keyed = hashlib.blake2b(key=key, digest_size=SIGNATURE_BYTES)

    def sign(self, frames: Sequence[Any]) -> bytes:
        mac = self._keyed.copy()
        if len(frames) == 1 and type(frames[0]) is bytes:  # the common case: one small body
            body = frames[0]
            mac.update(len(body).to_bytes(8, "little") + body)
            return mac.digest()
        for frame in frames:
            size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
            mac.update(size.to_bytes(8, "little"))
            mac.update(frame)
        return mac.digest()

    def verify(self, signature: bytes, frames: Sequence[Any]) -> bool:
        return hmac.compare_digest(signature, self.sign(frames))
