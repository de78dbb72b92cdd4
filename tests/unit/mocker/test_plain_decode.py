"""Plain decode steps in bulk: ``run_plain_decode_steps(k)`` leaves a core exactly as k ``step()`` calls.

A trace replay spends most of its steps decoding without touching a block; it runs those stretches
in one call. Two twin cores get the same requests; one always calls ``step()``, the other jumps
over every stretch ``decode_stretch()`` announces (then runs the block-filling step it announces
with ``step(admit=False)``). Their tokens, finishes, KV events, step counts and simulated time must
agree to the last bit, and every announced step must really be what was announced when stepped
one by one.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dynamod.daemon.engines.mocker.core import MockerCore, StepOutput
from dynamod.shared.protocol.kv_events import KvStored
from tests.unit.mocker.factories import make_config, make_core


def _assert_plain(out: StepOutput, batch: int, step_ms: float) -> None:
    assert out.num_prefill_reqs == 0 and out.num_prefill_tokens == 0 and out.num_preempted == 0
    assert out.num_decode_reqs == batch == len(out.req_ids)
    assert not out.finished and not out.kv_events
    assert out.duration_ms == step_ms


class _Twins:
    """A stepped core and a jumping core fed the same requests."""

    def __init__(self, **config: object) -> None:
        self.stepped = MockerCore(make_config(**config))
        self.jumping = MockerCore(make_config(**config))
        self.tokens: dict[str, tuple[list[int], list[int]]] = {}
        self.events: tuple[list, list] = ([], [])
        self.finished: tuple[list, list] = ([], [])
        self.jumps = 0
        self.fills = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, **kw: object) -> None:
        for core in (self.stepped, self.jumping):
            core.add_request(rid, prompt, max_tokens=max_tokens, ignore_eos=True, **kw)
        self.tokens[rid] = ([], [])

    def _record(self, side: int, out: StepOutput) -> None:
        for rid, tok in zip(out.req_ids, out.token_ids, strict=True):
            self.tokens[rid][side].append(tok)
        self.events[side].extend(out.kv_events)
        self.finished[side].extend((f.request_id, f.finish_reason, f.usage) for f in out.finished)

    def advance(self) -> None:
        """One step on both, or one announced stretch: stepped one by one vs in a single call."""
        stretch = self.jumping.decode_stretch()
        assert stretch == self.stepped.decode_stretch()
        k = stretch.plain
        if k < 1 and not stretch.then_fills:
            self._record(0, self.stepped.step())
            self._record(1, self.jumping.step())
            return
        step_ms = self.jumping.plain_decode_step_ms()
        batch = self.jumping.scheduler.num_running
        for _ in range(k):
            out = self.stepped.step()
            _assert_plain(out, batch, step_ms)
            self._record(0, out)
        if k:
            rids = self.jumping.run_plain_decode_steps(k)
            assert len(rids) == batch
            for rid in rids:
                self.tokens[rid][1].extend(self.jumping.scheduler.requests[rid].token_ids[-k:])
            self.jumps += 1
        # The stretch is as long as it can be: the step after it is not plain.
        assert self.jumping.decode_stretch().plain == 0
        if stretch.then_fills:
            stepped, jumped = self.stepped.step(), self.jumping.step(admit=False)
            # Only decodes, at the plain steps' pace, finishes nothing, and stores what it filled.
            assert stepped.num_decode_reqs == batch and not stepped.num_prefill_reqs and not stepped.finished
            assert stepped.duration_ms == step_ms
            assert stepped.kv_events and all(isinstance(e, KvStored) for e in stepped.kv_events)
            self._record(0, stepped)
            self._record(1, jumped)
            self.fills += 1

    def assert_same(self) -> None:
        for rid, (stepped, jumped) in self.tokens.items():
            assert stepped == jumped, rid
        assert self.events[0] == self.events[1]
        assert self.finished[0] == self.finished[1]
        a, b = self.stepped, self.jumping
        assert (a.num_steps, a.simulated_ms) == (b.num_steps, b.simulated_ms)
        assert a.load() == b.load()


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    caching=st.booleans(),
    requests=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 30), st.integers(1, 40), st.integers(0, 2)),
        min_size=1, max_size=8,
    ),
)
def test_jumping_over_plain_decode_steps_changes_nothing(block_size, caching, requests) -> None:
    """Requests arrive between steps (some share a prefix), batch, cross block boundaries, finish,
    and are preempted: 80 tokens of KV cache hold the longest request, not many at once."""
    twins = _Twins(block_size=block_size, enable_prefix_caching=caching, num_gpu_blocks=80 // block_size)
    pending = sorted(((delay, i, plen, out, family) for i, (delay, plen, out, family) in enumerate(requests)),
                     reverse=True)
    clock = 0
    while pending or twins.stepped.has_unfinished_requests():
        while pending and pending[-1][0] <= clock:
            _, i, plen, out, family = pending.pop()
            prompt = [family * 7 + 1] * 5 + [(i * 13 + j) % 90 + 1 for j in range(plen)]
            twins.add(f"r{i}", prompt, max_tokens=out)
        twins.advance()
        clock += 1
    twins.assert_same()


def test_a_lone_long_decode_is_jumped_block_by_block() -> None:
    twins = _Twins(block_size=4, num_gpu_blocks=64)
    twins.add("a", [1, 2, 3, 4, 5, 6], max_tokens=40)
    while twins.stepped.has_unfinished_requests():
        twins.advance()
    twins.assert_same()
    # 40 tokens cross ~10 blocks of 4: most stretches are 2 plain steps and the one filling the block.
    assert twins.jumps >= 8 and twins.fills >= 8


def test_a_request_added_during_a_stretch_joins_the_step_after_it() -> None:
    """The replayer adds an arriving request before running the stretch its arrival interrupted:
    the steps of that stretch were scheduled before it arrived, so it waits for the next one."""
    stepped, jumping = make_core(num_gpu_blocks=64), make_core(num_gpu_blocks=64)
    for core in (stepped, jumping):
        core.add_request("a", [1, 2, 3, 4, 5, 6], max_tokens=20, ignore_eos=True)
        while core.decode_stretch().plain < 2:  # prefill, then decode to the start of a block
            core.step()
    stretch = jumping.decode_stretch()
    assert stretch.then_fills  # the stretch ends with the step filling "a"'s block
    for _ in range(stretch.plain + 1):
        stepped.step()
    for core in (stepped, jumping):
        core.add_request("b", [9, 9, 9], max_tokens=3, ignore_eos=True)
    jumping.run_plain_decode_steps(stretch.plain)
    fill = jumping.step(admit=False)  # began before "b" arrived: "b" is not in it
    assert fill.req_ids == ["a"] and fill.kv_events
    tail = [(stepped.step(), jumping.step()) for _ in range(3)]
    for a, b in tail:
        assert (a.req_ids, a.token_ids, a.duration_ms) == (b.req_ids, b.token_ids, b.duration_ms)
    assert "b" in tail[0][0].req_ids  # admitted by the first step after the stretch
    assert stepped.scheduler.requests["a"].token_ids == jumping.scheduler.requests["a"].token_ids


def test_requests_that_may_stop_on_a_token_are_never_jumped() -> None:
    core = make_core(num_gpu_blocks=64, eos_token_ids=(7,))
    core.add_request("a", [1, 2, 3, 4, 5, 6], max_tokens=30)  # may sample its eos at any step
    core.step()
    assert core.decode_stretch() == (0, False)
    other = make_core(num_gpu_blocks=64)
    other.add_request("b", [1, 2, 3, 4, 5, 6], max_tokens=30, stop_token_ids=[5])
    other.step()
    assert other.decode_stretch() == (0, False)


def test_nothing_is_plain_while_a_request_waits_or_prefills() -> None:
    core = make_core(num_gpu_blocks=64, max_num_batched_tokens=4)
    core.add_request("a", list(range(1, 11)), max_tokens=30, ignore_eos=True)
    assert core.decode_stretch() == (0, False)  # waiting
    core.step()
    assert core.decode_stretch() == (0, False)  # prefilled 4 of 10 tokens so far
