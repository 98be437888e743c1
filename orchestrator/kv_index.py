"""Which worker holds which KV blocks, mirrored from the workers' KV-cache events.

Process 0 drains each worker's ``GET /kv_cache_events`` (a JSON list of
``{"event_id", "timestamp", "event": {"type": ..., ...}}``, read as
``workers.http_protocol.KVEventEntry``) and applies the
events here; the other processes receive the resulting sets in the state
snapshots. Event types are accepted as written by msgspec
(``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) or in short form
(``stored``/``removed``/``cleared``).

The drain is destructive, so events can be lost: an answer that timed out
after the launcher drained, a queue that overflowed while nobody polled,
another poller. A lost ``BlockRemoved`` leaves a hash here that the worker
evicted long ago, and the set drifts above what the worker can hold (4,789
cached blocks counted for a pool of 4,096). So a worker's set is *stale*,
and resynchronised from the worker's ``GET /kv_cache_snapshot`` (every cached
hash and the id its next event will carry) before more events are applied,
when: it was never synchronised (an orchestrator that starts beside a warm
worker), ``event_id`` skipped (events lost), or it grew past the worker's
capacity (``num_blocks``, reported in the snapshot and ``/worker_info``).
After adopting a snapshot, queued events with smaller ids (already in it) are
skipped. Ids that go back mean the worker restarted (its set is cleared).
A worker without the snapshot route gets its set cleared when it overflows
(routing quality is lost for a while, correctness never: the worker checks its
own cache). Invariant: ``len(blocks[w]) <= capacity[w]`` for every worker whose
capacity is known.

Tiers: an event's ``tier`` (``pool`` when absent) says where the block is; host and disk blocks
are kept in ``lower``, apart from the pool's (they are not bounded by the pool's capacity), and
``match`` counts a prompt's chain through both, so a router can score a lower-tier block below a
pool block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from workers.http_protocol import KVEventEntry

__all__ = ["KVIndex"]

_STORED = ("BlockStored", "stored")
_REMOVED = ("BlockRemoved", "removed")
_CLEARED = ("AllBlocksCleared", "cleared")


class KVIndex:
    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}  # the pool's blocks
        self.lower: dict[str, set[int]] = {}  # the host and disk tiers' blocks
        self.next_event_id: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.stale: set[str] = set()
        """Workers whose set must be resynchronised from a snapshot before it is trusted again."""
        self._snapshot_floor: dict[str, int] = {}  # events below this id are already in the adopted snapshot
        self.num_gaps = 0
        self.num_overflows = 0
        self.num_resyncs = 0

    def set_capacity(self, worker_id: str, num_blocks: int) -> None:
        self.capacity[worker_id] = num_blocks
        self._bound(worker_id)

    def needs_snapshot(self, worker_id: str) -> bool:
        return worker_id in self.stale or worker_id not in self.next_event_id

    def adopt_snapshot(self, worker_id: str, next_event_id: int, block_hashes: Iterable[int],
                       num_blocks: int | None = None, lower_block_hashes: Iterable[int] = ()) -> None:
        """The worker's whole cache at ``next_event_id``: replaces what the events built."""
        if num_blocks is not None:
            self.capacity[worker_id] = num_blocks
        self.blocks[worker_id] = set(block_hashes)
        self.lower[worker_id] = set(lower_block_hashes)
        self.next_event_id[worker_id] = next_event_id
        self._snapshot_floor[worker_id] = next_event_id
        self.stale.discard(worker_id)
        self.num_resyncs += 1

    def apply(self, worker_id: str, events: Iterable[KVEventEntry]) -> int:
        """Apply drained events in order; the number applied."""
        held = self.blocks.setdefault(worker_id, set())
        lower = self.lower.setdefault(worker_id, set())
        count = 0
        for entry in events:
            if entry.event_id is not None and not self._in_sequence(worker_id, entry.event_id, held):
                continue
            event = entry.event
            kind = event.type
            tier = held if event.tier == "pool" else lower
            if kind in _STORED:
                tier.update(event.block_hashes)
            elif kind in _REMOVED:
                tier.difference_update(event.block_hashes)
            elif kind in _CLEARED:
                held.clear()
                lower.clear()
            else:
                continue
            count += 1
        self._bound(worker_id)
        return count

    def _in_sequence(self, worker_id: str, event_id: int, held: set[int]) -> bool:
        """Track ``event_id``; False for an event the adopted snapshot already holds."""
        floor = self._snapshot_floor.get(worker_id)
        if floor is not None:
            if event_id < floor:
                return False  # queued before the snapshot was taken: already in it
            del self._snapshot_floor[worker_id]
        expected = self.next_event_id.get(worker_id)
        if expected is not None and event_id < expected:
            held.clear()  # ids went back: the worker restarted with an empty cache
            self.lower.get(worker_id, set()).clear()
        elif expected is not None and event_id != expected:
            self.num_gaps += 1
            self.stale.add(worker_id)  # events were lost: what they removed is still counted here
        self.next_event_id[worker_id] = event_id + 1
        return True

    def _bound(self, worker_id: str) -> None:
        if self.over_capacity(worker_id):
            self.num_overflows += 1
            self.stale.add(worker_id)
            # The invariant holds at once, not only after the next snapshot: until it comes, an
            # underestimate costs a prefix hit, an overestimate routes to blocks that are gone.
            self.clear_worker(worker_id)

    def over_capacity(self, worker_id: str) -> bool:
        capacity = self.capacity.get(worker_id)
        return capacity is not None and len(self.blocks.get(worker_id, ())) > capacity

    def clear_worker(self, worker_id: str) -> None:
        """Forget what this worker holds (no snapshot to resynchronise from): an underestimate
        costs a prefix hit, an overestimate routes to a worker for blocks it no longer has."""
        self.blocks[worker_id] = set()

    def remove_worker(self, worker_id: str) -> None:
        self.blocks.pop(worker_id, None)
        self.lower.pop(worker_id, None)
        self.next_event_id.pop(worker_id, None)
        self.capacity.pop(worker_id, None)
        self._snapshot_floor.pop(worker_id, None)
        self.stale.discard(worker_id)

    def replace(self, blocks: dict[str, list[int]], lower: dict[str, list[int]] | None = None) -> None:
        """Adopt a published snapshot (non-owner processes)."""
        self.blocks = {worker_id: set(hashes) for worker_id, hashes in blocks.items()}
        self.lower = {worker_id: set(hashes) for worker_id, hashes in (lower or {}).items()}

    def export(self) -> dict[str, list[int]]:
        return {worker_id: sorted(hashes) for worker_id, hashes in self.blocks.items()}

    def export_lower(self) -> dict[str, list[int]]:
        return {worker_id: sorted(hashes) for worker_id, hashes in self.lower.items() if hashes}

    def match(self, worker_id: str, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Leading blocks of the prompt this worker holds in its pool or a tier below it, and how
        many of those are below it (a chain: stop at the first block held nowhere)."""
        held, lower = self.blocks.get(worker_id), self.lower.get(worker_id)
        if not lower:
            return self.num_matched_blocks(worker_id, block_hashes), 0
        count = num_lower = 0
        for block_hash in block_hashes:
            if held and block_hash in held:
                count += 1
            elif block_hash in lower:
                count += 1
                num_lower += 1
            else:
                break
        return count, num_lower

    def num_matched_blocks(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt this worker holds (a chain: stop at the first miss)."""
        held = self.blocks.get(worker_id)
        if not held:
            return 0
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count
