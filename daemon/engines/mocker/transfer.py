"""The mocker engine's side of disaggregated serving, over the worker's transfer agent.

Prefill worker: a finished ``prefill_only`` request's blocks are held (``KvHold``) under a
transfer id; its final output carries ``KvTransferParams`` (rows, router hashes, checksum of the
held bytes, ``expires_at``). The hold ends when the decode worker's notification arrives (the
agent's notify callback) or ``--kv-hold-timeout`` passes (a timer, not a poll).

Decode worker: a request with those parameters is admitted to wait for its KV (vLLM's
WAITING_FOR_REMOTE_KVS); one task per request looks up the prefill worker's agent, reads the
blocks this worker does not already cache (the partial last block always) within
``--kv-transfer-timeout``, checks the checksum over all the prompt's local blocks (prefix hits
included: block bytes are a function of the tokens, so hits hold exactly what the prefill worker
computed), and hands the result back. The read takes real wall time (not divided by
``--speedup-ratio``) while the rank keeps stepping its other requests, so the request's timeline
includes the transfer time actually measured. Then, as in vLLM, the decode worker computes the last
prompt token itself to sample the first output token (one decode slot, no prefill cost); the
prefill worker's ``first_token`` is reported but not streamed (the mocker's sampler, seeded by the
request id and prompt, draws the same token when the frontend keeps the request id). Any failure
(no agent record, peer gone, deadline, checksum, mismatched layout) is logged once with its reason,
counted, and the request is prefilled locally; the prefill worker is then notified (best effort)
so it frees its blocks before the hold expires.

The decode's final output carries a transfer report in ``disaggregated_params["kv_transfer"]``:
blocks and bytes read, the checksum found and the one expected, milliseconds, backend, the exposed
transfer (``exposed_ms``: the prefill's last block computed until every block was here), and on
failure the reason, so a client can prove bytes received == bytes computed.

Overlapped with the prefill (``--kv-transfer-overlap chunk``, the core's ``enable_hold_streaming``):
a held prompt gets its whole prompt's blocks when it is admitted, and its stream sends an early
output with *streaming* parameters (rows, no checksum) right away, so the frontend dispatches the
decode while the prefill computes. Each step's ``prefill_progress`` marks the computed rows ready
in the memory's ``BlockReadiness``; the hold, when the prefill ends, marks the last one with the
checksum. The decode worker's streamed read waits for rows on the block server and gets the
checksum with the last block. A prefill that stops early (aborted, preempted, expired, or its
reader gave up) fails the waiting readers, which prefill locally; a hold whose reader already gave
up is freed when it is made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from dynamod.daemon.engines.kv_transfer import (
    OVERLAP_CHUNK,
    REASON_CHECKSUM,
    REASON_ERROR,
    REASON_PEER_LOST,
    REASON_TIMEOUT,
    KvTransferContext,
)
from dynamod.daemon.engines.mocker.core import KvHold, MockerCore, RemoteLoad
from dynamod.shared.errors import InvalidRequestError, NotFoundError
from dynamod.shared.kv.transfer.base import KvTransferError, KvTransferTimeout
from dynamod.shared.kv.transfer.memory import KvBlockMemory
from dynamod.shared.protocol.kv_transfer import KvTransferMetadata, KvTransferParams

logger = logging.getLogger(__name__)

PARAMS_FIELD = "disaggregated_params"
REPORT_KEY = "kv_transfer"
_NOTIFY_TIMEOUT_S = 2.0
_LOOKUP_TIMEOUT_S = 2.0  # a prefill worker that handed out params has published long before

LoadDone = Callable[[int, str, bool, dict[str, Any]], None]  # rank, request id, ok, report


def notify_message(transfer_id: str, blocks_read: int) -> str:
    """The read's completion notification: the transfer id and how many blocks were read (a
    one-sided NIXL read is invisible to the serving side, so the reader tells it)."""
    return f"{transfer_id}|{blocks_read}"


def parse_notify_message(message: str) -> tuple[str, int]:
    """``(transfer_id, blocks_read)``; a bare transfer id counts as nothing read."""
    tid, sep, count = message.rpartition("|")
    if not sep or not count.isdigit():
        return message, 0
    return tid, int(count)


def parse_transfer_params(raw: object) -> KvTransferParams:
    """The mocker's ``disaggregated_params``; ``InvalidRequestError`` naming the field otherwise."""
    if not isinstance(raw, dict):
        raise InvalidRequestError(
            f"{PARAMS_FIELD} must be an object (a mocker prefill worker's KV transfer parameters), got "
            f"{type(raw).__name__}",
            param=PARAMS_FIELD,
        )
    try:
        return msgspec.convert(raw, KvTransferParams)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(
            f"{PARAMS_FIELD} are not a mocker prefill worker's KV transfer parameters: {exc}", param=PARAMS_FIELD
        ) from None


class MockerKvTransfer:
    """Holds (prefill) and reads (decode) of one mocker engine. All on the event loop."""

    def __init__(
        self,
        worker_id: int,
        cores: Sequence[MockerCore],
        memory: KvBlockMemory,
        ctx: KvTransferContext,
        on_load_done: LoadDone,
        on_release: Callable[[int], None],
    ) -> None:
        self.worker_id = worker_id
        self.cores = cores
        self.memory = memory
        self.ctx = ctx
        self._on_load_done = on_load_done
        self._on_release = on_release  # rank whose blocks were freed (the engine wakes it)
        self._hold_rank: dict[str, int] = {}
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self._pulls: dict[str, asyncio.Task[None]] = {}
        self._notifies: set[asyncio.Task[None]] = set()
        # Streamed holds whose prefill still runs: transfer id -> request id, and back; those
        # whose reader let go before the prefill ended (freed as soon as the hold is made).
        self._streams: dict[str, str] = {}
        self._stream_of: dict[str, str] = {}
        self._released_early: set[str] = set()
        self.block_size = cores[0].config.block_size
        self.streaming = ctx.settings.overlap == OVERLAP_CHUNK
        for rank, core in enumerate(cores):
            core.hold_id_prefix = f"{worker_id:x}-{rank}-"
            if self.streaming:
                core.enable_hold_streaming()
        ctx.agent.set_notify_callback(self._on_notify)

    # ---- prefill: holds -------------------------------------------------------------------------

    def stream_opened(self, rank: int, hold: KvHold) -> dict[str, Any]:
        """A held prompt was admitted with its whole prompt's blocks: its rows are open for
        streamed reads (the cached prefix ready now), its expiry runs from now, and the
        ``disaggregated_params`` of its early output are returned."""
        tid = hold.transfer_id
        timeout = self.ctx.settings.hold_timeout_s
        self._streams[tid] = hold.request_id
        self._stream_of[hold.request_id] = tid
        self.memory.readiness.open(tid, hold.block_ids, ready=hold.cached_tokens // self.block_size)
        self._expiry[tid] = asyncio.get_running_loop().call_later(timeout, self._expire, tid)
        params = KvTransferParams(
            transfer_id=tid, worker_id=self.worker_id, dp_rank=rank, backend=self.ctx.agent.backend,
            block_ids=hold.block_ids, block_hashes=hold.block_hashes, num_tokens=hold.num_tokens,
            cached_tokens=hold.cached_tokens, expires_at=time.time() + timeout, streaming=True,
        )
        return msgspec.to_builtins(params)

    def progress(self, prefill_progress: list[tuple[str, int, int]]) -> None:
        """A step's prefill chunks were computed: their streamed rows are ready."""
        stream_of = self._stream_of
        readiness = self.memory.readiness
        for request_id, _before, after in prefill_progress:
            tid = stream_of.get(request_id)
            if tid is not None:
                readiness.advance(tid, after // self.block_size)

    def stream_failed(self, transfer_id: str, reason: str) -> None:
        """A streamed prefill will not end in a hold (preempted): its readers fail now."""
        request_id = self._streams.pop(transfer_id, None)
        if request_id is None:
            return
        self._stream_of.pop(request_id, None)
        self._end_stream(transfer_id, reason)

    def stream_aborted(self, request_id: str) -> None:
        """The prefill request was aborted (its client or the frontend went away)."""
        tid = self._stream_of.pop(request_id, None)
        if tid is not None:
            self._streams.pop(tid, None)
            self._end_stream(tid, "the prefill was aborted on the prefill worker")

    def _end_stream(self, transfer_id: str, reason: str) -> None:
        self._released_early.discard(transfer_id)
        timer = self._expiry.pop(transfer_id, None)
        if timer is not None:
            timer.cancel()
        if self.memory.readiness.fail(transfer_id, reason):
            logger.info("kv stream failed worker_id=%016x transfer_id=%s reason=%r", self.worker_id, transfer_id, reason)

    def hold_created(self, rank: int, hold: KvHold) -> dict[str, Any]:
        """Arms the hold's expiry and returns the final output's ``disaggregated_params``; a
        streamed hold's last rows become ready with its checksum (or, if its reader let go
        meanwhile, it is freed at once)."""
        timeout = self.ctx.settings.hold_timeout_s
        tid = hold.transfer_id
        streamed = self._streams.pop(tid, None) is not None
        if streamed:
            self._stream_of.pop(hold.request_id, None)
            timer = self._expiry.pop(tid, None)
            if timer is not None:
                timer.cancel()
        self._hold_rank[tid] = rank
        self._expiry[tid] = asyncio.get_running_loop().call_later(timeout, self._expire, tid)
        self._update_held()
        checksum = self.memory.checksum(hold.block_ids)
        now = time.time()
        params = KvTransferParams(
            transfer_id=tid,
            worker_id=self.worker_id,
            dp_rank=rank,
            backend=self.ctx.agent.backend,
            block_ids=hold.block_ids,
            block_hashes=hold.block_hashes,
            num_tokens=hold.num_tokens,
            cached_tokens=hold.cached_tokens,
            first_token=hold.first_token,
            expires_at=now + timeout,
            checksum=checksum,
            computed_at=now,
        )
        if streamed:
            if tid in self._released_early:
                self._released_early.discard(tid)
                self._release(tid)
            else:
                self.memory.readiness.complete(tid, checksum, now)
        else:
            self.ctx.agent.expect_reads()  # the decode worker reads these blocks once it has the params
        return msgspec.to_builtins(params)

    def release(self, transfer_id: str) -> KvHold | None:
        """Frees a hold nobody will read (its request's client went away)."""
        return self._release(transfer_id)

    def _on_notify(self, message: str) -> None:
        transfer_id, blocks_read = parse_notify_message(message)
        if transfer_id in self._streams:
            # The reader let go before the prefill ended (it prefills locally): free the hold as
            # soon as it is made, and fail any other read of it.
            self._released_early.add(transfer_id)
            self.memory.readiness.fail(transfer_id, "its reader gave up")
            logger.debug("kv stream released early worker_id=%016x transfer_id=%s", self.worker_id, transfer_id)
            return
        hold = self._release(transfer_id)
        if hold is None:
            logger.debug("kv notify for no hold worker_id=%016x transfer_id=%s", self.worker_id, transfer_id)
            return
        if blocks_read:
            self.ctx.stats.served(blocks_read, blocks_read * self.memory.block_bytes)
        logger.debug(
            "kv hold released worker_id=%016x transfer_id=%s blocks=%d read=%d",
            self.worker_id, transfer_id, len(hold.block_ids), blocks_read,
        )

    def _expire(self, transfer_id: str) -> None:
        self._expiry.pop(transfer_id, None)
        if transfer_id in self._streams:  # the prefill outlived the hold timeout
            self._released_early.add(transfer_id)
            self.memory.readiness.fail(transfer_id, "the hold expired before its prefill ended")
            self.ctx.stats.hold_expired()
            return
        hold = self._release(transfer_id)
        if hold is not None:
            self.ctx.stats.hold_expired()
            logger.info(
                "kv hold expired worker_id=%016x transfer_id=%s request_id=%s blocks=%d timeout_s=%g",
                self.worker_id, transfer_id, hold.request_id, len(hold.block_ids), self.ctx.settings.hold_timeout_s,
            )

    def _release(self, transfer_id: str) -> KvHold | None:
        rank = self._hold_rank.pop(transfer_id, None)
        timer = self._expiry.pop(transfer_id, None)
        if timer is not None:
            timer.cancel()
        if rank is None:
            return None
        self.memory.readiness.close(transfer_id)
        hold = self.cores[rank].release_hold(transfer_id)
        self._update_held()
        if hold is not None:
            self._on_release(rank)
        return hold

    def forget_released(self) -> None:
        """After the cores released holds themselves (clear, sleep): drop their timers."""
        for tid in [t for t, rank in self._hold_rank.items() if t not in self.cores[rank].holds]:
            self._hold_rank.pop(tid, None)
            self.memory.readiness.close(tid)
            timer = self._expiry.pop(tid, None)
            if timer is not None:
                timer.cancel()
        live = set().union(*(core.scheduler.requests for core in self.cores))
        for request_id in [r for r in self._stream_of if r not in live]:
            self.stream_aborted(request_id)
        self._update_held()

    def _update_held(self) -> None:
        self.ctx.stats.set_held_blocks(sum(core.num_held_blocks for core in self.cores))

    # ---- decode: reads --------------------------------------------------------------------------

    def start_loads(self, rank: int, loads: list[RemoteLoad]) -> None:
        for load in loads:
            self._pulls[load.request_id] = asyncio.create_task(
                self._pull(rank, load), name=f"kv-pull-{self.worker_id:x}-{load.request_id}"
            )

    def cancel_load(self, request_id: str) -> None:
        """The request was aborted: stop its read (its blocks are freed when the task ends)."""
        task = self._pulls.get(request_id)
        if task is not None:
            task.cancel()

    async def _pull(self, rank: int, load: RemoteLoad) -> None:
        params = load.params
        settings = self.ctx.settings
        k = load.num_local_hits
        streamed = params.streaming
        report: dict[str, Any] = {
            "ok": False,
            "transfer_id": params.transfer_id,
            "from_worker_id": params.worker_id,
            "blocks": 0,
            "bytes": 0,
            "local_hit_blocks": k,
            "expected": params.checksum,
            "streamed": streamed,
        }
        started = time.monotonic()
        meta: KvTransferMetadata | None = None
        ok = False
        reason: str | None = None
        try:
            if len(params.block_ids) != len(load.local_block_ids) or params.num_tokens != load.num_tokens:
                raise _Mismatch(
                    f"the prefill worker holds {params.num_tokens} tokens in {len(params.block_ids)} blocks, "
                    f"this request has {load.num_tokens} in {len(load.local_block_ids)} (block sizes differ?)"
                )
            meta = await self.ctx.directory.lookup(
                params.worker_id, settings.peer_component, timeout_s=min(_LOOKUP_TIMEOUT_S, settings.transfer_timeout_s)
            )
            budget = settings.transfer_timeout_s
            if streamed:  # the read also waits out the prefill: it may last until the hold expires
                budget = max(budget, params.expires_at - time.time())
            remaining = budget - (time.monotonic() - started)
            if remaining <= 0:
                raise KvTransferTimeout(f"no time left to read after finding agent {meta.agent_name}")
            result = await self.ctx.agent.read_blocks(
                meta, params.block_ids[k:], load.local_block_ids[k:], timeout_s=remaining,
                notify=notify_message(params.transfer_id, len(params.block_ids) - k),
                transfer_id=params.transfer_id if streamed else None, streamed=streamed,
                idle_timeout_s=settings.transfer_timeout_s,  # a streamed read: a silent peer is stalled
            )
            landed = time.time()
            checksum = self.memory.checksum(load.local_block_ids)
            expected = params.checksum if params.checksum is not None else result.checksum
            report.update(
                blocks=result.num_blocks, bytes=result.num_bytes, ms=round(result.seconds * 1000.0, 3),
                backend=result.backend, checksum=checksum, expected=expected,
            )
            computed_at = result.ready_at if streamed else params.computed_at
            exposed_ms = max((landed - computed_at) * 1000.0, 0.0) if computed_at > 0 else None
            if exposed_ms is not None:
                report["exposed_ms"] = round(exposed_ms, 3)
            if expected is not None and checksum != expected:
                reason = REASON_CHECKSUM
                report["reason"] = f"checksum {checksum:#x} of the received blocks is not the prefill's {expected:#x}"
            else:
                ok = True
                if streamed and exposed_ms is not None:
                    # A streamed read's wall time includes the prefill it waited out: what the
                    # transfer costs the first token (and what the router's estimate learns) is
                    # the part after the prefill's last block.
                    result = dataclasses.replace(result, seconds=exposed_ms / 1000.0)
                self.ctx.stats.pulled(result)
                if exposed_ms is not None:
                    self.ctx.stats.exposed(exposed_ms, streamed)
        except asyncio.CancelledError:
            report["reason"] = "aborted"
            self._notify_later(meta, params)
            raise
        except KvTransferTimeout as exc:
            reason, report["reason"] = REASON_TIMEOUT, str(exc)
        except KvTransferError as exc:
            reason, report["reason"] = REASON_PEER_LOST, str(exc)
        except NotFoundError as exc:
            reason, report["reason"] = REASON_PEER_LOST, str(exc)
        except _Mismatch as exc:
            reason, report["reason"] = REASON_ERROR, str(exc)
        except Exception as exc:  # a bug or an unexpected refusal: fall back all the same
            logger.exception("kv read crashed worker_id=%016x request_id=%s", self.worker_id, load.request_id)
            reason, report["reason"] = REASON_ERROR, f"{type(exc).__name__}: {exc}"
        finally:
            self._pulls.pop(load.request_id, None)
            report["ok"] = ok
            report.setdefault("ms", round((time.monotonic() - started) * 1000.0, 3))
            if reason is not None:
                report["failure"] = reason
                self.ctx.stats.failed(reason)
                logger.warning(
                    "kv read failed, prefilling locally worker_id=%016x request_id=%s from_worker_id=%016x "
                    "transfer_id=%s failure=%s reason=%r",
                    self.worker_id, load.request_id, params.worker_id, params.transfer_id, reason, report["reason"],
                )
                if reason != REASON_CHECKSUM:  # a checksum failure's read already notified
                    self._notify_later(meta, params)
            self._on_load_done(rank, load.request_id, ok, report)

    def _notify_later(self, meta: KvTransferMetadata | None, params: KvTransferParams) -> None:
        """Best effort: tells the prefill worker to free its hold (it expires otherwise)."""
        if meta is None:
            return
        task = asyncio.create_task(self._notify(meta, params.transfer_id))
        self._notifies.add(task)
        task.add_done_callback(self._notifies.discard)

    async def _notify(self, meta: KvTransferMetadata, transfer_id: str) -> None:
        try:
            await self.ctx.agent.notify(meta, notify_message(transfer_id, 0), timeout_s=_NOTIFY_TIMEOUT_S)
        except Exception as exc:  # the peer is gone: its hold dies with it
            logger.debug("kv notify failed worker_id=%016x transfer_id=%s error=%s", self.worker_id, transfer_id, exc)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def abort_loads(self) -> None:
        """Cancels every read and waits until their blocks are handed back (sleep, stop)."""
        tasks = list(self._pulls.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Ends reads, notifications and holds (the engine stops)."""
        await self.abort_loads()
        notifies = list(self._notifies)
        for task in notifies:
            task.cancel()
        await asyncio.gather(*notifies, return_exceptions=True)
        for request_id in list(self._stream_of):
            self.stream_aborted(request_id)
        for tid in list(self._hold_rank):
            self._release(tid)


class _Mismatch(Exception):
    """The parameters do not describe this request's prompt in this worker's block layout."""
