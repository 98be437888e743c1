"""``benchmarks/kv_tables.py``: the KV-transfer benchmark's fragmented and contiguous tables are what it says."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from workers.engine.block_manager import BlockManager
from workers.engine.request import Request
from workers.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from kv_tables import contiguous_runs, scatter_free_blocks


def _table(manager: BlockManager, num_blocks: int, request_id: int) -> list[int]:
    request = Request(request_id, list(range(num_blocks * 4)), SamplingParams(max_tokens=1))
    manager.allocate(request, num_blocks * 4)
    return request.block_ids


def test_runs_count_ascending_and_descending_runs() -> None:
    assert contiguous_runs([]) == 0
    assert contiguous_runs([5]) == 1
    assert contiguous_runs([3, 4, 5, 9, 8, 7, 1, 20]) == 4
    assert contiguous_runs([1, 2, 1, 2]) == 2  # a direction change ends a run


def test_scattered_pool_gives_short_shuffled_runs_and_sorted_pool_one_run() -> None:
    manager = BlockManager(64, 4)
    rest = _table(manager, 8, 1)  # some blocks held: the scatter works on the free ones only
    scatter_free_blocks(manager, random.Random(0), max_run=4)
    table = _table(manager, 40, 2)
    assert len(set(table)) == 40 and not set(table) & set(rest)
    assert contiguous_runs(table) >= 10  # runs of at most 4 blocks
    assert table != sorted(table)
    manager = BlockManager(64, 4)
    scatter_free_blocks(manager, random.Random(0))
    first = Request(1, list(range(80)), SamplingParams(max_tokens=1))
    manager.allocate(first, 80)
    manager.free(first)  # back into the free queue in scattered order
    scatter_free_blocks(manager, None)
    assert contiguous_runs(_table(manager, 30, 2)) == 1
