"""``workers.allocator``: the engine's periodic ``malloc_trim`` gives freed heap memory back."""

from __future__ import annotations

import ctypes

import pytest

from workers.allocator import MemoryTrimmer, release_memory, rss_bytes


def test_the_trimmer_trims_once_per_interval():
    now = [100.0]
    trimmer = MemoryTrimmer(30.0, clock=lambda: now[0])
    assert not trimmer.tick() and trimmer.num_trims == 0
    now[0] = 129.9
    assert not trimmer.tick()
    now[0] = 130.0
    assert trimmer.tick() and trimmer.num_trims == 1
    now[0] = 150.0
    assert not trimmer.tick()  # the next one is due 30 s after the last
    now[0] = 160.0
    assert trimmer.tick() and trimmer.num_trims == 2


def test_freed_heap_memory_that_glibc_keeps_is_returned():
    """Small blocks freed below a live one stay in the heap (no trim at free); release_memory
    returns their pages."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    if rss_bytes() is None:
        pytest.skip("no /proc")
    blocks = [libc.malloc(64 * 1024) for _ in range(3200)]  # 200 MiB under the mmap threshold: heap
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)
    keeper = libc.malloc(64 * 1024)  # above them: the heap's top cannot shrink past it
    for block in blocks:
        libc.free(block)
    kept = rss_bytes()
    release_memory()
    assert kept - rss_bytes() > 150 * 2**20, (kept, rss_bytes())
    libc.free(keeper)
