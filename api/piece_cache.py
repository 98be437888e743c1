"""Token ids of long prompt pieces, kept by their text: a conversation is tokenized once, not every turn.

An agentic client resends its whole conversation each turn: the same system prompt
with its tool definitions, then every earlier message, then one new one. Tokenizing
that is most of what preparing the request costs (SmolLM2's tokenizer: about 20 ms
of CPU for 24,000 tokens of chat on a 2-core VM), in the orchestrator and again in
the ctx worker's frontend, on the event loop that streams every other answer.
``PromptSegments`` tokenizes a chat prompt one piece at a time (the text between two
added tokens: a message with its role, as the template wrote it), and a piece
tokenizes the same wherever it appears; this cache keeps the ids of the long pieces,
so a later turn tokenizes only its new messages.

Only pieces of at least ``MIN_CHARS`` characters are kept (a short one costs less to
tokenize than to keep), within a budget of bytes (the text and 4 bytes an id), least
recently used out first. What a hit saves is time: a client that sends a piece another
client sent gets its answer a few milliseconds sooner, as the engines' prefix cache
already tells it, by far more.
"""

from __future__ import annotations

import sys
import threading
from array import array
from typing import Any

from api.metric_batch import MetricBatch

__all__ = ["PieceCache", "MIN_CHARS", "DEFAULT_BUDGET_BYTES", "count_lookups"]

MIN_CHARS = 512  # ~100 tokens: ~0.1 ms to tokenize, where a lookup costs ~1 us
DEFAULT_BUDGET_BYTES = 32 * 2**20  # ~170 conversations of 24,000 tokens (~95 kB of text, 96 kB of ids)


class PieceCache:
    """``get(text)`` / ``put(text, ids)``, least recently used out first within ``budget_bytes``."""

    __slots__ = ("budget_bytes", "num_bytes", "hits", "misses", "_entries", "_lock")

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0
        # text -> (ids, the bytes counted for it when kept: a str's own size grows once its UTF-8
        # form is cached, so it is counted once). Insertion order: least recently used first.
        self._entries: dict[str, tuple[array[int], int]] = {}
        self._lock = threading.Lock()  # a tokenizer may be shared with a worker thread

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str) -> array[int] | None:
        """The ids kept for ``text`` (do not modify them), now the most recently used; None if none."""
        with self._lock:
            entry = self._entries.pop(text, None)
            if entry is None:
                self.misses += 1
                return None
            self._entries[text] = entry
            self.hits += 1
            return entry[0]

    def put(self, text: str, ids: list[int]) -> None:
        """Keep ``ids`` for ``text``, dropping the least recently used pieces to stay within budget."""
        kept = array("I", ids)
        size = sys.getsizeof(text) + kept.itemsize * len(kept)
        if size > self.budget_bytes:
            return
        with self._lock:
            old = self._entries.pop(text, None)
            if old is not None:
                self.num_bytes -= old[1]
            while self._entries and self.num_bytes + size > self.budget_bytes:
                self.num_bytes -= self._entries.pop(next(iter(self._entries)))[1]
            self._entries[text] = (kept, size)
            self.num_bytes += size


def count_lookups(cache: PieceCache | None, counter: Any, batch: MetricBatch) -> None:
    """Export ``cache``'s lookups as ``counter{result="hit"|"miss"}`` (both created at zero), counted
    into ``batch`` at each of its flushes: the lookup itself stays a dict access."""
    hit, miss = counter.labels("hit"), counter.labels("miss")
    if cache is None:  # a tokenizer that encodes prompts whole keeps nothing: the series stay at 0
        return
    seen = [cache.hits, cache.misses]

    def source(batch: MetricBatch) -> None:
        hits, misses = cache.hits, cache.misses
        new_hits, new_misses = hits - seen[0], misses - seen[1]
        seen[:] = hits, misses  # first: counting may flush (outside an event loop: at once)
        if new_hits:
            batch.count(hit, new_hits)
        if new_misses:
            batch.count(miss, new_misses)

    batch.on_flush(source)
