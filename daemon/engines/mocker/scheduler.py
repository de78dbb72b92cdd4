"""A vLLM v1-like scheduler: waiting and running queues, a token budget, chunked prefill and
preemption by recompute.

``schedule()`` decides what one engine step computes; ``update_from_output()`` applies the step's
result (samples a token for every request whose known tokens are now all computed, checks stop
conditions, frees finished requests). Like vLLM there is no separate prefill and decode phase in
the policy: each request needs ``num_tokens - num_computed_tokens`` more tokens, decodes need 1,
and the budget ``max_num_batched_tokens`` is spent on running requests first (in order), then on
admitting waiting ones. When a running request cannot grow, the newest running request (the tail)
is preempted: its blocks are freed and it goes back to the front of the waiting queue to be
recomputed later, keeping the tokens it already produced.

``policy="priority"`` is vLLM's ``--scheduling-policy priority``: waiting requests are admitted by
``(priority, arrival)`` (lower first: vLLM's convention; request_queue.py), and the request
preempted when one cannot grow is the running one with the largest ``(priority, arrival)``, even
one already scheduled this step (its tokens go back to the budget), so urgent requests keep their
blocks under memory pressure. As in vLLM, a waiting request never preempts a running one: priority
decides who is admitted when a slot frees and who loses blocks when memory runs out.

Disaggregation follows vLLM's connector states. A decode request whose prompt KV lives on a prefill
worker (``request.remote``) is admitted like any other, but its blocks are allocated for the whole
prompt at once (leading prefix-cache hits included, the rest kept out of the prefix cache) and it
moves to ``WAITING_FOR_REMOTE_KVS``: not schedulable, listed in ``SchedulerOutput.remote_loads`` for
the engine to read. ``finish_remote_load`` puts it back at the head of the waiting queue: with its
KV in place (only the last prompt token is computed here, as vLLM recomputes it to sample the first
token; that costs a decode slot, not a prefill) or, when the read failed, with no blocks, to be
prefilled locally. A prefill worker's request (``hold_kv``) keeps its blocks when it finishes; the
core hands them to a hold. With ``allocate_holds_whole`` (the KV transfer overlapped with the
prefill) such a request gets blocks for its whole prompt when it is admitted, as a remote decode
does, so their rows can be handed to the decode worker before the first chunk is computed; they
join the prefix cache chunk by chunk as usual, as their tokens are computed.

Onboarding from the disk tier waits the same way, but before admission: a waiting request whose
prefix continues in block files that must be read first starts the reads and moves to
``WAITING_FOR_DISK_KVS`` holding no blocks; the requests behind it are admitted meanwhile. Each
step polls the tier's I/O; when its reads have all ended the request goes back to the head of the
waiting queue with the bytes (``staged_kv``) and is admitted as usual, onboarding as far as the
bytes go and prefilling the rest. It waits at most once per admission.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from dynamod.daemon.engines.mocker.block_pool import KVBlock
from dynamod.daemon.engines.mocker.kv_manager import KVCacheManager
from dynamod.daemon.engines.mocker.request import MockRequest, RequestStatus
from dynamod.daemon.engines.mocker.request_queue import POLICY_FCFS, POLICY_PRIORITY, create_request_queue
from dynamod.daemon.engines.mocker.tiers import OnboardPlan
from dynamod.shared.protocol.llm import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP

logger = logging.getLogger(__name__)

_NO_BLOCKS: list[KVBlock] = []


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes. ``prefill_*`` are parallel lists."""

    prefill_reqs: list[MockRequest] = field(default_factory=list)
    prefill_num_tokens: list[int] = field(default_factory=list)
    decode_reqs: list[MockRequest] = field(default_factory=list)
    preempted_reqs: list[MockRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0  # new (uncached) prefill tokens that cost compute this step
    onboard_ms: float = 0.0  # copying prefix blocks back from the host/disk tiers
    remote_loads: list[MockRequest] | None = None  # admitted this step to wait for remote KV

    @property
    def is_empty(self) -> bool:
        return not self.prefill_reqs and not self.decode_reqs


class DecodeStretch(NamedTuple):
    """``Scheduler.decode_stretch``: plain decode steps ahead, and whether a block-filling one follows."""

    plain: int
    then_fills: bool


NO_DECODE_STRETCH = DecodeStretch(0, False)

# A request's prompt -> its (local, sequence) block hashes, what ``MockRequest.hash_prompt`` would
# set: fresh lists the request owns (it extends them over generated tokens).
PromptHasher = Callable[[MockRequest], tuple[list[int], list[int]]]


@dataclass(slots=True)
class UpdateResult:
    """Tokens sampled this step (parallel lists) and the requests that finished."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finished: list[MockRequest] = field(default_factory=list)
    # (request id, the sampled token's logprob, its top alternatives or None) for the requests
    # that asked for log-probabilities, in sampling order.
    logprobs: list[tuple[str, float, list[tuple[int, float]] | None]] = field(default_factory=list)


def _least_urgent(running: list[MockRequest]) -> int:
    """The index of the running request vLLM's priority policy preempts: the largest
    ``(priority, arrival)``, i.e. the least urgent and, among equals, the newest."""
    best = 0
    key = (running[0].priority, running[0].arrival)
    for j in range(1, len(running)):
        r = running[j]
        k = (r.priority, r.arrival)
        if k > key:
            best, key = j, k
    return best


def _unschedule(out: SchedulerOutput, request: MockRequest) -> int:
    """Takes ``request`` out of this step's batch (it is being preempted after it was scheduled);
    returns the tokens it had been given."""
    for j, r in enumerate(out.decode_reqs):
        if r is request:
            del out.decode_reqs[j]
            return 1
    for j, r in enumerate(out.prefill_reqs):
        if r is request:
            del out.prefill_reqs[j]
            num = out.prefill_num_tokens.pop(j)
            if not request.kv_transferred:
                out.num_prefill_tokens -= num
            return num
    return 0


class Scheduler:
    """Owns the request queues of one data-parallel rank; memory decisions go to the KV manager."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark_blocks: int,
        context_length: int,
        prompt_hasher: PromptHasher | None = None,
        policy: str = POLICY_FCFS,
    ) -> None:
        """``policy``: vLLM's ``--scheduling-policy``, ``fcfs`` or ``priority`` (request_queue.py)."""
        self.kv_manager = kv_manager
        # Gives an admitted request's (local, sequence) prompt hashes; None: the request hashes
        # its own prompt (``MockRequest.hash_prompt``). See ``MockerCore``.
        self.prompt_hasher = prompt_hasher
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks
        self.context_length = context_length
        self.requests: dict[str, MockRequest] = {}
        self.policy = policy
        self.waiting = create_request_queue(policy)
        self._arrivals = itertools.count()
        self.running: list[MockRequest] = []
        self.waiting_for_remote: dict[str, MockRequest] = {}
        # Held prefill requests get their whole prompt's blocks at admission (streamed transfers).
        self.allocate_holds_whole = False
        # Aborted while their KV was being read: the read may still write into their blocks, so
        # the blocks are freed when it ends (``finish_remote_load``), not at the abort.
        self._aborted_loads: dict[str, MockRequest] = {}
        self.num_preemptions = 0
        # Prefix-cache statistics over first schedulings (what usage reports as cached tokens).
        self.prompt_tokens_seen = 0
        self.cached_tokens_seen = 0
        # Of the cached tokens, those onboarded from each lower tier (medium -> tokens).
        self.onboarded_tokens_seen: dict[str, int] = {}
        # Waiting for disk-tier reads: request id -> the block hashes still being read.
        self.reading_from_disk: dict[str, tuple[MockRequest, set[int]]] = {}

    # ---- request lifecycle ---------------------------------------------------------------------

    def add_request(self, request: MockRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if self.kv_manager.enable_caching:
            if self.prompt_hasher is None:
                request.hash_prompt(self.kv_manager.block_size)
            else:
                request.local_hashes, request.block_hashes = self.prompt_hasher(request)
        request.arrival = next(self._arrivals)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> MockRequest | None:
        """Removes a request wherever it is and frees its blocks; None if unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.waiting_for_remote[request_id]
            self._aborted_loads[request_id] = request
            request.status = RequestStatus.FINISHED
            return request
        elif request.status == RequestStatus.WAITING_FOR_DISK_KVS:
            del self.reading_from_disk[request_id]  # it holds no blocks; its reads end unheeded
            request.staged_kv = None
            request.status = RequestStatus.FINISHED
            return request
        else:
            self.waiting.remove(request)
        self.kv_manager.free(request)
        request.status = RequestStatus.FINISHED
        return request

    def finish_remote_load(self, request_id: str, ok: bool) -> bool:
        """Ends a request's wait for remote KV: ``ok`` when every block not cached here arrived
        (intact), else it will be prefilled locally. False when the request was aborted meanwhile
        (its blocks are freed now) or is unknown."""
        request = self.waiting_for_remote.pop(request_id, None)
        kv = self.kv_manager
        if request is None:
            aborted = self._aborted_loads.pop(request_id, None)
            if aborted is not None:
                kv.free(aborted)
            return False
        request.remote = None
        if ok:
            kv.cache_blocks(request, request.num_tokens)
            request.num_computed_tokens = request.num_tokens - 1
            request.kv_transferred = True
        else:
            kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return True

    @property
    def num_loading(self) -> int:
        """Requests whose KV is being read from another worker (aborted ones included)."""
        return len(self.waiting_for_remote) + len(self._aborted_loads)

    def num_loading_only_blocks(self) -> int:
        """Blocks referenced only by requests whose KV is still being read (aborted ones
        included): allocated for a prompt whose bytes have not landed, so no step attends them
        (a leading prefix hit also used by a running request is attended by that one)."""
        loading = [*self.waiting_for_remote.values(), *self._aborted_loads.values()]
        if not loading:
            return 0
        held: dict[int, tuple[KVBlock, int]] = {}  # id(block) -> (block, loading requests holding it)
        for request in loading:
            for block in request.blocks:
                seen = held.get(id(block))
                held[id(block)] = (block, 1 if seen is None else seen[1] + 1)
        return sum(1 for block, n in held.values() if block.ref_cnt == n)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet (those waiting for disk reads included)."""
        return len(self.waiting) + len(self.reading_from_disk)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- plain decode steps in bulk ------------------------------------------------------------

    def decode_stretch(self) -> DecodeStretch:
        """The coming steps that would only decode, as far as they can be told now.

        A plain step takes ``schedule``'s decode hot path for every running request (no block to
        allocate or cache), admits nothing (nothing waits) and finishes nothing: it changes no
        block, queue or load figure, only each request's tokens and progress. A trace replayer
        runs a stretch of them at once (``run_plain_decode_steps``) instead of step by step.
        ``then_fills``: the step after them still only decodes, allocates nothing and finishes
        nothing, but fills a block that joins the prefix cache (a ``KvStored`` at its end); the
        replayer runs it with ``step(admit=False)`` once the stretch is over. A request that may
        stop on a sampled token (stop ids, a sampler) makes every step a possible finish, so it
        allows no stretch at all.
        """
        running = self.running
        if self.waiting or self.reading_from_disk or not running or len(running) > self.max_num_batched_tokens:
            return NO_DECODE_STRETCH
        bs = self.kv_manager.block_size
        caching = self.kv_manager.enable_caching
        context_length = self.context_length
        fewest = fewest_allocating = context_length  # steps before any event; before a non-fill one
        for request in running:
            if request.stop_ids or request.sampler is not None:
                return NO_DECODE_STRETCH
            num_computed = request.num_computed_tokens
            num_tokens = len(request.token_ids)
            if num_tokens - num_computed != 1 or num_computed < request.prefill_target:
                return NO_DECODE_STRETCH  # still prefilling (or recomputing after a preemption)
            # Steps before one needs a new block, or samples the request's last token.
            steps = min(len(request.blocks) * bs - num_computed,
                        request.max_output_tokens - (num_tokens - request.num_prompt_tokens) - 1,
                        context_length - num_tokens - 1)
            if steps < fewest_allocating:
                fewest_allocating = steps
            if caching:
                steps = min(steps, bs - 1 - num_computed % bs)  # before one fills a block
            if steps < fewest:
                fewest = steps
        if fewest < 0:
            return NO_DECODE_STRETCH
        return DecodeStretch(fewest, fewest < fewest_allocating)

    def run_plain_decode_steps(self, num_steps: int) -> list[MockRequest]:
        """Applies ``num_steps`` plain decode steps (at most ``decode_stretch().plain``): each running
        request samples ``num_steps`` tokens exactly as that many ``schedule`` +
        ``update_from_output`` rounds would. Returns the running requests (each produced a token
        in every one of the steps)."""
        running = list(self.running)
        for request in running:
            request.append_plain_tokens(num_steps)
            request.num_computed_tokens += num_steps
        return running

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, admit: bool = True) -> SchedulerOutput:
        """What the next step computes. ``admit=False`` leaves waiting requests waiting (a replayer
        running, after the fact, a step that began before they arrived)."""
        kv = self.kv_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = self.running
        prefill_reqs, prefill_tokens, decode_reqs = out.prefill_reqs, out.prefill_num_tokens, out.decode_reqs

        bs = kv.block_size
        caching = kv.enable_caching
        tiers = kv.tiers
        if tiers is not None and tiers.io is not None:
            self._collect_disk_reads(tiers.poll())

        # 1. Running requests, in order; when one cannot grow, preempt the newest (fcfs) or the
        # least urgent, newest first (priority: vLLM's max over (priority, arrival)).
        by_priority = self.policy == POLICY_PRIORITY
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            num_new = len(request.token_ids) - num_computed
            if (
                num_new == 1
                and num_computed < len(request.blocks) * bs
                and not (caching and (num_computed + 1) % bs == 0)
                and num_computed >= request.prefill_target
            ):
                # Hot path: a decode whose token fits in its last block without filling it has
                # nothing to allocate or cache.
                budget -= 1
                decode_reqs.append(request)
                i += 1
                continue
            if num_new > budget:
                num_new = budget
            while kv.allocate_slots(request, num_new) is None:
                if by_priority:
                    at = _least_urgent(running)
                    victim = running.pop(at)
                    if at < i:  # already scheduled this step: give its tokens back
                        budget += _unschedule(out, victim)
                        i -= 1
                else:
                    victim = running.pop()
                self._preempt(victim)
                out.preempted_reqs.append(victim)
                if victim is request:
                    break
            else:
                budget -= num_new
                if request.num_computed_tokens < request.prefill_target:
                    prefill_reqs.append(request)
                    prefill_tokens.append(num_new)
                    if not request.kv_transferred:
                        out.num_prefill_tokens += num_new
                else:
                    decode_reqs.append(request)
                i += 1
                continue
            # The request preempted itself: under fcfs every request behind it is preempted
            # already; under priority the others wait for the next step (vLLM stops here too).
            break

        # 2. Admit waiting requests, unless memory was short this step.
        if admit and not out.preempted_reqs:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                request = waiting[0]
                # Keep the watermark only while others run: alone, a request may use every block.
                watermark = self.watermark_blocks if running else 0
                if request.remote is not None:
                    if not self._admit_remote(request, watermark):
                        break
                    waiting.popleft()
                    if out.remote_loads is None:
                        out.remote_loads = []
                    out.remote_loads.append(request)
                    continue
                arrived = bool(request.blocks)
                if arrived:
                    # Its prompt's KV arrived from a prefill worker: the blocks are in place.
                    hits, num_hit_tokens, num_new_hit = _NO_BLOCKS, request.num_computed_tokens, 0
                    plan = None
                else:
                    hits, num_hit_tokens = kv.get_computed_blocks(request)
                    # The prefix may go on in the host or disk tier: onboard instead of recompute.
                    plan = kv.find_offloaded(request, len(hits)) if tiers is not None else None
                    if plan is not None and tiers.io is not None:  # type: ignore[union-attr]
                        first = tiers.first_unread(plan, request.staged_kv)  # type: ignore[union-attr]
                        if first < len(plan.entries):
                            if request.staged_kv is None and self._start_disk_reads(request, plan):
                                waiting.popleft()
                                continue  # it waits off the queue; the next request may go ahead
                            plan = plan.head(first)
                    if plan is not None:
                        num_hit_tokens += len(plan.entries) * bs
                    num_new_hit = num_hit_tokens
                num_new = request.num_tokens - num_hit_tokens
                whole = num_new if request.hold_kv and self.allocate_holds_whole and not arrived else 0
                if num_new > budget:
                    num_new = budget  # chunked prefill
                if whole:
                    # Every block now, the prefix cache only up to this chunk (its bytes exist then).
                    if kv.allocate_slots(request, whole, hits, num_new_hit, watermark, delay_caching=True) is None:
                        break
                    kv.cache_blocks(request, num_hit_tokens + num_new)
                elif kv.allocate_slots(request, num_new, hits, num_new_hit, watermark) is None:
                    break
                waiting.popleft()
                if not arrived and plan is not None:
                    out.onboard_ms += kv.onboard(request, plan)
                request.staged_kv = None
                request.num_computed_tokens = num_hit_tokens
                request.status = RequestStatus.RUNNING
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                    self.prompt_tokens_seen += request.num_prompt_tokens
                    self.cached_tokens_seen += num_hit_tokens
                    if not arrived and plan is not None:
                        seen = self.onboarded_tokens_seen
                        for medium in plan.media:
                            seen[medium] = seen.get(medium, 0) + bs
                running.append(request)
                budget -= num_new
                if arrived:
                    # The last prompt token after a transfer: one token in the batch, a decode slot.
                    decode_reqs.append(request)
                    continue
                prefill_reqs.append(request)
                prefill_tokens.append(num_new)
                if not request.kv_transferred:
                    out.num_prefill_tokens += num_new
        return out

    def _start_disk_reads(self, request: MockRequest, plan: OnboardPlan) -> bool:
        """Starts the block-file reads ``request`` needs to onboard ``plan`` and parks it until
        they end; False if the I/O queue took none (it is admitted without them)."""
        tiers = self.kv_manager.tiers
        assert tiers is not None
        staged: dict[int, np.ndarray] = {}
        hashes = tiers.start_reads(plan, staged)
        if not hashes:
            return False
        request.staged_kv = staged
        request.status = RequestStatus.WAITING_FOR_DISK_KVS
        self.reading_from_disk[request.request_id] = (request, set(hashes))
        return True

    def _collect_disk_reads(self, finished: dict[int, np.ndarray | None]) -> None:
        """Hands finished reads to the requests waiting for them; those with nothing left to wait
        for go back to the head of the waiting queue, in the order they started waiting."""
        if not finished or not self.reading_from_disk:
            return
        ready: list[MockRequest] = []
        for request_id, (request, outstanding) in list(self.reading_from_disk.items()):
            staged = request.staged_kv
            assert staged is not None
            for h in outstanding & finished.keys():
                data = finished[h]
                if data is not None:
                    staged[h] = data
                outstanding.discard(h)
            if not outstanding:
                del self.reading_from_disk[request_id]
                request.status = RequestStatus.WAITING
                ready.append(request)
        self.waiting.extendleft(reversed(ready))

    def _admit_remote(self, request: MockRequest, watermark: int) -> bool:
        """Allocates the whole prompt for a remote read; False if it does not fit now."""
        kv = self.kv_manager
        remote = request.remote
        assert remote is not None
        hits, num_hit_tokens = kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit_tokens
        if kv.allocate_slots(request, num_new, hits, num_hit_tokens, watermark, delay_caching=True) is None:
            return False
        remote.local_hit_blocks = len(hits)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
            self.prompt_tokens_seen += request.num_prompt_tokens
            self.cached_tokens_seen += num_hit_tokens
        self.waiting_for_remote[request.request_id] = request
        return True

    def _preempt(self, request: MockRequest) -> None:
        """Frees a running request's blocks and puts it back in the waiting queue (its front under
        fcfs, its place by priority under priority), keeping the tokens it produced."""
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.prefill_target = request.num_tokens
        request.kv_transferred = False  # the transferred KV is gone; recompute it here
        request.remote = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug(
            "mocker preempted request_id=%s tokens=%d preemptions=%d free_blocks=%d",
            request.request_id, request.num_tokens, request.num_preemptions, self.kv_manager.num_free_blocks,
        )

    def update_from_output(self, sched: SchedulerOutput) -> UpdateResult:
        """Advances every scheduled request; samples where all known tokens are now computed."""
        result = UpdateResult()
        for request, num_new in zip(sched.prefill_reqs, sched.prefill_num_tokens, strict=True):
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= request.num_tokens:
                self._sample(request, result)
        sample = self._sample
        for request in sched.decode_reqs:
            request.num_computed_tokens += 1
            sample(request, result)
        if result.finished:
            finished = set(map(id, result.finished))
            self.running = [r for r in self.running if id(r) not in finished]
        return result

    def _sample(self, request: MockRequest, result: UpdateResult) -> None:
        sampler = request.sampler
        if sampler is None:
            token = request.next_token()
        else:
            try:
                token = sampler.sample(request)
            except Exception:  # one request's parameters must not fail the others in the batch
                logger.exception("mocker sampling failed request_id=%s action=fail_request", request.request_id)
                self._finish(request, FINISH_ERROR, result)
                return
        tokens = request.token_ids
        tokens.append(token)
        result.req_ids.append(request.request_id)
        result.token_ids.append(token)
        if sampler is not None and sampler.num_top is not None:
            result.logprobs.append((request.request_id, sampler.last_logprob, sampler.last_top))
        num_out = len(tokens) - request.num_prompt_tokens
        if request.stop_ids and token in request.stop_ids and num_out >= request.min_tokens:
            reason = FINISH_STOP
        elif sampler is not None and sampler.complete:
            reason = FINISH_STOP  # the output constraint is satisfied (the grammar ends here)
        elif num_out >= request.max_output_tokens or len(tokens) >= self.context_length:
            reason = FINISH_LENGTH
        else:
            return
        self._finish(request, reason, result)

    def _finish(self, request: MockRequest, reason: str, result: UpdateResult) -> None:
        request.finish_reason = reason
        request.status = RequestStatus.FINISHED
        if not request.hold_kv or reason == FINISH_ERROR:  # else the core moves the blocks to a hold
            self.kv_manager.free(request)
        del self.requests[request.request_id]
        result.finished.append(request)

    # ---- cache control -------------------------------------------------------------------------

    def reset_prefix_cache(self, medium: str | None = None) -> int:
        return self.kv_manager.reset_prefix_cache(medium)
