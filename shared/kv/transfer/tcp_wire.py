"""Frames of our TCP KV block transport and the helpers both ends share.

A frame is ``u32 big-endian length ++ msgpack map`` (msgspec, tagged by ``op``). Block bytes never
go inside a frame: a ``data`` reply is followed on the socket by exactly ``num_blocks *
block_bytes`` raw bytes, the blocks in the order they were asked for, so the server can send the
rows of its array as they are and the reader can receive them straight into its own rows.

Reader -> server: ``read {block_ids, block_bytes}`` (answered by ``data`` + bytes or ``error``),
``notify {message}`` (answered by ``ok`` or ``error``). One request at a time per connection; a
reader that wants parallel reads opens more connections.

``hello {auth}`` opens a connection to a server that requires the cluster token (the same token the
request plane checks, ``shared/transport/guard.py``): answered by ``ok``, or by ``error``
(``unauthenticated``) and a closed connection. A server without a token answers it ``ok`` too, so a
reader may always send it. With TLS configured the whole connection runs inside TLS.
"""

from __future__ import annotations

import struct

import msgspec

LENGTH = struct.Struct(">I")
LENGTH_SIZE = LENGTH.size

MAX_FRAME_BYTES = 1 << 20
"""Largest header frame either side accepts: a read of 100k block ids still fits, and a garbage
length prefix (a client that is not ours) cannot make the server allocate gigabytes."""

MAX_BLOCKS_PER_READ = 1 << 17
"""Block ids one read may name; far above any prompt, small enough to bound one reply."""

MAX_NOTIFY_BYTES = 4096
"""A notification is a transfer id, not a payload."""


class ReadRequest(msgspec.Struct, tag="read", tag_field="op", gc=False):
    block_ids: list[int]
    block_bytes: int


class NotifyRequest(msgspec.Struct, tag="notify", tag_field="op", gc=False):
    message: str


class HelloRequest(msgspec.Struct, tag="hello", tag_field="op", gc=False):
    """The reader's credentials, first on a connection: the cluster token (None: it has none)."""

    auth: str | None = None


class DataReply(msgspec.Struct, tag="data", tag_field="op", gc=False):
    """Announces ``num_blocks * block_bytes`` raw bytes right after this frame."""

    num_blocks: int
    block_bytes: int


class OkReply(msgspec.Struct, tag="ok", tag_field="op", gc=False):
    pass


class ErrorReply(msgspec.Struct, tag="error", tag_field="op", gc=False):
    code: str
    message: str


Request = ReadRequest | NotifyRequest | HelloRequest
Reply = DataReply | OkReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode_frame(msg: Request | Reply) -> bytes:
    body = _encoder.encode(msg)
    return LENGTH.pack(len(body)) + body


def contiguous_runs(block_ids: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """``[3, 4, 5, 9, 10]`` -> ``[(3, 6), (9, 11)]``: rows that can move as one slice."""
    runs: list[tuple[int, int]] = []
    if not block_ids:
        return runs
    start = prev = block_ids[0]
    for b in block_ids[1:]:
        if b == prev + 1:
            prev = b
            continue
        runs.append((start, prev + 1))
        start = prev = b
    runs.append((start, prev + 1))
    return runs


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError naming the bad address."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV transfer address {address!r} is not host:port")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

