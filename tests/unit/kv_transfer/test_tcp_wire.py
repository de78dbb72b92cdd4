"""The TCP block transport's framing helpers: runs of rows, addresses, frames."""

from __future__ import annotations

import pytest

from dynamod.shared.kv.transfer.tcp_wire import (
    LENGTH,
    DataReply,
    ReadRequest,
    contiguous_runs,
    encode_frame,
    join_address,
    reply_decoder,
    request_decoder,
    split_address,
)


def test_contiguous_runs_merge_consecutive_ids_in_order() -> None:
    assert contiguous_runs([3, 4, 5, 9, 10, 2]) == [(3, 6), (9, 11), (2, 3)]
    assert contiguous_runs([7]) == [(7, 8)]
    assert contiguous_runs([]) == []
    assert contiguous_runs([5, 5]) == [(5, 6), (5, 6)]


@pytest.mark.parametrize(("host", "port"), [("127.0.0.1", 5000), ("::1", 65535), ("node-7", 1)])
def test_addresses_round_trip(host: str, port: int) -> None:
    assert split_address(join_address(host, port)) == (host, port)


@pytest.mark.parametrize("bad", ["127.0.0.1", "host:", ":80", "host:99999", "host:x"])
def test_bad_address_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        split_address(bad)


def test_frames_are_length_prefixed_msgpack_tagged_by_op() -> None:
    frame = encode_frame(ReadRequest([1, 2], 4096))
    (length,) = LENGTH.unpack(frame[: LENGTH.size])
    assert length == len(frame) - LENGTH.size
    assert request_decoder.decode(frame[LENGTH.size :]) == ReadRequest([1, 2], 4096)
    reply = encode_frame(DataReply(2, 4096))
    assert reply_decoder.decode(reply[LENGTH.size :]) == DataReply(2, 4096)
