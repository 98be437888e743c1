"""Block manager: exact block ids, reference counts, LRU eviction, prefix hits, events."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import msgspec
import pytest

import workers.engine.block_manager as block_manager_module
from common.block_hash import BlockHash, compute_block_hashes, hash_block_tokens
from workers.engine.block_manager import BlockIntegrityError, BlockManager, NoFreeBlocksError
from workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventQueue
from workers.engine.request import Request
from workers.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: int, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0))


def make_block_manager(num_blocks: int = 10, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, hash_seed=0, enable_prefix_caching=enable_prefix_caching)


def admit(manager: BlockManager, request: Request) -> list[int]:
    """What the scheduler does for a new request whose prompt runs in one step; the hits."""
    hits = manager.get_computed_blocks(request)
    manager.allocate(request, request.num_tokens - len(hits) * BLOCK_SIZE, hits)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    manager.check_integrity()
    return hits


def usage(manager: BlockManager) -> tuple[int, int, int]:
    return manager.num_free_blocks, manager.num_cached_blocks, manager.num_used_blocks


def hashes(tokens: list[int]) -> list[BlockHash]:
    return compute_block_hashes(tokens, BLOCK_SIZE, seed=0)


# ---- hashes ------------------------------------------------------------------


def test_hashes_chain_over_full_blocks_only():
    tokens = list(range(10))
    first = hash_block_tokens(None, tokens[0:4], 0)
    second = hash_block_tokens(first, tokens[4:8], 0)
    assert hashes(tokens) == [first, second]
    assert compute_block_hashes(tokens[4:8], BLOCK_SIZE, 0, parent=first) == [second]
    assert hashes(tokens[:3]) == []
    assert hash_block_tokens(None, tokens[0:4], 1) != first  # the seed matters
    assert hash_block_tokens(second, tokens[0:4], 0) != first  # the parent matters
    assert all(0 <= h < 2**64 for h in (first, second))


def test_hash_is_a_pinned_wire_format():
    # The router computes the same values in another process: a change here breaks it.
    assert compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 0) == [1057715497810845393, 11922195804657393898]


def test_hash_rejects_token_ids_outside_uint32():
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(None, [2**32], 0)
    with pytest.raises(ValueError, match="seed"):
        hash_block_tokens(None, [1], -1)


def test_whole_prompt_hashes_are_the_block_by_block_chain():
    # compute_block_hashes packs the ids once and the header in pieces; hash_block_tokens, as the
    # block manager calls it, is the reference: any difference in a byte of the encoding shows here.
    rng = random.Random(5)
    for block_size in (1, 3, 16, 32):
        for length in (0, block_size - 1, block_size, 5 * block_size + 2):
            tokens = [rng.choice((0, 1, 255, 256, 65_535, 2**31, 2**32 - 1, rng.randrange(2**32)))
                      for _ in range(length)]
            for seed, parent in ((0, None), (2**64 - 1, None), (7, BlockHash(0)), (7, BlockHash(2**64 - 1))):
                expected, chain = [], parent
                for start in range(0, length - block_size + 1, block_size):
                    chain = hash_block_tokens(chain, tokens[start:start + block_size], seed)
                    expected.append(chain)
                assert compute_block_hashes(tokens, block_size, seed, parent) == expected, (block_size, length)


@pytest.mark.parametrize("tokens", [[2**32] * 4, [1, 2, -1, 4], [1.0, 2, 3, 4]])
def test_whole_prompt_hashes_reject_ids_outside_uint32(tokens):
    with pytest.raises(ValueError, match="token ids"):
        compute_block_hashes(tokens, 4, 0)


def test_hashes_are_identical_in_another_process():
    tokens = list(range(1000, 1100))
    code = (
        "import json; from common.block_hash import compute_block_hashes; "
        "print(json.dumps(compute_block_hashes(list(range(1000, 1100)), 16, 12345)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "987"}  # Python's own hash() would differ
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(result.stdout) == compute_block_hashes(tokens, 16, 12345)
    assert len(json.loads(result.stdout)) == 6


# ---- allocation and reference counts -----------------------------------------


def test_allocate_takes_lowest_free_blocks_in_order():
    manager = make_block_manager()
    request = make_request(0, list(range(10)))
    assert admit(manager, request) == []
    assert request.block_ids == [0, 1, 2]
    assert [manager.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert usage(manager) == (7, 0, 3)
    # Two full blocks registered; the partial third is not.
    assert manager.block_hash(0) == hashes(request.prompt_token_ids)[0]
    assert manager.block_hash(1) == hashes(request.prompt_token_ids)[1]
    assert manager.block_hash(2) is None


def test_allocate_grows_by_whole_blocks_only():
    manager = make_block_manager()
    request = make_request(0, list(range(3)))
    admit(manager, request)
    assert request.block_ids == [0]
    for token in (3, 4):  # decode: token 3 fills block 0, token 4 needs block 1
        request.output_token_ids.append(token)
        manager.allocate(request, 1)
        request.num_computed_tokens += 1
        manager.cache_full_blocks(request)
        manager.check_integrity()
    assert request.block_ids == [0, 1]
    assert manager.block_hash(0) == hashes([0, 1, 2, 3])[0]


def test_prefix_hit_shares_blocks_and_counts_references():
    manager = make_block_manager()
    first = make_request(0, list(range(10)))
    admit(manager, first)
    second = make_request(1, list(range(8)) + [50, 51, 52])
    assert admit(manager, second) == [0, 1]
    assert second.block_ids == [0, 1, 3]
    assert [manager.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert usage(manager) == (6, 0, 4)
    manager.free(first)
    manager.check_integrity()
    assert [manager.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    assert usage(manager) == (7, 0, 3)  # block 2 had no hash: back to the free queue
    assert first.block_ids == []


def test_hit_never_covers_the_last_token():
    manager = make_block_manager()
    admit(manager, make_request(0, list(range(8))))
    assert manager.get_computed_blocks(make_request(1, list(range(8)))) == [0]
    assert manager.get_computed_blocks(make_request(2, list(range(9)))) == [0, 1]
    assert manager.get_computed_blocks(make_request(3, [99] + list(range(1, 9)))) == []


def test_can_allocate_counts_revived_cached_blocks():
    manager = make_block_manager(num_blocks=3)
    first = make_request(0, list(range(8)))
    admit(manager, first)
    manager.free(first)
    assert usage(manager) == (1, 2, 0)
    second = make_request(1, list(range(8)) + [40] * 5)
    hits = manager.get_computed_blocks(second)
    assert hits == [0, 1]
    # 13 tokens need 4 blocks: the 2 hits (taken out of the evictable pool) plus 2 new, but only 1 is left.
    assert not manager.can_allocate(second, 5, hits)
    with pytest.raises(NoFreeBlocksError):
        manager.allocate(second, 5, hits)
    manager.check_integrity()
    assert manager.can_allocate(second, 4, hits)  # 12 tokens: 3 blocks
    manager.allocate(second, 4, hits)
    assert second.block_ids == [0, 1, 2]
    assert usage(manager) == (0, 0, 3)
    manager.check_integrity()


def test_try_allocate_takes_nothing_when_it_does_not_fit_and_allocates_when_it_does():
    manager = make_block_manager(num_blocks=3)
    first = make_request(0, list(range(8)))
    admit(manager, first)
    manager.free(first)
    second = make_request(1, list(range(8)) + [40] * 5)
    hits = manager.get_computed_blocks(second)
    assert not manager.try_allocate(second, 5, hits)  # as can_allocate: the revived hits count
    assert second.block_ids == [] and usage(manager) == (1, 2, 0)
    manager.check_integrity()
    assert manager.try_allocate(second, 4, hits)
    assert second.block_ids == [0, 1, 2] and usage(manager) == (0, 0, 3)
    manager.check_integrity()


def test_allocate_with_hits_requires_an_empty_table():
    manager = make_block_manager()
    request = make_request(0, list(range(10)))
    admit(manager, request)
    with pytest.raises(ValueError, match="no blocks"):
        manager.can_allocate(request, 1, [0])


# ---- eviction ----------------------------------------------------------------


def test_free_releases_tail_first_and_eviction_is_lru():
    manager = make_block_manager(num_blocks=6)
    a = make_request(0, list(range(12)) + [99])  # blocks 0, 1, 2 full, block 3 partial
    admit(manager, a)
    a_hashes = hashes(a.prompt_token_ids)
    manager.events.drain()
    manager.free(a)
    manager.check_integrity()
    assert usage(manager) == (3, 3, 0)  # free: 4, 5, 3; cached (oldest first): 2, 1, 0
    b = make_request(1, list(range(100, 108)))
    admit(manager, b)
    assert b.block_ids == [4, 5]  # free blocks first: no eviction
    c = make_request(2, list(range(200, 212)))
    admit(manager, c)
    assert c.block_ids == [3, 2, 1]  # the last free block, then the least recently freed cached ones
    events = manager.events.drain()
    removed = [e.event for e in events if isinstance(e.event, BlockRemoved)]
    assert removed == [BlockRemoved(block_hashes=[a_hashes[2], a_hashes[1]])]
    assert manager.block_hash(0) == a_hashes[0]
    assert manager.get_computed_blocks(make_request(3, list(range(4)) + [7])) == [0]
    assert manager.get_computed_blocks(make_request(4, list(range(8)) + [7])) == [0]


def test_a_hit_refreshes_recency():
    manager = make_block_manager(num_blocks=4)
    x, y = make_request(0, [1, 1, 1, 1, 9]), make_request(1, [2, 2, 2, 2, 9])
    admit(manager, x)  # blocks 0, 1
    admit(manager, y)  # blocks 2, 3
    manager.free(x)  # freed order: 1 (unhashed -> free), 0 (cached)
    manager.free(y)  # 3 -> free, 2 -> cached after 0
    x_again = make_request(2, [1, 1, 1, 1, 8])
    admit(manager, x_again)  # hit on 0; new block from the free queue
    assert x_again.block_ids == [0, 1]
    manager.free(x_again)  # block 0 is now the most recently freed
    manager.events.drain()
    z = make_request(3, [3] * 12)
    admit(manager, z)  # free blocks 3 and 1, then evicts 2 (freed before 0 was freed again)
    assert z.block_ids == [3, 1, 2]
    assert manager.block_hash(0) == hashes([1, 1, 1, 1])[0]
    removed = [e.event for e in manager.events.drain() if isinstance(e.event, BlockRemoved)]
    assert removed == [BlockRemoved(block_hashes=[hashes([2, 2, 2, 2])[0]])]


# ---- events ------------------------------------------------------------------


def test_stored_events_carry_chain_tokens_and_increasing_ids():
    manager = make_block_manager()
    request = make_request(0, list(range(6)))
    admit(manager, request)  # block 0 full
    for token in (6, 7, 8):
        request.output_token_ids.append(token)
        manager.allocate(request, 1)
        request.num_computed_tokens += 1
        manager.cache_full_blocks(request)
    # Block 1 (tokens 4..7) is registered once position 7 is computed, not when allocated.
    events = manager.events.drain()
    h = hashes(list(range(9)))
    assert [e.event_id for e in events] == [0, 1]
    assert events[0].event == BlockStored([h[0]], None, [0, 1, 2, 3], BLOCK_SIZE)
    assert events[1].event == BlockStored([h[1]], h[0], [4, 5, 6, 7], BLOCK_SIZE)
    assert events[0].timestamp <= events[1].timestamp
    assert manager.events.drain() == []


def test_duplicate_content_is_not_registered_twice():
    manager = make_block_manager()
    a, b = make_request(0, list(range(9))), make_request(1, list(range(9)))
    for request in (a, b):  # both allocated before either is computed: no hits
        manager.allocate(request, 9)
    for request in (a, b):
        request.num_computed_tokens = 9
        manager.cache_full_blocks(request)
    manager.check_integrity()
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4, 5]
    assert [manager.block_hash(b) for b in (3, 4)] == [None, None]
    assert len(manager.events.drain()) == 1
    manager.free(b)
    assert usage(manager) == (7, 0, 3)


def test_event_queue_is_bounded_and_shows_the_gap():
    queue = KVEventQueue(max_events=2)
    for i in range(3):
        queue.publish(BlockRemoved(block_hashes=[i]))
    events = queue.drain()
    assert [e.event_id for e in events] == [1, 2]
    assert queue.num_dropped == 1


def test_events_round_trip_as_msgpack():
    event = KVEvent(7, 1.5, BlockStored([1, 2], None, list(range(8)), 4))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=KVEvent)
    assert decoded == event


# ---- collisions, disabled caching, integrity ---------------------------------


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent, tokens, seed: BlockHash(42))
    manager = make_block_manager()
    admit(manager, make_request(0, [1, 2, 3, 4, 5]))
    assert manager.block_hash(0) == 42
    assert manager.get_computed_blocks(make_request(1, [9, 9, 9, 9, 5])) == []
    assert manager.get_computed_blocks(make_request(2, [1, 2, 3, 4, 5])) == [0]


def test_disabled_prefix_caching_registers_nothing():
    manager = make_block_manager(enable_prefix_caching=False)
    request = make_request(0, list(range(9)))
    admit(manager, request)
    assert manager.get_computed_blocks(make_request(1, list(range(9)))) == []
    manager.free(request)
    assert usage(manager) == (10, 0, 0)
    assert manager.events.drain() == []


def test_integrity_check_reports_broken_books():
    manager = make_block_manager()
    request = make_request(0, list(range(10)))
    admit(manager, request)
    request.block_ids.append(5)  # a table entry the manager never handed out
    with pytest.raises(BlockIntegrityError, match="block 5 has ref_count 0 but 1 holders"):
        manager.check_integrity()


# ---- parking (disaggregation) ------------------------------------------------


def test_parked_blocks_stay_in_use_until_released():
    manager = make_block_manager(num_blocks=3)
    request = make_request(0, list(range(9)))
    admit(manager, request)
    manager.park(request, deadline=100.0)
    manager.check_integrity()
    assert request.block_ids == []
    assert manager.parked_block_ids(0) == [0, 1, 2]
    assert manager.num_parked_blocks == 3
    other = make_request(1, list(range(50, 54)))
    assert not manager.can_allocate(other, 4)  # parked blocks are not evictable
    assert manager.get_computed_blocks(make_request(2, list(range(8)) + [7])) == [0, 1]  # still hits
    assert manager.release_expired(now=99.0) == []
    assert manager.release_expired(now=100.0) == [0]
    assert manager.release(0) is False
    manager.check_integrity()
    assert usage(manager) == (1, 2, 0)
    assert manager.can_allocate(other, 4)


def test_park_twice_under_one_id_is_refused():
    manager = make_block_manager()
    request = make_request(0, list(range(5)))
    admit(manager, request)
    manager.park(request)
    again = make_request(0, list(range(5)))
    admit(manager, again)
    with pytest.raises(ValueError, match="already has parked blocks"):
        manager.park(again)


# ---- reset and the idle check ------------------------------------------------


def test_reset_prefix_cache_only_when_no_cached_block_is_in_use():
    manager = make_block_manager(num_blocks=4)
    request = make_request(0, list(range(9)))
    admit(manager, request)
    manager.events.drain()
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    manager.check_integrity()
    assert usage(manager) == (4, 0, 0)
    assert [type(e.event) for e in manager.events.drain()] == [AllBlocksCleared]
    assert manager.get_computed_blocks(make_request(1, list(range(9)))) == []


def test_idle_check_catches_a_leak():
    manager = make_block_manager()
    request = make_request(0, list(range(5)))
    admit(manager, request)
    manager.park(request)
    manager.check_idle()  # parked blocks are expected
    leaked = make_request(1, list(range(5)))
    manager.allocate(leaked, 5)
    manager.free(leaked)
    manager.check_idle()
    manager.allocate(leaked, 5)
    manager._tables.clear()  # forget the table, as a buggy caller that never freed would
    with pytest.raises(BlockIntegrityError, match="blocks leaked"):
        manager.check_idle()


def test_on_free_is_told_each_block_once_when_no_table_or_hash_holds_it():
    freed: list[list[int]] = []
    manager = BlockManager(10, BLOCK_SIZE, enable_prefix_caching=True, on_free=freed.append)
    hashed, loose, parked = make_request(0, list(range(9))), make_request(1, [50, 51]), make_request(2, [60] * 3)
    for request in (hashed, loose, parked):
        admit(manager, request)
    manager.free(hashed)  # its 2 full blocks stay cached (evictable): only the partial third is free
    manager.free(loose)
    assert freed == [[2], [3]]
    manager.park(parked)
    assert freed == [[2], [3]]
    assert manager.release(2)
    assert freed == [[2], [3], [4]]
    assert manager.reset_prefix_cache()
    assert sorted(freed[-1]) == [0, 1]
