"""The radix index against a brute-force model of what a worker holds (hypothesis stateful), for
both implementations (pure Python and the compiled core)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dynamod.shared.kv.hashing import compute_sequence_hashes
from dynamod.shared.kv.indexer import APPLIED, PARENT_MISSING, KvIndexerBase
from dynamod.shared.protocol.kv_events import KvCleared, KvRemoved, KvStored, RouterEvent, StoredBlock
from tests.unit.router.kv_impls import IMPLS, make_index, needs_native

Path = tuple[int, ...]
WORKERS = [(1, 0), (1, 1), (2, 0), (3, 0)]


class Model:
    """What the index must answer, computed the slow and obvious way: per worker key, a set of
    held paths (tuples of tokens hashes) and a map engine hash -> path."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], set[Path]] = {}
        self.ext: dict[tuple[int, int], dict[int, Path]] = {}

    def _drop(self, wk: tuple[int, int], path: Path) -> None:
        """Drops a block, the worker's blocks below it, and every hash naming one of them."""
        n = len(path)
        self.held[wk] = {p for p in self.held[wk] if p[:n] != path}
        self.ext[wk] = {e: p for e, p in self.ext[wk].items() if p[:n] != path}

    def store(self, wk: tuple[int, int], parent_hash: int | None, blocks: list[tuple[int, int]]) -> str:
        held = self.held.setdefault(wk, set())
        self.ext.setdefault(wk, {})
        if parent_hash is None:
            prefix: Path = ()
        else:
            p = self.ext[wk].get(parent_hash)
            if p is None:
                return PARENT_MISSING
            assert p in held, "a hash names a held block or nothing"
            prefix = p
        for e, th in blocks:
            path = (*prefix, th)
            q = self.ext[wk].get(e)
            if q is not None and q != path:
                self._drop(wk, q)
                if prefix and prefix not in self.held[wk]:
                    break
            self.held[wk].add(path)
            self.ext[wk][e] = path
            prefix = path
        return APPLIED

    def remove(self, wk: tuple[int, int], hashes: list[int]) -> None:
        if wk not in self.held:
            return
        for e in hashes:
            q = self.ext[wk].get(e)
            if q is not None:
                self._drop(wk, q)

    def clear(self, wk: tuple[int, int]) -> None:
        if wk in self.held:
            self.held[wk] = set()
            self.ext[wk] = {}

    def remove_worker(self, worker_id: int) -> None:
        for wk in [k for k in self.held if k[0] == worker_id]:
            del self.held[wk]
            del self.ext[wk]

    def remove_worker_key(self, wk: tuple[int, int]) -> None:
        del self.held[wk]
        del self.ext[wk]

    def find(self, query: list[int]) -> dict[tuple[int, int], int]:
        out = {}
        for wk, held in self.held.items():
            n = 0
            while n < len(query) and tuple(query[: n + 1]) in held:
                n += 1
            if n:
                out[wk] = n
        return out

    def sizes(self) -> dict[tuple[int, int], int]:
        return {wk: len(h) for wk, h in self.held.items()}


tokens_hash = st.integers(0, 3)
small_ext = st.integers(0, 40)


class IndexMachine(RuleBasedStateMachine):
    impl = "python"

    def __init__(self) -> None:
        super().__init__()
        self.index = make_index(self.impl)
        self.model = Model()

    def _known_exts(self, wk: tuple[int, int]) -> list[int]:
        return sorted(self.model.ext.get(wk, {}))

    @rule(
        wk=st.sampled_from(WORKERS),
        data=st.data(),
        blocks=st.lists(st.tuples(small_ext, tokens_hash), min_size=1, max_size=5),
    )
    def store_random_hashes(self, wk, data, blocks):
        """Engine hashes from a tiny range: exercises reuse of a hash for another block."""
        known = self._known_exts(wk)
        parent = data.draw(st.one_of(st.none(), st.sampled_from(known) if known else st.none(), small_ext))
        self._store(wk, parent, blocks)

    @rule(wk=st.sampled_from(WORKERS), data=st.data(), suffix=st.lists(tokens_hash, min_size=1, max_size=6))
    def store_content_addressed(self, wk, data, suffix):
        """What real engines do: a block's hash is a function of its path (and the worker)."""
        held = sorted(self.model.held.get(wk, set()))
        prefix = data.draw(st.sampled_from([(), *held])) if held else ()
        parent = None if not prefix else self._content_hash(wk, prefix)
        blocks = []
        path = prefix
        for th in suffix:
            path = (*path, th)
            blocks.append((self._content_hash(wk, path), th))
        self._store(wk, parent, blocks)

    @staticmethod
    def _content_hash(wk: tuple[int, int], path: Path) -> int:
        return 1000 + (hash((wk, path)) & 0xFFFFFF)

    def _store(self, wk, parent, blocks):
        ev = RouterEvent(
            worker_id=wk[0],
            dp_rank=wk[1],
            event_id=0,
            event=KvStored(parent_hash=parent, blocks=[StoredBlock(e, th) for e, th in blocks]),
        )
        assert self.index.apply_event(ev) == self.model.store(wk, parent, blocks)

    @rule(wk=st.sampled_from(WORKERS), data=st.data())
    def remove(self, wk, data):
        known = self._known_exts(wk)
        hashes = data.draw(st.lists(st.sampled_from(known) if known else small_ext, max_size=3) | st.lists(small_ext, max_size=2))
        self.index.apply_event(RouterEvent(worker_id=wk[0], dp_rank=wk[1], event_id=0, event=KvRemoved(block_hashes=hashes)))
        self.model.remove(wk, hashes)

    @rule(wk=st.sampled_from(WORKERS))
    def clear(self, wk):
        self.index.apply_event(RouterEvent(worker_id=wk[0], dp_rank=wk[1], event_id=0, event=KvCleared()))
        self.model.clear(wk)

    @rule(worker_id=st.sampled_from([1, 2, 3]))
    def remove_worker(self, worker_id):
        self.index.remove_worker(worker_id)
        self.model.remove_worker(worker_id)

    @precondition(lambda self: bool(self.model.held))
    @rule()
    def rebuild_from_dump(self):
        """Another router rebuilds from the dumps; it must then behave identically."""
        fresh = make_index(self.impl)
        for wk in self.index.workers():
            for ev in self.index.dump(wk):
                assert fresh.apply(wk[0], wk[1], ev) == APPLIED
        self._check(fresh, rebuilt=True)
        self.index = fresh
        for wk, size in self.model.sizes().items():  # a dump of an empty worker is empty
            if size == 0:
                self.model.remove_worker_key(wk)

    @rule(query=st.lists(tokens_hash, max_size=8))
    def find_random(self, query):
        assert self.index.find_matches(query).scores == self.model.find(query)

    def _queries(self) -> list[list[int]]:
        paths = {p for held in self.model.held.values() for p in held}
        return [list(p) for p in paths] + [[*p, t] for p in paths for t in (0, 3)] + [[0, 1, 2, 3]]

    def _check(self, index: KvIndexerBase, rebuilt: bool = False) -> None:
        sizes = self.model.sizes()
        if rebuilt:
            sizes = {wk: n for wk, n in sizes.items() if n}
        for query in self._queries():
            result = index.find_matches(query)
            assert result.scores == self.model.find(query), query
            assert result.tree_sizes == sizes
            assert index.find_matches_sequence(compute_sequence_hashes(query)) == result
        assert index.total_blocks == sum(sizes.values())

    @invariant()
    def agrees_with_model(self):
        self._check(self.index)

    @invariant()
    def tree_is_consistent_without_dead_nodes(self):
        """Nodes nobody holds are unlinked, so the tree's size tracks the distinct held blocks."""
        self.index.check_invariants()
        distinct = {p for held in self.model.held.values() for p in held}
        assert self.index.num_nodes() == len(distinct)


class NativeIndexMachine(IndexMachine):
    impl = "native"


_MACHINE_SETTINGS = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = _MACHINE_SETTINGS
TestNativeIndexMachine = needs_native(NativeIndexMachine.TestCase)
TestNativeIndexMachine.settings = _MACHINE_SETTINGS


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=150, deadline=None)
@given(
    depths=st.lists(st.integers(0, 300), min_size=1, max_size=70),
    cuts=st.lists(st.one_of(st.none(), st.integers(0, 299)), min_size=70, max_size=70),
    chunk=st.integers(1, 64),
    diverge=st.integers(0, 310),
)
def test_long_prompts_and_many_workers(impl, depths, cuts, chunk, diverge):
    """Prompts of hundreds of blocks held to different depths by up to 70 workers (more than a
    64-bit mask), stored in chunks and cut by removals: every worker's leading-block count."""
    index = make_index(impl)
    path = list(range(10_000, 10_310))  # local hashes
    seqs = compute_sequence_hashes(path)
    expected = {}
    for w, depth in enumerate(depths):
        wk = (w, w % 3)
        for lo in range(0, depth, chunk):
            hi = min(depth, lo + chunk)
            parent = None if lo == 0 else seqs[lo - 1] + w
            blocks = [StoredBlock(seqs[i] + w, path[i]) for i in range(lo, hi)]
            assert index.store(wk, parent, blocks) == APPLIED
        held = depth
        cut = cuts[w]
        if cut is not None and cut < depth:
            index.remove(wk, [seqs[cut] + w])  # drops the block and everything after it
            held = cut
        if held:
            expected[wk] = held
    index.check_invariants()
    assert index.find_matches(path).scores == expected
    assert index.find_matches_sequence(seqs).scores == expected
    # A prompt that leaves the path after `diverge` blocks.
    other = path[:diverge] + [7] * 5
    want = {wk: min(n, diverge) for wk, n in expected.items() if min(n, diverge)}
    assert index.find_matches(other).scores == want
    assert index.find_matches_sequence(compute_sequence_hashes(other)).scores == want
