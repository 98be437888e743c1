"""Host and disk tiers under the engine's KV pool: where evicted blocks go, and come back from.

    pool ──evict──▶ host (a slab of slots, LRU) ──evict──▶ disk (a file a block, LRU) ──evict──▶ gone
      ▲                 │                                     │
      └──── onboard ────┴─────────────────────────────────────┘   a prefix hit past the pool's hits

Torch-free, and blind to the cache's layout: a block's payload is whatever the executor's
``export_blocks([block_id])`` returns (its frames, concatenated), and it goes back through
``import_blocks([block_id], frames)``. The tiers never look inside it, so any KV cache (K/V pages,
or DeepSeek-V4's sliding-window, compressed and indexer entries) plugs in unchanged.

Exclusive: a block lives in one tier at a time. ``take`` removes a hit's entries from their tier
and an ``Onboarder`` copies them into pool blocks the request already holds, on a background
thread (``ThreadOnboarder``), while the engine steps other requests; the scheduler admits the
request once its copy is done. A disk payload whose check fails stops the copy there: the blocks
before it are kept, the rest are computed (a miss, counted), never imported.

Threads: every method here but the onboarder's work runs on the engine loop. A taken entry's
host slot is not reused until ``collect`` returns its job, so the copy reads stable bytes.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from common.block_hash import BlockHash
from workers.config import ConfigError
from workers.engine.kv_events import BlockRemoved, BlockStored, KVEventQueue, Tier
from workers.engine.onboarding import InlineOnboarder, Onboarder, OnboardJob, ThreadOnboarder, TierSource
from workers.engine.tier_disk import DiskBlock, DiskFiles

__all__ = ["KVTiers", "TierStats"]

ExportBlocks = Callable[[list[int]], Sequence[Any]]
ImportBlocks = Callable[[list[int], list[Any]], None]


class TierStats(msgspec.Struct, frozen=True, gc=False):
    """The tiers' figures, cumulative since the engine started except the block counts (now)."""

    host_blocks: int
    host_capacity_blocks: int
    disk_blocks: int
    disk_capacity_blocks: int
    host_hits: int  # blocks found in the host tier by a prefix lookup
    disk_hits: int
    misses: int  # lookups past the pool's hits that found no next block below it
    disk_failures: int  # disk payloads missing or failing their check when read back (each also a miss)
    host_evictions: int  # host blocks moved to disk (or dropped, without a disk tier)
    disk_evictions: int  # disk blocks deleted for room
    bytes_offloaded: int  # payload bytes copied out of the pool
    bytes_onboarded: int  # payload bytes copied back into the pool
    onboard_seconds: float  # time the onboarding copies took (on their thread)


@dataclass(slots=True)
class _Entry:
    """A block below the pool: its place in the prefix chain (checked on a hit, as the pool's
    blocks are: a hash collision is a miss) and where its payload is."""

    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    frame_sizes: tuple[int, ...]
    slot: int | None = None  # host tier
    disk: DiskBlock | None = None  # disk tier


@dataclass(slots=True)
class _Counters:
    host_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    bytes_offloaded: int = 0


class KVTiers:
    """The host and disk tiers of one engine. ``block_bytes``: the executor's ``kv_bytes_per_block``
    (a host slot's size; a payload larger than it is refused with an error, never cut)."""

    def __init__(self, *, block_bytes: int, block_size: int, host_bytes: int, disk_path: str | None,
                 disk_bytes: int, export_blocks: ExportBlocks, import_blocks: ImportBlocks,
                 events: KVEventQueue, allocate_host: Callable[[int], Any] | None = None,
                 inline: bool = False) -> None:
        self.block_bytes, self.block_size = block_bytes, block_size
        self.num_slots = host_bytes // block_bytes
        if self.num_slots < 1:
            raise ConfigError("engine.cache.host_tier_bytes", f"{host_bytes} bytes hold no block; one needs {block_bytes}")
        self.max_disk_blocks = disk_bytes // block_bytes if disk_path else 0
        # Pinned memory from a GPU executor; else an anonymous map (pages committed as slots fill).
        buffer = allocate_host(self.num_slots * block_bytes) if allocate_host else mmap.mmap(-1, self.num_slots * block_bytes)
        self._slab = memoryview(buffer).cast("B")
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._host: OrderedDict[BlockHash, _Entry] = OrderedDict()  # LRU: oldest first
        self._disk: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self.disk_files = DiskFiles(disk_path) if disk_path and self.max_disk_blocks else None
        self._export, self.events = export_blocks, events
        onboarder_type = InlineOnboarder if inline else ThreadOnboarder
        self.onboarder: Onboarder = onboarder_type(import_blocks, self.disk_files)
        self._counts = _Counters()
        self._taken_slots: dict[int, list[int]] = {}  # request id -> host slots its onboarding reads

    # ---- eviction from the pool --------------------------------------------

    def offload(self, block_id: int, block_hash: BlockHash, parent: BlockHash | None,
                token_ids: tuple[int, ...]) -> None:
        """Copy a block the pool is evicting (still intact) into the host tier."""
        known = self._host.get(block_hash) or self._disk.get(block_hash)
        if known is not None:  # computed again while a copy sat below: keep that one, now recent
            (self._host if known.slot is not None else self._disk).move_to_end(block_hash)
            return
        frames = [_byte_view(frame) for frame in self._export([block_id])]
        sizes = tuple(frame.nbytes for frame in frames)
        if sum(sizes) > self.block_bytes:
            raise ValueError(f"a block exported {sum(sizes)} bytes, more than kv_bytes_per_block ({self.block_bytes})")
        slot = self._free_slot()
        if slot is None:  # every slot is being read by an onboarding copy: this block is dropped
            self._counts.host_evictions += 1
            return
        offset = slot * self.block_bytes
        for frame in frames:
            self._slab[offset:offset + frame.nbytes] = frame
            offset += frame.nbytes
        self._host[block_hash] = _Entry(parent, token_ids, sizes, slot=slot)
        self._counts.bytes_offloaded += sum(sizes)
        self._stored(block_hash, parent, token_ids, Tier.HOST)

    def _free_slot(self) -> int | None:
        if not self._free_slots and self._host:  # the host tier is full: its oldest block goes down to disk
            block_hash, entry = self._host.popitem(last=False)
            assert entry.slot is not None  # (a host entry)
            self._counts.host_evictions += 1
            self.events.publish(BlockRemoved([block_hash], Tier.HOST))
            self._to_disk(block_hash, entry)
            self._free_slots.append(entry.slot)
        return self._free_slots.pop() if self._free_slots else None

    def _to_disk(self, block_hash: BlockHash, entry: _Entry) -> None:
        if self.disk_files is None:
            return
        if len(self._disk) >= self.max_disk_blocks:
            old_hash, old = self._disk.popitem(last=False)
            self._counts.disk_evictions += 1
            self.events.publish(BlockRemoved([old_hash], Tier.DISK))
            self.disk_files.delete(old.disk)  # type: ignore[arg-type]  # a disk entry
        start = entry.slot * self.block_bytes  # type: ignore[operator]  # a host entry
        payload = bytes(self._slab[start:start + sum(entry.frame_sizes)])  # the slot is reused at once
        disk = self.disk_files.write(f"{block_hash:016x}.kv", payload)
        self._disk[block_hash] = _Entry(entry.parent_hash, entry.token_ids, entry.frame_sizes, disk=disk)
        self._stored(block_hash, entry.parent_hash, entry.token_ids, Tier.DISK)

    def _stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...], tier: Tier) -> None:
        self.events.publish(BlockStored([block_hash], parent, list(token_ids), self.block_size, tier))

    # ---- prefix hits -------------------------------------------------------

    def find(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...]) -> bool:
        """Whether a tier holds this block of this chain (parent and tokens compared: a collision misses)."""
        entry = self._host.get(block_hash) or self._disk.get(block_hash)
        return entry is not None and entry.parent_hash == parent and entry.token_ids == token_ids

    def count_miss(self) -> None:
        self._counts.misses += 1

    def take(self, block_hashes: list[BlockHash]) -> list[tuple[BlockHash, _Entry]]:
        """Take the blocks out of their tiers before the pool allocates blocks for them (whose
        evictions come down into the tiers and would push these further down, or out), in order.
        Hand them to ``onboard``, or back with ``put_back``; the engine loop does either before it
        publishes or serves anything else, so no event or snapshot sees them missing."""
        taken = []
        for block_hash in block_hashes:
            entry = self._host.pop(block_hash, None) or self._disk.pop(block_hash)
            taken.append((block_hash, entry))
        return taken

    def put_back(self, taken: list[tuple[BlockHash, _Entry]]) -> None:
        """The pool had no room for them: the blocks go back to their tiers (as recently used)."""
        for block_hash, entry in taken:
            (self._host if entry.slot is not None else self._disk)[block_hash] = entry

    def onboard(self, request_id: int, block_ids: list[int], taken: list[tuple[BlockHash, _Entry]]) -> None:
        """Copy the ``take``n blocks into ``block_ids`` (pool blocks the request holds), on the
        onboarding thread; ``collect`` returns the job when done."""
        sources: list[TierSource] = []
        slots: list[int] = []
        for block_hash, entry in taken:
            if entry.slot is not None:
                self._counts.host_hits += 1
                slots.append(entry.slot)
                start = entry.slot * self.block_bytes
                sources.append(TierSource(entry.frame_sizes, host=self._slab[start:start + sum(entry.frame_sizes)]))
                self.events.publish(BlockRemoved([block_hash], Tier.HOST))
            else:
                self._counts.disk_hits += 1
                sources.append(TierSource(entry.frame_sizes, disk=entry.disk))
                self.events.publish(BlockRemoved([block_hash], Tier.DISK))
        self._taken_slots[request_id] = slots
        self.onboarder.submit(OnboardJob(request_id, block_ids, sources))

    def has_done(self) -> bool:
        return self.onboarder.has_done()

    @property
    def num_in_flight(self) -> int:
        return len(self._taken_slots)

    def collect(self) -> list[tuple[int, int]]:
        """Finished onboarding jobs: (request id, blocks copied: a prefix of the job's)."""
        done = []
        for job in self.onboarder.take_done():
            self._free_slots.extend(self._taken_slots.pop(job.request_id))
            if job.num_failed:
                self._counts.misses += 1
            done.append((job.request_id, job.num_loaded))
        return done

    # ---- whole tiers -------------------------------------------------------

    def block_hashes(self) -> list[int]:
        return [*self._host, *self._disk]

    def clear(self) -> None:
        """Forget every block below the pool (a cache reset; the caller publishes the event)."""
        for entry in self._host.values():
            self._free_slots.append(entry.slot)  # type: ignore[arg-type]  # a host entry
        for entry in self._disk.values():
            self.disk_files.delete(entry.disk)  # type: ignore[union-attr, arg-type]  # a disk entry
        self._host.clear()
        self._disk.clear()

    def integrity_errors(self) -> list[str]:
        """Broken invariants: every host slot is free, holds one host entry, or is read by one
        onboarding job (free + held + taken == slots); a disk entry has a file (or its pending bytes)."""
        slots = [*self._free_slots, *(e.slot for e in self._host.values()),
                 *(slot for taken in self._taken_slots.values() for slot in taken)]
        errors = []
        if sorted(slots) != list(range(self.num_slots)):  # type: ignore[type-var]  # host entries have slots
            errors.append(f"host slots: {len(self._free_slots)} free + {len(self._host)} held + "
                          f"{len(slots) - len(self._free_slots) - len(self._host)} taken, of {self.num_slots}")
        if len(self._disk) > self.max_disk_blocks:
            errors.append(f"{len(self._disk)} disk blocks over the tier's {self.max_disk_blocks}")
        return errors

    def stats(self) -> TierStats:
        counts, onboarder = self._counts, self.onboarder
        return TierStats(len(self._host), self.num_slots, len(self._disk), self.max_disk_blocks,
                         counts.host_hits, counts.disk_hits, counts.misses, onboarder.num_failed,
                         counts.host_evictions, counts.disk_evictions, counts.bytes_offloaded,
                         onboarder.num_bytes, onboarder.seconds)

    def close(self) -> None:
        self.onboarder.close()
        if self.disk_files is not None:
            self.disk_files.close()


def _byte_view(frame: Any) -> memoryview:
    """An exported frame as flat bytes (a copy only when the executor's view is not contiguous)."""
    view = memoryview(frame)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
