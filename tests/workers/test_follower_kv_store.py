"""A TP follower's ``FollowerKVStore``: the ``kv_core.KVCore`` its KV agent serves pulls from.

mypy checks it against the protocol (``make lint``); these pin what it does: parked tables age
with rank 0's own deadline, and the gen side, which only rank 0 runs, fails loudly.
"""

from __future__ import annotations

import pytest

from workers.kv_rank_pulls import FollowerKVStore
from workers.protocol import EngineRequest
from workers.rank_protocol import RankPark
from workers.sampling_params import SamplingParams


class _Runner:
    kv_bytes_per_block = 64

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [bytes([b]) for b in block_ids]

    def export_heads(self, block_ids: list[int], heads: range) -> list[bytes]:
        return [bytes([b, heads.start]) for b in block_ids]


def test_parked_tables_expire_at_rank_zeros_deadline():
    store = FollowerKVStore(_Runner())
    store.park(RankPark(7, [3, 4], 100.0))
    store.park(RankPark(8, [5], 200.0))
    assert (store.parked_block_ids(7), store.parked_deadline(7)) == ([3, 4], 100.0)
    assert store.release_expired(99.9) == []
    assert store.release_expired(100.0) == [7]
    assert (store.parked_block_ids(7), store.parked_deadline(7)) == (None, None)
    assert store.release_parked(8) is True and store.release_parked(8) is False


def test_it_serves_the_runners_blocks_and_starts_no_pull():
    store = FollowerKVStore(_Runner())
    assert store.kv_bytes_per_block == 64
    assert store.export_blocks([1, 2]) == [b"\x01", b"\x02"]
    assert store.export_heads([1], range(2, 4)) == [b"\x01\x02"]
    assert (store.take_kv_pulls(), store.has_kv_pulls()) == ([], False)
    with pytest.raises(RuntimeError, match="takes no requests"):
        store.add_request(EngineRequest(1, [1, 2], SamplingParams(max_tokens=1)))
    with pytest.raises(RuntimeError, match="starts no pulls"):
        store.import_blocks([1], [b"x"])
