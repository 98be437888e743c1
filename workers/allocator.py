"""Giving freed heap memory back to the system (glibc's ``malloc_trim``).

glibc keeps memory a process frees for reuse instead of returning it, and
after freeing a large mapped buffer it raises its mmap threshold to that
buffer's size (up to 32 MiB), so later buffers up to that size come from the
heap arenas too, where freed ones stay resident. Measured on a SmolLM2-135M
deployment (torch engine, GGUF weights) after its first ~40 requests:
``malloc_trim(0)`` called inside the live engines took the ctx engine from
1,628 to 1,450 MB and the gen engine from 1,624 to 1,440 MB, memory in no use,
left by loading the model (its dequantized copies); with glibc's threshold
pinned (``MALLOC_MMAP_THRESHOLD_=131072``) the same engines held ~1,460 MB.

So the engine trims once its model is loaded and every
``TRIM_INTERVAL_SECONDS`` after (``MemoryTrimmer``), between two steps: a trim
walks the free lists (milliseconds) and the pages it returns are faulted in
again only when reused, so it costs a few milliseconds a half-minute and bounds
what the engine keeps unused to what it freed since the last trim. (A ctx
engine's steady growth under load was not this but memory in use, which a
trim does not return: oneDNN's kernels compiled per prompt length, now
bounded by ``workers.engine.model.packed_linear.padded_rows``.)
The frontends trim after a large request body (``api.memory``).
Elsewhere than glibc (musl, macOS) trimming does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from typing import Any

__all__ = ["release_memory", "rss_bytes", "MemoryTrimmer", "TRIM_INTERVAL_SECONDS"]

log = logging.getLogger("disagg.allocator")

TRIM_INTERVAL_SECONDS = 30.0
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _load_malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def release_memory() -> None:
    """Return the allocator's free heap pages to the system (glibc); a no-op elsewhere."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def rss_bytes() -> int | None:
    """This process's resident set size (Linux), None where /proc is not there."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


class MemoryTrimmer:
    """``release_memory`` at most every ``interval`` seconds, from a loop that calls ``tick``."""

    def __init__(self, interval: float = TRIM_INTERVAL_SECONDS, clock=time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.num_trims = 0
        self._next = clock() + interval

    def tick(self) -> bool:
        """Trim when the interval has passed (True then); one clock read otherwise."""
        now = self.clock()
        if now < self._next:
            return False
        self.trim()
        self._next = self.clock() + self.interval
        return True

    def trim(self) -> None:
        before, start = rss_bytes(), time.perf_counter()
        release_memory()
        self.num_trims += 1
        after = rss_bytes()
        if before is not None and after is not None:
            log.debug("malloc_trim: RSS %.1f -> %.1f MB in %.1f ms", before / 2**20, after / 2**20,
                      (time.perf_counter() - start) * 1e3)
