"""The compiled scheduler loop and active-block sets (daemon/router/core/_native/schedcore.c) against their
Python references: same scores, keys, choices and explanations on random inputs.

Both paths run in one session: the compiled core is imported directly, whatever
``DYN_KV_INDEX_IMPL`` says, and these tests are skipped (saying why) only when it was not built.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from prometheus_client import CollectorRegistry

from dynamod.daemon.router.core import KvRouter, KvRouterConfig
from dynamod.daemon.router.core.active_sequences import ActiveSequences, CountedBlocks
from dynamod.daemon.router.core.scheduler import KvScheduler, weight_ratio
from dynamod.shared.kv.hashing import compute_block_hashes
from dynamod.shared.kv.index_common import OverlapScores
from dynamod.shared.protocol.kv_events import KvStored, RouterEvent, StoredBlock
from dynamod.shared.protocol.routing import CandidateScore

from .kv_impls import SCHED_CORE, needs_sched_native

pytestmark = needs_sched_native

BS = 16
WEIGHTS = [0.0, 0.1, 0.3, 1.0, 2.5, 7.0]
TIER_WEIGHTS = [0.0, 0.25, 0.5, 0.75, 1.0, 0.3]


def _workers(n: int) -> list[tuple[int, int]]:
    # Large, random-looking ids as real instance ids are, and some data-parallel ranks.
    return [((0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 63) - 1), i % 3) for i in range(n)]


def _chains(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts as sequence-hash chains sharing prefixes (few first blocks, branching later)."""
    out: list[list[int]] = []
    for _ in range(count):
        if out and rng.random() < 0.7:
            base = rng.choice(out)
            keep = rng.randint(0, len(base))
            chain = base[:keep]
        else:
            chain = []
        chain = chain + [rng.getrandbits(64) for _ in range(rng.randint(0 if chain else 1, 12))]
        out.append(chain)
    return out


def _twin_actives(rng: random.Random, workers, chains, ops: int) -> tuple[ActiveSequences, ActiveSequences]:
    """The same random history of add / prefill done / free on a Python and a compiled set."""
    py = ActiveSequences(BS, core=None)
    nat = ActiveSequences(BS, core=SCHED_CORE)
    live: list[int] = []
    for i in range(ops):
        roll = rng.random()
        if roll < 0.6 or not live:
            chain = rng.choice(chains)
            worker = rng.choice(workers)
            isl = len(chain) * BS + rng.choice([0, 0, 5])
            prefill = rng.randint(0, isl)
            for a in (py, nat):
                a.add(i, worker, chain, isl, prefill)
            live.append(i)
        elif roll < 0.8:
            rid = rng.choice(live)
            assert py.mark_prefill_done(rid) == nat.mark_prefill_done(rid)
        else:
            rid = live.pop(rng.randrange(len(live)))
            assert py.free(rid) and nat.free(rid)
    assert py.load_terms() == nat.load_terms()
    return py, nat


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_workers=st.integers(1, 40),
    weight=st.sampled_from(WEIGHTS),
    tiered=st.booleans(),
    host_weight=st.sampled_from(TIER_WEIGHTS),
    disk_weight=st.sampled_from(TIER_WEIGHTS),
    temperature=st.sampled_from([0.0, 0.0, 0.5, 2.0]),
)
def test_compiled_and_python_decisions_agree(seed, n_workers, weight, tiered, host_weight, disk_weight, temperature):
    rng = random.Random(seed)
    workers = _workers(n_workers)
    chains = _chains(rng, 12)
    py_active, nat_active = _twin_actives(rng, workers, chains, rng.randint(0, 60))
    for _ in range(5):
        prompt = rng.choice(chains)[: rng.randint(0, 12)] + [rng.getrandbits(64) for _ in range(rng.randint(0, 4))]
        isl = len(prompt) * BS + rng.choice([0, 3, 15])
        held = rng.sample(workers, rng.randint(0, n_workers))
        scores = {w: rng.randint(1, max(1, len(prompt))) for w in held}
        sizes = {w: rng.choice([0, 1, 5, 5, 40]) for w in workers}  # repeated sizes: tie-breaks
        lower = {}
        if tiered:
            lower = {w: (rng.randint(0, 4), rng.randint(0, 4)) for w in rng.sample(workers, rng.randint(1, n_workers))}
        overlaps = OverlapScores(scores, sizes, lower)
        candidates = rng.sample(workers, rng.randint(1, n_workers))
        kwargs = dict(isl=isl, seq_hashes=prompt, overlap_weight=weight, host_weight=host_weight, disk_weight=disk_weight)
        py_sched = KvScheduler(BS, random.Random(seed), core=None)
        nat_sched = KvScheduler(BS, random.Random(seed), core=SCHED_CORE)
        assert (py_sched.implementation, nat_sched.implementation) == ("python", "native")
        py_scores, py_keys = py_sched.score(candidates, overlaps, py_active, **kwargs)
        nat_scores, nat_keys = nat_sched.score(candidates, overlaps, nat_active, **kwargs)
        assert nat_keys == py_keys
        assert nat_scores == py_scores  # every field, floats bit for bit
        py_sel = py_sched.select(py_scores, py_keys, temperature)
        nat_sel = nat_sched.select(nat_scores, nat_keys, temperature)
        assert (nat_sel.index, nat_sel.reason, nat_sel.detail) == (py_sel.index, py_sel.reason, py_sel.detail)
        assert [s.probability for s in nat_scores] == [s.probability for s in py_scores]


def test_values_beyond_exact_arithmetic_take_the_python_path():
    """A weight whose fraction has a huge denominator pushes keys past 2**53: the compiled loop
    declines (None) rather than round differently, and the scheduler's answer is Python's."""
    weight = 0.123457  # 123457/1000000
    a, b = weight_ratio(weight)
    worker = (1, 0)
    overlaps = OverlapScores({}, {worker: 0})
    isl = 1 << 40  # absurd, but the arithmetic must stay exact
    out = SCHED_CORE.score_candidates([worker], {}, {worker: 0}, {}, {}, {}, CandidateScore, isl, BS, a, b * BS, 1, 0, 0)
    assert out is None
    active_py, active_nat = ActiveSequences(BS, core=None), ActiveSequences(BS, core=SCHED_CORE)
    py = KvScheduler(BS, random.Random(0), core=None).score([worker, (2, 0)], overlaps, active_py, isl=isl, seq_hashes=[], overlap_weight=weight)
    nat = KvScheduler(BS, random.Random(0), core=SCHED_CORE).score([worker, (2, 0)], overlaps, active_nat, isl=isl, seq_hashes=[], overlap_weight=weight)
    assert nat == py


def test_compiled_loop_rejects_malformed_candidates():
    with pytest.raises(TypeError):
        SCHED_CORE.score_candidates([[1, 0]], {}, {}, {}, {}, {}, CandidateScore, 16, BS, 1, BS, 1, 0, 0)
    with pytest.raises(TypeError):
        SCHED_CORE.score_candidates([(1, 0)], [], {}, {}, {}, {}, CandidateScore, 16, BS, 1, BS, 1, 0, 0)


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.integers(-(2**62), 2**62) | st.integers(0, 5), min_size=1, max_size=30))
def test_lowest_keys_matches_min_count_index(keys):
    best = min(keys)
    i, ties, second = SCHED_CORE.lowest_keys(keys)
    assert (i, ties) == (keys.index(best), keys.count(best))
    if len(keys) > 1 and ties == 1:
        assert second == keys.index(min(keys[:i] + keys[i + 1 :]))
    assert SCHED_CORE.lowest_keys([1, 2**70]) is None  # not an int64: the caller's Python path


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "release", "probe"]), st.integers(0, 7), st.integers(0, 12), st.integers(-1, 14)),
        max_size=60,
    )
)
def test_active_block_sets_agree(ops):
    """``ActiveBlocks`` (compiled) and ``CountedBlocks`` count, release and search alike, and a
    prefix search's answer does not depend on its hint."""
    rng = random.Random(len(ops))
    chains = _chains(rng, 8)
    py, nat = CountedBlocks(), SCHED_CORE.ActiveBlocks()
    added: list[list[int]] = []
    for op, c, cut, hint in ops:
        chain = chains[c][:cut]
        if op == "add":
            py.add(chain)
            nat.add(chain)
            added.append(chain)
        elif op == "release" and added:
            gone = added.pop(c % len(added))
            py.release(gone)
            nat.release(gone)
        expected = py.shared_prefix(chain)
        assert nat.shared_prefix(chain) == expected
        assert nat.shared_prefix(chain, hint) == expected == py.shared_prefix(chain, hint)
        assert len(nat) == len(py)
        assert all(nat.count(h) == py.count(h) and (h in nat) == (h in py) for ch in chains for h in ch)
    for chain in added:  # releasing everything leaves nothing
        py.release(chain)
        nat.release(chain)
    assert len(py) == len(nat) == 0


def _router(core, seed: int) -> KvRouter:
    return KvRouter(KvRouterConfig(), BS, rng=random.Random(seed), registry=CollectorRegistry(), core=core)


def test_routers_on_either_path_make_the_same_decisions():
    """A router's whole life (KV events, routes, prefill done, frees) on both paths: every
    decision, with its explanation, is the same."""
    rng = random.Random(11)
    workers = _workers(24)
    routers = [_router(None, 3), _router(SCHED_CORE, 3)]
    for r in routers:
        r.update_workers(workers)
    heads = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 6) * BS)] for _ in range(6)]

    def prompt() -> list[int]:
        """A shared head (a system prompt), then text of its own, sometimes a partial block."""
        return rng.choice(heads) + [rng.randrange(1, 50) for _ in range(rng.randint(0, 8) * BS + rng.choice([0, 7]))]

    for worker in workers:  # each worker caches a few prompts, as its KV events say
        for j in range(4):
            local = compute_block_hashes(prompt(), BS)
            ev = RouterEvent(worker_id=worker[0], dp_rank=worker[1], event_id=j,
                             event=KvStored(parent_hash=None, blocks=[StoredBlock(h ^ worker[0], h) for h in local]))
            for r in routers:
                r.apply_event(ev)
    inflight: list[str] = []
    overlapped = 0
    for i in range(300):
        tokens = prompt()
        decisions = [r.select_worker(f"r{i}", tokens) for r in routers]
        assert decisions[0] == decisions[1]
        overlapped += decisions[0].overlap_blocks > 0
        inflight.append(f"r{i}")
        if rng.random() < 0.5:
            rid = rng.choice(inflight)
            for r in routers:
                r.mark_prefill_done(rid)
        if len(inflight) > 40:
            rid = inflight.pop(rng.randrange(len(inflight)))
            for r in routers:
                r.free(rid)
    assert overlapped > 100  # the cache terms did take part
    assert routers[0].active.load_terms() == routers[1].active.load_terms()
