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
    Error(7, "InvalidArgument", "stop: not one token", "Traceback...", "stop"),
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
        ([5, 1, "ValueError", "bad"], "error: expected 4 to 5 fields, got 3"),
        ([5, 1, "ValueError", "bad", "", "stop", "x"], "error: expected 4 to 5 fields, got 6"),
        ([5, 1, "ValueError", "bad", "", 3], "error.param: expected str, got int"),
        ([5, 1, "ValueError", "bad", "", None], "error.param: expected str, got NoneType"),
        ([42, 1], "unknown message kind 42"),
        ({"kind": 3}, "not \\[kind"),
    ],
)
def test_wrong_fields_are_refused_with_the_field_named(fields: object, problem: str) -> None:
    wire = Wire(new_key())
    body = msgpack.packb(fields)
    with pytest.raises(UnknownKind, match=problem):
        wire.unpack([wire.signer.sign([body]) + body])


def test_an_error_without_param_is_sent_as_four_fields_and_read_with_param_none() -> None:
    """`param` is optional: left out when None (so the error reads as version 1 wrote it), and
    an error of four fields reads with param None."""
    wire = Wire(new_key())
    assert Error(3, "ValueError", "bad").to_wire() == [5, 3, "ValueError", "bad", ""]
    assert Error(3, "InvalidArgument", "bad", "", "stop").to_wire() == [5, 3, "InvalidArgument", "bad", "", "stop"]
    read = wire.unpack(_signed(wire, [5, 3, "ValueError", "bad", "tb"]))
    assert read == Error(3, "ValueError", "bad", "tb") and isinstance(read, Error) and read.param is None


def _signed(wire: Wire, fields: object) -> list[bytes]:
    body = msgpack.packb(fields)
    return [wire.signer.sign([body]) + body]


@pytest.mark.parametrize(
    "fields, field, value",
    [([2, 1, "s", 2], "heartbeat_s", 2.0), ([4, 1, None, 0], "elapsed_s", 0.0), ([7, "s", 1, 5], "sent_at", 5.0),
     ([8, "why", 3], "grace_s", 3.0)],
)
def test_a_float_field_accepts_an_int_and_makes_it_a_float(fields: list[object], field: str, value: float) -> None:
    """protocols/README.md: float fields accept a msgpack int (other writers encode 2.0 as 2)."""
    wire = Wire(new_key())
    got = getattr(wire.unpack(_signed(wire, fields)), field)
    assert got == value and type(got) is float


@pytest.mark.parametrize("fields", [[2, 1, "s", True], [4, 1, None, "0"], [8, "why", None]])
def test_a_float_field_refuses_bools_and_other_types(fields: list[object]) -> None:
    wire = Wire(new_key())
    with pytest.raises(UnknownKind, match=r"expected float\|int, got"):
        wire.unpack(_signed(wire, fields))


@pytest.mark.parametrize(
    "timestamp", [msgpack.Timestamp(1, 0), msgpack.Timestamp(2**33, 5), msgpack.Timestamp(-1, 999)], ids=["32", "64", "96"]
)
def test_msgpack_timestamps_are_refused_both_ways(timestamp: msgpack.Timestamp) -> None:
    """ext -1 is msgpack's own timestamp, decoded by msgpack without the codec's ext hook."""
    wire = Wire(new_key())
    for fields in ([4, 1, timestamp, 0.0], [4, 1, {"at": [timestamp]}, 0.0], [3, 1, "x", [], {timestamp.seconds: timestamp}, True]):
        with pytest.raises(Undecodable, match="unknown ext type -1"):
            wire.unpack(_signed(wire, fields))
    with pytest.raises(TypeError, match="cannot send a value of type msgpack.ext.Timestamp"):
        wire.pack(Reply(1, [(timestamp,)], 0.0))


def test_bytes_that_look_like_a_timestamp_marker_are_plain_values() -> None:
    value = [b"\xd6\xff\xd7\xff\x0c\xff", -1, 255, "\u00ff", {"k": b"\x04\xff\x08\xff"}]
    wire = Wire(new_key())
    assert wire.unpack(wire.pack(Reply(1, value, 0.0))).value == value
