"""Per-step engine statistics, drained by the launcher for ``/metrics``.

Torch-free msgspec structs: they cross the control socket as MessagePack.
"""

from __future__ import annotations

from collections import deque

import msgspec

from workers.engine.kv_tiers import TierStats

__all__ = ["IterationStats", "StatsQueue"]


class IterationStats(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True, gc=False):
    """One engine step that ran a batch.

    Counts are for this step except ``prefix_cache_queries`` /
    ``prefix_cache_hits`` (cumulative tokens looked up / found in the prefix
    cache at admission since the engine started) and the block counts (the
    pool after the step).
    """

    timestamp: float  # time.time() at the end of the step
    step_seconds: float  # schedule + execute + update
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    num_finished: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int  # free blocks still holding a reusable hash
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float  # hits / queries (cumulative, tokens); 0.0 before any query
    num_waiting_for_remote_kv: int = 0  # disaggregated gen side: KV being pulled
    kv_blocks_parked: int = 0  # disaggregated ctx side: held for a transfer (counted in used)
    tiers: TierStats | None = None  # the host and disk tiers (None: none configured)
    num_draft_tokens: int = 0  # speculative decoding: drafts verified this step (among the decode tokens)
    num_accepted_tokens: int = 0  # of them, the ones the model confirmed


class StatsQueue:
    """Stats since the last drain; bounded, dropping the oldest when nobody drains."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._entries: deque[IterationStats] = deque(maxlen=max_entries)

    def record(self, stats: IterationStats) -> None:
        self._entries.append(stats)

    def drain(self) -> list[IterationStats]:
        entries = list(self._entries)
        self._entries.clear()
        return entries
