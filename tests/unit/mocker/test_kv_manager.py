"""KV manager: prefix lookup, slot allocation, watermark, freeing order; exact block ids."""

from __future__ import annotations

from dynamod.daemon.engines.mocker.kv_manager import KVCacheManager
from dynamod.daemon.engines.mocker.request import MockRequest
from dynamod.shared.kv.hashing import hash_tokens
from dynamod.shared.protocol.kv_events import KvStored, StoredBlock

BS = 4


def make_request(rid: str, tokens: list[int], lora: str | None = None) -> MockRequest:
    req = MockRequest(rid, tokens, max_output_tokens=8, vocab_size=1000, lora_name=lora)
    req.hash_prompt(BS)
    return req


def admit(kv: KVCacheManager, req: MockRequest, watermark: int = 0):
    hits, num_hit = kv.get_computed_blocks(req)
    blocks = kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit, watermark)
    if blocks is not None:
        req.num_computed_tokens = num_hit
    return hits, num_hit, blocks


def test_prefix_hit_reuses_exact_blocks_and_stores_only_new_ones():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    hits, num_hit, new = admit(kv, a)
    assert (hits, num_hit) == ([], 0)
    assert [b.block_id for b in new] == [0, 1, 2]
    local, seq = hash_tokens(a.token_ids, BS)
    assert kv.take_events() == [
        KvStored(parent_hash=None, blocks=[StoredBlock(seq[0], local[0]), StoredBlock(seq[1], local[1])], lora_name=None)
    ]

    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit, new = admit(kv, b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert [blk.block_id for blk in new] == [3, 4]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:5]] == [2, 2, 1, 1, 1]
    _, seq_b = hash_tokens(b.token_ids, BS)
    (event,) = kv.take_events()
    assert event.parent_hash == seq[1] and [s.block_hash for s in event.blocks] == [seq_b[2]]


def test_the_last_token_is_never_a_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(8)))  # exactly two full blocks
    admit(kv, a)
    kv.free(a)
    again = make_request("a2", list(range(8)))
    _, num_hit, _ = admit(kv, again)
    assert num_hit == 4  # block 2 would cover the last token, which must be computed


def test_allocate_returns_none_when_it_does_not_fit_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert b.blocks == [] and kv.num_free_blocks == 1


def test_watermark_keeps_free_blocks_back_for_admission():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(12)))  # 3 blocks, leaving 3 free
    assert admit(kv, a, watermark=2)[2] is not None
    b = make_request("b", list(range(100, 108)))  # 2 blocks would leave 1 < 2
    assert admit(kv, b, watermark=2)[2] is None
    assert admit(kv, b, watermark=1)[2] is not None


def test_free_releases_tail_blocks_first():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    kv.free(a)
    # Never-used blocks first, then a's blocks tail first: block 2 is evicted before block 0.
    assert [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()] == [3, 4, 2, 1, 0]
    assert a.blocks == [] and kv.usage == 0.0


def test_decode_growth_caches_generated_blocks_with_the_router_hash():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(kv, a)
    kv.take_events()
    a.num_computed_tokens = 6
    a.token_ids += [7, 8]  # two generated tokens complete block 1 when the second is fed
    assert kv.allocate_slots(a, 1) == []  # token 7 fits in block 1
    a.num_computed_tokens = 7
    assert kv.take_events() == []
    assert kv.allocate_slots(a, 1) == []
    (event,) = kv.take_events()
    local, seq = hash_tokens([1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert event == KvStored(parent_hash=seq[0], blocks=[StoredBlock(seq[1], local[1])], lora_name=None)


def test_lora_requests_live_in_their_own_hash_space():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    base = make_request("base", list(range(9)))
    admit(kv, base)
    kv.take_events()
    lora = make_request("lora", list(range(9)), lora="sql-adapter")
    hits, num_hit, _ = admit(kv, lora)
    assert num_hit == 0
    (event,) = kv.take_events()
    local, seq = hash_tokens(list(range(9)), BS, "sql-adapter")
    assert event.lora_name == "sql-adapter"
    assert [(s.block_hash, s.tokens_hash) for s in event.blocks] == list(zip(seq, local, strict=True))
    assert set(seq).isdisjoint(hash_tokens(list(range(9)), BS)[1])


def test_prefix_caching_disabled_never_hits_or_emits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = MockRequest("a", list(range(9)), max_output_tokens=4, vocab_size=100)
    admit(kv, a)
    kv.free(a)
    b = MockRequest("b", list(range(9)), max_output_tokens=4, vocab_size=100)
    assert admit(kv, b)[1] == 0
    assert kv.take_events() == []
