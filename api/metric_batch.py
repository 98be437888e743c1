"""Prometheus writes batched in memory: the request path counts, ``flush()`` writes the sums.

In multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``: a worker's K frontends,
the orchestrator's K_o processes) every ``inc`` is a locked write to a shared
file plus a ``getpid()`` (prometheus_client checks for a fork on every
write), and a histogram observation is two of them: a dozen per request. A
``MetricBatch`` keeps the increments and observations in memory and writes
each touched series once per flush: within ``flush_seconds`` of the first
unwritten value (a timer on the running loop), or whenever its owner calls
``flush()`` (before it renders, at shutdown, when it has nothing in flight).
Outside an event loop nothing is deferred: each value is written at once.

Used by ``frontends.prometheus`` and ``orchestrator.metrics``.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from typing import Any

__all__ = ["MetricBatch", "observe_all"]


class MetricBatch:
    """Counter increments and histogram observations waiting for one write each."""

    def __init__(self, flush_seconds: float) -> None:
        self.flush_seconds = flush_seconds
        self._counts: dict[Any, float] = {}  # a counter (labelled child) -> amount since the last flush
        self._observed: dict[Any, list[float]] = {}  # a histogram (labelled child) -> values
        self._timer: asyncio.TimerHandle | None = None
        self._sources: list[Callable[[MetricBatch], None]] = []
        self._flushing = False  # the sources count inside flush: that must not flush again

    def on_flush(self, source: Callable[[MetricBatch], None]) -> None:
        """Call ``source(batch)`` at every flush, before the writes: for counts kept elsewhere
        (``api.piece_cache``'s lookups), counted here since the last flush."""
        self._sources.append(source)

    def count(self, counter: Any, amount: float = 1.0) -> None:
        counts = self._counts
        if counter in counts:
            counts[counter] += amount
        else:
            counts[counter] = amount
            self._schedule()

    def observe(self, histogram: Any, value: float) -> None:
        observed = self._observed.get(histogram)
        if observed is None:
            self._observed[histogram] = [value]
            self._schedule()
        else:
            observed.append(value)

    def flush(self) -> None:
        """Write everything counted since the last flush into the metrics now."""
        self._flushing = True
        try:
            for source in self._sources:
                source(self)
        finally:
            self._flushing = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        counts, self._counts = self._counts, {}
        for counter, amount in counts.items():
            counter.inc(amount)
        observed, self._observed = self._observed, {}
        for histogram, values in observed.items():
            observe_all(histogram, values)

    def _schedule(self) -> None:
        if self._timer is not None or self._flushing:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to flush later: write now
            self.flush()
            return
        self._timer = loop.call_later(self.flush_seconds, self.flush)


def observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe`` of every value, in one write per bucket and one for the sum (the
    writes, not the arithmetic, are what each observation cost); per value without
    prometheus_client's internals."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    per_bucket = [0] * len(bounds)
    for value in values:  # observe() counts a value in the first bucket whose bound is >= it
        per_bucket[bisect.bisect_left(bounds, value)] += 1
    total.inc(sum(values))
    for bucket, count in zip(buckets, per_bucket):
        if count:
            bucket.inc(count)
