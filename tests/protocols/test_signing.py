"""Signing, key handling and size limits."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import zmq

from hfrt.protocols import (
    BadSignature,
    Call,
    FrameTooLarge,
    KeyFileError,
    Limits,
    OutOfBand,
    Reply,
    Signer,
    Wire,
    load_key,
    new_key,
    write_key_file,
)
from hfrt.wire.channel import Channel


def test_signature_is_keyed_blake2b_over_length_prefixed_frames() -> None:
    key = new_key()
    frames = [b"body", b"buffer-one", bytearray(b"two")]
    expected = hashlib.blake2b(key=key, digest_size=32)
    for f in frames:
        expected.update(len(f).to_bytes(8, "little") + bytes(f))
    assert Signer(key).sign(frames) == expected.digest()
    assert Signer(key).sign([b"x"]) == hashlib.blake2b((1).to_bytes(8, "little") + b"x", key=key, digest_size=32).digest()


def test_keys_over_64_bytes_are_hashed_to_64_first() -> None:
    key = b"k" * 100
    short = hashlib.blake2b(key).digest()
    assert Signer(key).sign([b"m"]) == hashlib.blake2b((1).to_bytes(8, "little") + b"m", key=short, digest_size=32).digest()
    assert Signer(key).sign([b"m"]) != Signer(b"k" * 99).sign([b"m"])


def test_tampering_with_any_frame_breaks_the_signature() -> None:
    wire = Wire(new_key())
    frames = wire.pack(Call(1, "x", [OutOfBand(b"payload")], {}, True))
    tampered_body = [frames[0][:-1] + bytes([frames[0][-1] ^ 1]), frames[1]]
    tampered_buffer = [frames[0], b"PAYLOAD"]
    other_key = Wire(new_key()).pack(Call(1, "x", [], {}, True))
    for bad in (tampered_body, tampered_buffer, other_key, [b"short"], []):
        with pytest.raises(BadSignature):
            wire.unpack(bad)


def test_key_file_is_private_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HFRT_KEY", raising=False)
    key = new_key()
    path = write_key_file(tmp_path / "k" / "cluster.key", key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_key(path) == key
    monkeypatch.setenv("HFRT_KEY_FILE", str(path))
    assert load_key() == key


def test_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    key = new_key()
    monkeypatch.setenv("HFRT_KEY", key.hex())
    assert load_key() == key


@pytest.mark.parametrize(
    "content, problem", [("zz", "must be hex"), ("abcd", "has 2 bytes, need >= 16")]
)
def test_bad_keys_are_refused_naming_the_source(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "bad.key"
    path.write_text(content)
    with pytest.raises(KeyFileError, match=problem) as info:
        load_key(path)
    assert str(path) in str(info.value)


def test_missing_key_says_how_to_provide_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HFRT_KEY", raising=False)
    monkeypatch.delenv("HFRT_KEY_FILE", raising=False)
    with pytest.raises(KeyFileError, match="HFRT_KEY"):
        load_key()
    with pytest.raises(KeyFileError, match="cannot read key file"):
        load_key(tmp_path / "absent.key")


def test_limits_are_checked_when_sending_and_receiving() -> None:
    limits = Limits(max_frame_bytes=1024, max_message_bytes=2048, max_frames=3)
    small = Wire(b"k" * 32, limits)
    with pytest.raises(FrameTooLarge, match="cannot send reply: frame of"):
        small.pack(Reply(1, b"x" * 2000, 0.0))
    with pytest.raises(FrameTooLarge, match="max_frames 3"):
        small.pack(Call(1, "x", [OutOfBand(b"a"), OutOfBand(b"b"), OutOfBand(b"c")], {}, True))
    with pytest.raises(FrameTooLarge, match="max_message_bytes 2048"):
        small.pack(Call(1, "x", [OutOfBand(b"a" * 1020), OutOfBand(b"b" * 1020)], {}, True))
    big = Wire(b"k" * 32).pack(Reply(1, b"x" * 2000, 0.0))
    with pytest.raises(FrameTooLarge, match="max_frame_bytes 1024"):
        small.unpack(big)
    with pytest.raises(FrameTooLarge, match="max_message_bytes 2048"):
        small.unpack([b"s" * 1000, b"a" * 1000, b"b" * 1000])
    with pytest.raises(FrameTooLarge, match="max_frames 3"):
        small.unpack([b"s" * 40] * 4)


def test_limits_must_be_consistent() -> None:
    with pytest.raises(ValueError, match="max_message_bytes"):
        Limits(max_frame_bytes=100, max_message_bytes=10)


def test_data_plane_wire_signs_body_and_buffer_lengths_but_not_bytes() -> None:
    key = new_key()
    plane = Wire(key, sign_buffers=False)
    frames = plane.pack(Reply(1, [OutOfBand(b"tensor-bytes")], 0.0))
    assert plane.unpack([frames[0], b"TENSOR-BYTES"]).value[0].buffer == b"TENSOR-BYTES"  # bytes not covered
    with pytest.raises(BadSignature):
        plane.unpack([frames[0], b"longer tensor bytes"])  # lengths are
    with pytest.raises(BadSignature):
        plane.unpack([frames[0][:-1] + bytes([frames[0][-1] ^ 1]), frames[1]])  # and the body is
    with pytest.raises(BadSignature):
        Wire(key).unpack(frames)  # the command plane always signs buffer bytes


class _Pair:
    """A Channel on a ROUTER and a raw DEALER peer connected to it (real sockets)."""

    def __init__(self, limits: Limits) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        self.got: list[list[bytes]] = []
        self.dropped: list[tuple[bytes, str]] = []
        self.channel = Channel(router, self.got.append, routed=True, limits=limits)
        self.channel.on_dropped = lambda peer, why: self.dropped.append((peer, why))
        self.peer = self.ctx.socket(zmq.DEALER)
        self.peer.setsockopt(zmq.LINGER, 0)
        self.peer.setsockopt(zmq.ROUTING_ID, b"peer")
        self.peer.connect(f"tcp://127.0.0.1:{port}")

    async def settle(self, until: Any) -> None:
        for _ in range(200):
            if until():
                return
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self.channel.close()
        self.peer.close(0)
        self.ctx.term()


async def test_a_received_batch_obeys_the_message_limits_as_a_whole() -> None:
    limits = Limits(max_frame_bytes=1024, max_message_bytes=2048, max_frames=4)
    pair = _Pair(limits)
    try:
        pair.peer.send_multipart([b"", b"a", b"b", b"c", b"d"])  # 5 frames > max_frames 4
        pair.peer.send_multipart([b"", b"a" * 1000, b"b" * 1000, b"c" * 100])  # 2100 bytes > 2048
        pair.peer.send_multipart([b"", b"a" * 1025, b"b"])  # a frame > max_frame_bytes
        pair.peer.send_multipart([b"", b"x", b"y", b"z"])  # within the limits: delivered
        await pair.settle(lambda: len(pair.dropped) == 3 and len(pair.got) == 3)
        assert [why.split(": ", 1)[1] for _, why in pair.dropped] == [
            "5 frames > max_frames 4", "message of 2100 bytes > max_message_bytes 2048",
            "frame of 1025 bytes > max_frame_bytes 1024",
        ]
        assert {peer for peer, _ in pair.dropped} == {b"peer"}
        assert pair.got == [[b"peer", b"x"], [b"peer", b"y"], [b"peer", b"z"]]
    finally:
        pair.close()


async def test_a_sent_batch_is_split_to_fit_the_limits() -> None:
    limits = Limits(max_frame_bytes=1024, max_message_bytes=2048, max_frames=4)
    pair = _Pair(limits)
    try:
        messages = [[bytes([i]) * (600 if i % 5 == 0 else 10)] for i in range(40)]
        pair.peer.send(b"hello")  # the ROUTER learns the peer's routing id
        await pair.settle(lambda: pair.got)
        for message in messages:  # queued in one loop turn: they leave batched
            pair.channel.send(message, b"peer")
        pair.channel.flush()
        received: list[bytes] = []
        while len(received) < len(messages):
            assert pair.peer.poll(5000)
            frames = pair.peer.recv_multipart()
            assert limits.check([len(f) for f in frames]) is None, [len(f) for f in frames]
            received.extend(frames[1:] if frames[0] == b"" else frames)
        assert received == [m[0] for m in messages]
    finally:
        pair.close()
