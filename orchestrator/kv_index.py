"""Which worker holds which KV blocks, mirrored from the workers' KV-cache events.

Process 0 drains each worker's ``GET /kv_cache_events`` (a JSON list of
``{"event_id", "timestamp", "event": {"type": ..., ...}}``) and applies the
events here; the other processes receive the resulting sets in the state
snapshots. Event types are accepted as written by msgspec
(``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) or in short form
(``stored``/``removed``/``cleared``). Event ids that go back mean the
worker restarted (its set is cleared); a gap in ``event_id`` means events
were lost: the worker's set is then only an estimate until blocks churn,
which costs routing quality, never correctness (the worker checks its cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["KVIndex"]

_STORED = ("BlockStored", "stored")
_REMOVED = ("BlockRemoved", "removed")
_CLEARED = ("AllBlocksCleared", "cleared")


class KVIndex:
    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.next_event_id: dict[str, int] = {}
        self.num_gaps = 0

    def apply(self, worker_id: str, events: Iterable[dict[str, Any]]) -> int:
        """Apply drained events in order; the number applied."""
        held = self.blocks.setdefault(worker_id, set())
        count = 0
        for entry in events:
            expected = self.next_event_id.get(worker_id)
            event_id = entry.get("event_id")
            if isinstance(event_id, int):
                if expected is not None and event_id < expected:
                    held.clear()  # ids went back: the worker restarted with an empty cache
                elif expected is not None and event_id != expected:
                    self.num_gaps += 1
                self.next_event_id[worker_id] = event_id + 1
            event = entry.get("event", entry)
            kind = event.get("type")
            if kind in _STORED:
                held.update(int(h) for h in event.get("block_hashes", ()))
            elif kind in _REMOVED:
                held.difference_update(int(h) for h in event.get("block_hashes", ()))
            elif kind in _CLEARED:
                held.clear()
            else:
                continue
            count += 1
        return count

    def remove_worker(self, worker_id: str) -> None:
        self.blocks.pop(worker_id, None)
        self.next_event_id.pop(worker_id, None)

    def replace(self, blocks: dict[str, list[int]]) -> None:
        """Adopt a published snapshot (non-owner processes)."""
        self.blocks = {worker_id: set(hashes) for worker_id, hashes in blocks.items()}

    def export(self) -> dict[str, list[int]]:
        return {worker_id: sorted(hashes) for worker_id, hashes in self.blocks.items()}

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
