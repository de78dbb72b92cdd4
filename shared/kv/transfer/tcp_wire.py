"""Frames of our TCP KV block transport and the helpers both ends share.

A frame is ``u32 big-endian length ++ msgpack map`` (msgspec, tagged by ``op``). Block bytes never
go inside a frame: a ``data`` reply is followed on the socket by exactly ``num_blocks *
block_bytes`` raw bytes, the blocks in the order they were asked for, so the server can send the
rows of its array as they are and the reader can receive them straight into its own rows.

Reader -> server: ``read {block_ids, block_bytes}`` (answered by ``data`` + bytes or ``error``),
``notify {message}`` (answered by ``ok`` or ``error``). One request at a time per connection; a
reader that wants parallel reads opens more connections.

Streamed reads (KV transfer overlapped with the prefill): a read that names a ``transfer_id`` with
``wait_ms > 0`` may ask for blocks the server's engine is still computing. The server answers with
several ``data`` frames, each followed by its blocks' bytes, in order, as the blocks become ready
(``readiness.py``); the last one carries the transfer's checksum and when its last block was
computed. While it waits the server sends an empty ``data`` frame (no blocks) every
``HEARTBEAT_S``, so the reader can tell a prefill still computing from a stalled peer. An ``error``
frame may take the place of the next ``data`` frame (the prefill was aborted, or the blocks were
not ready within ``wait_ms``): the connection stays usable. A plain read is answered by exactly one
``data`` frame.

``watch {block_ids, transfer_id, have, wait_ms}`` asks how many of a transfer's blocks (a prefix of
``block_ids``) are computed, without their bytes: a NIXL reader, whose one-sided READ cannot wait,
long-polls it and READs each newly ready batch itself. It is answered by one ``ready {ready}`` as
soon as more than ``have`` are ready (with the checksum and ``ready_at`` once all are), or after
``HEARTBEAT_S`` with the same count (still computing), or by an ``error``.

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

HEARTBEAT_S = 0.25
"""How often a streamed read's server says it is alive while its blocks are being computed."""

MAX_WAIT_MS = 120_000
"""Longest a streamed read may wait for blocks being computed (a prefill's own deadline is shorter)."""


class ReadRequest(msgspec.Struct, tag="read", tag_field="op", gc=False):
    block_ids: list[int]
    block_bytes: int
    transfer_id: str = ""  # the blocks belong to this transfer (its checksum comes with the last)
    wait_ms: int = 0  # > 0: blocks still being computed may be waited for this long (streamed)


class WatchRequest(msgspec.Struct, tag="watch", tag_field="op", gc=False):
    block_ids: list[int]
    block_bytes: int
    transfer_id: str
    have: int = 0  # ready blocks the reader knows of: answer when more are (or at the heartbeat)
    wait_ms: int = 0


class NotifyRequest(msgspec.Struct, tag="notify", tag_field="op", gc=False):
    message: str


class HelloRequest(msgspec.Struct, tag="hello", tag_field="op", gc=False):
    """The reader's credentials, first on a connection: the cluster token (None: it has none)."""

    auth: str | None = None


class DataReply(msgspec.Struct, tag="data", tag_field="op", gc=False, omit_defaults=True):
    """Announces ``num_blocks * block_bytes`` raw bytes right after this frame. A streamed read's
    last one also carries the transfer's ``checksum`` and ``ready_at`` (``time.time()`` when its
    last block was computed)."""

    num_blocks: int
    block_bytes: int
    checksum: int | None = None
    ready_at: float = 0.0


class ReadyReply(msgspec.Struct, tag="ready", tag_field="op", gc=False, omit_defaults=True):
    """How many of a watch's blocks (a prefix) are computed; the last also the checksum."""

    ready: int
    checksum: int | None = None
    ready_at: float = 0.0


class OkReply(msgspec.Struct, tag="ok", tag_field="op", gc=False):
    pass


class ErrorReply(msgspec.Struct, tag="error", tag_field="op", gc=False):
    code: str
    message: str


Request = ReadRequest | NotifyRequest | HelloRequest | WatchRequest
Reply = DataReply | OkReply | ErrorReply | ReadyReply

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

