"""Length-prefixed msgpack frames of the TCP request plane: the wire layout other implementations
rely on, incremental decoding across arbitrary chunk boundaries, and bad input."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from dynamod.shared.errors import (
    DeadlineExceededError,
    FrameTooLargeError,
    InvalidRequestError,
    ProtocolError,
    RemoteError,
    UnavailableError,
    error_from_wire,
    error_to_wire,
)
from dynamod.shared.transport.framing import (
    HEADER,
    ClientFrame,
    FrameReader,
    MalformedFrame,
    OversizeFrame,
    ServerFrame,
    append_frame,
    encode_frame,
)

LIMIT = 1 << 20


def _wire_map(raw: bytes) -> dict:
    (size,) = HEADER.unpack_from(raw, 0)
    assert size == len(raw) - HEADER.size
    return msgspec.msgpack.decode(raw[HEADER.size :])


def test_request_response_and_cancel_use_the_design_field_names():
    req = ClientFrame(3, endpoint="ns/c/generate/1a", headers={"x": "y"}, body={"t": [1, 2]}, credit=8)
    assert _wire_map(encode_frame(req, LIMIT)) == {
        "stream_id": 3,
        "endpoint": "ns/c/generate/1a",
        "headers": {"x": "y"},
        "body": {"t": [1, 2]},
        "credit": 8,
    }
    assert _wire_map(encode_frame(ClientFrame(3, cancel=True), LIMIT)) == {"stream_id": 3, "cancel": True}
    assert _wire_map(encode_frame(ServerFrame(3, data="tok"), LIMIT)) == {"stream_id": 3, "data": "tok"}
    assert _wire_map(encode_frame(ServerFrame(3, end=True), LIMIT)) == {"stream_id": 3, "end": True}
    err = error_to_wire(InvalidRequestError("bad"))
    assert _wire_map(encode_frame(ServerFrame(3, error=err), LIMIT)) == {"stream_id": 3, "error": err}


def test_none_data_is_not_the_same_as_no_data():
    reader: FrameReader[ServerFrame] = FrameReader(ServerFrame, LIMIT)
    [with_none] = reader.feed(encode_frame(ServerFrame(1, data=None), LIMIT))
    [end] = reader.feed(encode_frame(ServerFrame(1, end=True), LIMIT))
    assert with_none.data is None
    assert end.data is UNSET and end.end is True


frames_strategy = st.lists(
    st.builds(
        ServerFrame,
        st.integers(1, 2**31),
        data=st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            st.text(max_size=50),
            st.lists(st.integers(0, 2**32 - 1), max_size=40),
        ),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(frames=frames_strategy, cuts=st.lists(st.integers(0, 10_000), max_size=20))
def test_frames_decode_the_same_whatever_the_chunking(frames, cuts):
    stream = b"".join(encode_frame(f, LIMIT) for f in frames)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    reader: FrameReader[ServerFrame] = FrameReader(ServerFrame, LIMIT)
    out = []
    for a, b in zip(points, points[1:], strict=False):
        out += reader.feed(stream[a:b])
    assert out == frames
    assert reader.buffered == 0


def test_large_frames_split_across_many_chunks():
    frames = [
        ServerFrame(1, data="x" * 100_000),
        ServerFrame(2, data=[7] * 3),
        ServerFrame(1, data="y" * 70_000),
    ]
    stream = b"".join(encode_frame(f, LIMIT) for f in frames) * 2
    reader: FrameReader[ServerFrame] = FrameReader(ServerFrame, LIMIT)
    out = []
    for i in range(0, len(stream), 7_001):
        out += reader.feed(stream[i : i + 7_001])
    assert out == frames * 2
    assert reader.buffered == 0


def test_oversize_length_prefix_breaks_the_reader():
    reader: FrameReader[ClientFrame] = FrameReader(ClientFrame, 100)
    good = encode_frame(ClientFrame(1, cancel=True), 100)
    out = reader.feed(good + HEADER.pack(101) + b"\x00" * 10)
    assert out[0] == ClientFrame(1, cancel=True)
    assert out[1] == OversizeFrame(101, 100)
    assert reader.broken
    assert reader.feed(good) == []


def test_malformed_payload_is_reported_with_its_stream_when_readable():
    reader: FrameReader[ClientFrame] = FrameReader(ClientFrame, LIMIT)
    not_msgpack = b"\xc1\xc1\xc1"
    wrong_type = msgspec.msgpack.encode({"stream_id": 5, "endpoint": 7})
    no_id = msgspec.msgpack.encode([1, 2, 3])
    after = ClientFrame(6, credit=2)
    data = b"".join(HEADER.pack(len(p)) + p for p in (not_msgpack, wrong_type, no_id)) + encode_frame(
        after, LIMIT
    )
    out = reader.feed(data)
    assert isinstance(out[0], MalformedFrame) and out[0].stream_id is None
    assert isinstance(out[1], MalformedFrame) and out[1].stream_id == 5
    assert isinstance(out[2], MalformedFrame) and out[2].stream_id is None
    assert out[3] == after  # framing is intact, so the reader goes on


def test_append_frame_leaves_the_buffer_intact_on_failure():
    buf = bytearray()
    append_frame(buf, ServerFrame(1, data="ok"), 64)
    before = bytes(buf)
    with pytest.raises(FrameTooLargeError):
        append_frame(buf, ServerFrame(2, data="x" * 100), 64)
    with pytest.raises(ProtocolError):
        append_frame(buf, ServerFrame(3, data=object()), 64)
    assert bytes(buf) == before
    reader: FrameReader[ServerFrame] = FrameReader(ServerFrame, 64)
    assert reader.feed(buf) == [ServerFrame(1, data="ok")]


def test_error_frames_map_back_to_classes():
    assert isinstance(error_from_wire(error_to_wire(FrameTooLargeError("big"))), FrameTooLargeError)
    assert isinstance(error_from_wire(error_to_wire(DeadlineExceededError("late"))), DeadlineExceededError)
    assert isinstance(error_from_wire(error_to_wire(UnavailableError("draining"))), UnavailableError)
    remote = error_from_wire(error_to_wire(ValueError("boom")))
    assert isinstance(remote, RemoteError) and "boom" in str(remote)
