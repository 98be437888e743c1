"""Giving memory back to the system after a large request.

A 10 MB body is decoded into a 10 MB ``bytes``, then a str, then whatever the
route builds from it; all of it is freed when the request ends, but glibc's
allocator keeps freed heap memory for reuse (and raises its mmap threshold
after freeing a large mapping, so the next large buffer lands on the heap too).
A process that once served a large request then stays that much larger
(issue 16: +1 GB after one rejected 10 MB prompt). ``release_memory`` asks
glibc to return free heap pages (``malloc_trim(0)``); it runs off the event
loop after a request whose body was at least ``TRIM_AFTER_BYTES`` (or of
unknown length), so ordinary requests pay nothing. Elsewhere (musl, macOS)
it does nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from workers.allocator import release_memory

__all__ = ["TRIM_AFTER_BYTES", "release_memory", "large_body", "release_memory_soon"]

TRIM_AFTER_BYTES = 1024 * 1024


def large_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request's body may be large: a ``Content-Length`` of at least
    ``TRIM_AFTER_BYTES``, or a chunked body (its length unknown until read)."""
    for name, value in headers:
        if name == b"content-length":
            return value.isdigit() and int(value) >= TRIM_AFTER_BYTES
        if name == b"transfer-encoding":
            return True
    return False


def release_memory_soon() -> None:
    """``release_memory`` in a worker thread (it walks the heap: milliseconds, not for the loop)."""
    task = asyncio.get_running_loop().run_in_executor(None, release_memory)
    task.add_done_callback(lambda f: f.exception())  # retrieved: nothing to log from a trim
