"""Codec and message records: round trips, strict types, no pickle."""

from __future__ import annotations

import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfrt.protocols import (
    Bye,
    Call,
    Cancel,
    Codec,
    Error,
    Heartbeat,
    Hello,
    OutOfBand,
    Reply,
    Shutdown,
    TensorHandle,
    Undecodable,
    UnknownKind,
    Welcome,
    Wire,
    new_key,
)

MESSAGES = [
    Hello(1, "actor", 0, 2, 0, 2, 1234, "node-1", "echo", {"ping": {"dispatch": "replicate", "concurrent": False}}, {}),
    Welcome(1, "abcd", 0.5),
    Call(7, "generate", [1, "x", [1.5, None]], {"n": 2}, True),
    Reply(7, {"a": [1, 2]}, 0.01),
    Reply(8, True, 0.0),
    Error(7, "ValueError", "bad", "Traceback..."),
    Cancel(7),
    Heartbeat("abcd", 3, 1.5),
    Shutdown("done", 2.0),
    Bye("shutdown", 0),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.NAME)
def test_every_message_kind_round_trips(msg: object) -> None:
    wire = Wire(new_key())
    assert wire.unpack(wire.pack(msg)) == msg  # type: ignore[arg-type]


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(values)
def test_any_msgpack_value_round_trips_as_call_argument(value: object) -> None:
    wire = Wire(new_key())
    msg = Call(1, "echo", [value], {"v": value}, True)
    assert wire.unpack(wire.pack(msg)) == msg


def test_tensor_handle_and_out_of_band_buffers_round_trip() -> None:
    codec = Codec()
    handle = TensorHandle("actor:1", "k9", (8, 4), "bfloat16", "cuda:0", 64, (4, 8))
    body, buffers = codec.encode({"h": handle, "blob": OutOfBand(b"\x01" * 1000)})
    assert len(buffers) == 1 and len(body) < 200  # the blob is not inside the body
    out = codec.decode(body, [bytes(b) for b in buffers])
    assert out["h"] == handle
    assert bytes(out["blob"].buffer) == b"\x01" * 1000


def test_tuples_decode_as_lists() -> None:
    codec = Codec()
    assert codec.decode(*codec.encode((1, (2, 3)))) == [1, [2, 3]]


class Opaque:
    pass


@pytest.mark.parametrize("value", [Opaque(), {1, 2}, complex(1, 2)], ids=["object", "set", "complex"])
def test_encoder_refuses_types_it_does_not_know(value: object) -> None:
    with pytest.raises(TypeError, match="hfrt cannot send a value of type"):
        Codec().encode(value)


def test_decoder_refuses_unknown_ext_types() -> None:
    body = msgpack.packb(msgpack.ExtType(99, b"\x90"))
    with pytest.raises(ValueError, match="unknown ext type 99"):
        Codec().decode(body)


def test_pickle_bytes_stay_bytes() -> None:
    """A pickled payload is just bytes to hfrt: it is never unpickled on receipt."""
    evil = pickle.dumps(Opaque())
    assert Codec().decode(*Codec().encode(evil)) == evil


def test_out_of_band_reference_without_frame_is_undecodable() -> None:
    wire = Wire(new_key())
    frames = wire.pack(Call(1, "x", [OutOfBand(b"abc")], {}, True))
    # Re-sign the body alone, dropping the buffer frame: the reference now points nowhere.
    body = frames[0][32:]
    forged = [wire.signer.sign([body]) + body]
    with pytest.raises(Undecodable, match="out-of-band reference"):
        wire.unpack(forged)


@pytest.mark.parametrize(
    "fields, problem",
    [
        ([3, "1", "x", [], {}, True], "call.call_id: expected int, got str"),
        ([3, 1, "x", [], {}, 1], "call.reply: expected bool, got int"),
        ([3, 1, "x", [], {}], "expected 5 fields, got 4"),
        ([42, 1], "unknown message kind 42"),
        ({"kind": 3}, "not \\[kind"),
    ],
)
def test_wrong_fields_are_refused_with_the_field_named(fields: object, problem: str) -> None:
    wire = Wire(new_key())
    body = msgpack.packb(fields)
    with pytest.raises(UnknownKind, match=problem):
        wire.unpack([wire.signer.sign([body]) + body])
