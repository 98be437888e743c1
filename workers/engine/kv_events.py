"""KV-cache events: what a router needs to mirror a worker's prefix cache.

The block manager publishes an event when full blocks become reusable
(``BlockStored``) and when cached blocks are evicted (``BlockRemoved``), each
with the tier that holds (held) them: the engine's pool, or the host and disk
tiers under it (``workers.engine.kv_tiers``), where a hit costs a copy back
instead of a prefill, so a router scores it below a pool hit.
Each is wrapped in a ``KVEvent`` with an ``event_id`` that increases by one
per event for the life of the engine, so a consumer can detect a gap (events
dropped because nobody drained the queue) and resynchronise.
Torch-free; the structs travel as MessagePack.
"""

from __future__ import annotations

import enum
import time
from collections import deque

import msgspec

__all__ = [
    "Tier",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVCacheEvent",
    "KVEvent",
    "KVEventQueue",
    "KVCacheSnapshot",
]


class Tier(enum.Enum):
    """Where a cached block lives; on the wire as its value (a missing ``tier`` means ``pool``)."""

    POOL = "pool"  # the engine's KV pool: a hit costs nothing
    HOST = "host"  # host memory (pinned beside a GPU): a hit costs a copy into the pool
    DISK = "disk"  # files: a hit costs a read, a check and a copy


class BlockStored(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """Consecutive full blocks of one chain became cached in ``tier``.

    ``token_ids`` holds ``len(block_hashes) * block_size`` tokens, block by
    block; ``parent_block_hash`` is the hash of the block before the first
    one (None when the first is the start of a sequence).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    tier: Tier = Tier.POOL


class BlockRemoved(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """Cached blocks left ``tier``: their hashes no longer hit there (a block evicted from the
    pool into the host tier is a ``BlockRemoved`` of the pool and a ``BlockStored`` of the host)."""

    block_hashes: list[int]
    tier: Tier = Tier.POOL


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    """Every cached block was dropped (cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEvent(msgspec.Struct, frozen=True):
    """One event with its position in the engine's event stream."""

    event_id: int  # 0, 1, 2, ... with no gaps unless ``KVEventQueue`` dropped some
    timestamp: float  # time.time() when the event happened
    event: KVCacheEvent


class KVCacheSnapshot(msgspec.Struct, frozen=True):
    """A worker's whole prefix cache at one point of its event stream: ``block_hashes`` is every
    cached block, and the events from ``next_event_id`` on are what changed since (a router that
    adopts this skips queued events with smaller ids)."""

    next_event_id: int
    block_hashes: list[int]  # the pool's
    num_blocks: int  # the pool's size: no worker ever caches more
    lower_block_hashes: list[int] = msgspec.field(default_factory=list)  # the host and disk tiers'


class KVEventQueue:
    """Events since the last drain, oldest first.

    Bounded: when nobody drains (no router polls this worker) the oldest
    events are dropped rather than growing without limit; ``num_dropped``
    counts them and the consumer sees the gap in ``event_id``.
    """

    def __init__(self, max_events: int = 100_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._events: deque[KVEvent] = deque()
        self._max_events = max_events
        self._next_event_id = 0
        self.num_dropped = 0

    def publish(self, event: KVCacheEvent) -> None:
        if len(self._events) == self._max_events:
            self._events.popleft()
            self.num_dropped += 1
        self._events.append(KVEvent(self._next_event_id, time.time(), event))
        self._next_event_id += 1

    @property
    def next_event_id(self) -> int:
        return self._next_event_id

    def drain(self) -> list[KVEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)
