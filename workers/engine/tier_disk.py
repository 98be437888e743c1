"""The disk tier's files: one file per block, written on a thread of its own, checked when read.

A file is the payload's 32-byte BLAKE2b digest followed by the payload (the block's frames as the
executor exported them, concatenated). The digest is also kept in memory beside the index entry;
a read that finds a missing file, a short one, another digest in its header or a payload that
does not hash to it returns None: the caller counts a miss and recomputes, never imports it.

Each engine writes under a directory of its own (``engine-*`` under the configured path, made at
start and removed at ``close``): two engines sharing a path never read each other's files, and
files of an engine that crashed are left in its own directory, safe to delete.

Threads: the engine loop calls ``write`` and ``delete`` (queued, in order, to the writer thread),
the onboarding thread calls ``read``. A ``DiskBlock`` whose write is still queued is read from
the bytes it holds; the writer drops them once the file is complete.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DiskFiles", "DiskBlock", "DIGEST_BYTES", "payload_digest"]

log = logging.getLogger(__name__)

DIGEST_BYTES = 32


def payload_digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest()


@dataclass(slots=True)
class DiskBlock:
    """One block's file. ``pending`` holds the payload until the writer has written it."""

    path: Path
    digest: bytes
    num_bytes: int  # the payload's (the file has DIGEST_BYTES more)
    pending: bytes | None
    dropped: bool = False  # evicted or taken before its write: the writer skips it


class _Op(enum.Enum):
    WRITE = enum.auto()
    DELETE = enum.auto()
    FLUSH = enum.auto()


class DiskFiles:
    def __init__(self, root: str) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix="engine-", dir=root))
        self._queue: queue.SimpleQueue[tuple[_Op, DiskBlock | threading.Event] | None] = queue.SimpleQueue()
        self.num_write_errors = 0
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def write(self, name: str, payload: bytes) -> DiskBlock:
        """Queue ``payload`` for the file ``name``; readable at once (from memory until written)."""
        block = DiskBlock(self.directory / name, payload_digest(payload), len(payload), payload)
        self._queue.put((_Op.WRITE, block))
        return block

    def delete(self, block: DiskBlock) -> None:
        block.dropped = True
        self._queue.put((_Op.DELETE, block))

    def read(self, block: DiskBlock) -> bytes | None:
        """The block's payload, or None when its file is missing or does not match its digest."""
        pending = block.pending
        if pending is not None:
            return pending
        try:
            data = block.path.read_bytes()
        except OSError:
            return None
        if len(data) != DIGEST_BYTES + block.num_bytes or data[:DIGEST_BYTES] != block.digest:
            return None
        payload = data[DIGEST_BYTES:]
        return payload if payload_digest(payload) == block.digest else None

    def flush(self) -> None:
        """Wait until every write and delete queued so far is done."""
        done = threading.Event()
        self._queue.put((_Op.FLUSH, done))
        done.wait(timeout=60)

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            op, target = item
            if isinstance(target, threading.Event):
                target.set()
            elif op is _Op.DELETE:
                target.path.unlink(missing_ok=True)
            elif not target.dropped and target.pending is not None:
                self._write(target, target.pending)

    def _write(self, block: DiskBlock, payload: bytes) -> None:
        try:
            with open(block.path, "wb") as file:
                file.write(block.digest)
                file.write(payload)
        except OSError as exc:  # a full disk: the block stays readable from memory, counted
            self.num_write_errors += 1
            log.warning("KV disk tier: could not write %s (%s); the block stays in memory", block.path, exc)
            return
        block.pending = None
