"""The KV index keeps host- and disk-tier blocks apart from pool blocks, and kv_cache_aware scores them lower."""

from __future__ import annotations

import msgspec

from orchestrator.config import RouterConfig
from orchestrator.kv_index import KVIndex
from orchestrator.routing.policies import Candidate, Router, RouteRequest
from workers.engine.kv_events import BlockRemoved, BlockStored, KVEvent, Tier
from workers.http_protocol import KVEventEntry, KVEventRecord, decode_kv_events


def events(*entries: object) -> list[KVEventEntry]:
    """Engine events as the launcher's route answers them, read as the orchestrator reads them."""
    return decode_kv_events(msgspec.json.encode([KVEvent(i, 0.0, e) for i, e in enumerate(entries)]))


def test_a_block_evicted_to_the_host_tier_moves_from_the_pool_set_to_the_lower_set():
    index = KVIndex()
    index.apply("w", events(BlockStored([1, 2, 3], None, list(range(12)), 4),
                            BlockStored([3], 2, [8, 9, 10, 11], 4, Tier.HOST),
                            BlockRemoved([3]),
                            BlockStored([4], 3, [0, 1, 2, 3], 4, Tier.DISK)))
    assert index.blocks["w"] == {1, 2} and index.lower["w"] == {3, 4}
    assert index.match("w", [1, 2, 3, 4, 5]) == (4, 2)  # two in the pool, then two below it
    assert index.num_matched_blocks("w", [1, 2, 3, 4]) == 2  # the pool's alone
    index.apply("w", [KVEventEntry(KVEventRecord("BlockRemoved", [4], "disk"), 4)])
    assert index.lower["w"] == {3}
    index.apply("w", [KVEventEntry(KVEventRecord("AllBlocksCleared"), 5)])
    assert index.blocks["w"] == set() and index.lower["w"] == set()


def test_a_snapshot_and_the_published_state_carry_the_lower_tiers():
    index = KVIndex()
    index.adopt_snapshot("w", 7, [1], 8, [2, 3])
    assert index.match("w", [1, 2, 3]) == (3, 2)
    copy = KVIndex()
    copy.replace(index.export(), index.export_lower())
    assert copy.match("w", [1, 2, 3]) == (3, 2)


def test_kv_cache_aware_prefers_a_pool_hit_to_a_tier_hit_of_the_same_length():
    router = Router(RouterConfig(policy="kv_cache_aware", tier_weight=0.5))
    pool = Candidate("a", matched_blocks=4)
    tiered = Candidate("b", matched_blocks=4, matched_lower_blocks=4)
    longer = Candidate("c", matched_blocks=10, matched_lower_blocks=6)  # 4 + 0.5 * 6 = 7
    assert router.choose([pool, tiered], RouteRequest(100)).worker_id == "a"
    assert router.choose([pool, tiered, longer], RouteRequest(200)).worker_id == "c"
    assert router.choose([Candidate("x"), tiered], RouteRequest(100)).worker_id == "b"  # better than nothing
