"""Block tables for the KV-transfer benchmark: a pool whose free blocks are scattered, and the runs of a table.

``scatter_free_blocks`` reorders a block manager's free blocks the way a busy
engine leaves them: runs of 1 to ``max_run`` consecutive ids, in shuffled
order, so the next prompt's table is those runs one after the other. It does
it through the manager's own ``allocate`` / ``free`` (one-block fillers that
take every free block, then are freed run by run), never by touching its queues;
without a ``rng`` it puts them back in ascending order (a ``contiguous`` table).
"""

from __future__ import annotations

import random

from workers.engine.block_manager import BlockManager
from workers.engine.request import Request
from workers.sampling_params import SamplingParams

__all__ = ["scatter_free_blocks", "contiguous_runs"]


def scatter_free_blocks(manager: BlockManager, rng: random.Random | None, max_run: int = 16) -> None:
    """``rng`` None: the free blocks in ascending order instead (the next table is one run, as in a
    fresh pool: the pulls before it leave the free queue in their release order)."""
    fillers: list[Request] = []
    while manager.num_available_blocks:
        filler = Request(-1 - len(fillers), [1] * manager.block_size, SamplingParams(max_tokens=1))
        manager.allocate(filler, manager.block_size)
        fillers.append(filler)
    fillers.sort(key=lambda f: f.block_ids[0])
    runs, start = [], 0
    while start < len(fillers):
        length = len(fillers) if rng is None else rng.randint(1, max_run)
        runs.append(fillers[start:start + length])
        start += length
    if rng is not None:
        rng.shuffle(runs)
    for run in runs:
        for filler in run:
            manager.free(filler)


def contiguous_runs(block_ids: list[int]) -> int:
    """Maximal runs of consecutive ids, ascending or descending (what the KV server sends as one view)."""
    runs, step = 0, 0
    for i, block_id in enumerate(block_ids):
        delta = block_id - block_ids[i - 1] if i else None
        if delta is not None and delta in (1, -1) and step in (0, delta):
            step = delta
            continue
        runs, step = runs + 1, 0
    return runs
