"""Onboarding: copying blocks from the host and disk tiers back into the engine's pool.

A job copies a request's lower-tier hits, in chain order, into pool blocks the request already
holds (``KVTiers.onboard``); nothing else reads or writes those blocks until the scheduler
collects the job, so the copy may run beside the engine's steps. ``ThreadOnboarder`` runs jobs on
a thread of its own: the batch the request joins is never stalled by its copy (the request waits,
the others step). ``InlineOnboarder`` copies at once, for the cluster simulation, whose clock
charges onboarding in its timing model instead.

A disk payload that is missing or fails its check ends the job there (``num_loaded`` blocks were
copied, ``num_failed`` were not): the request computes the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from workers.engine.tier_disk import DiskBlock, DiskFiles

__all__ = ["TierSource", "OnboardJob", "Onboarder", "ThreadOnboarder", "InlineOnboarder"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierSource:
    """Where one block's payload is: a host slot's bytes, or a disk file."""

    frame_sizes: tuple[int, ...]
    host: memoryview | None = None
    disk: DiskBlock | None = None


@dataclass(slots=True)
class OnboardJob:
    request_id: int
    block_ids: list[int]  # pool blocks, one per source, in chain order
    sources: list[TierSource]
    num_loaded: int = 0
    num_failed: int = 0  # the blocks from the first unreadable payload on


class Onboarder(Protocol):
    num_failed: int  # disk payloads that failed their read or check
    num_bytes: int
    seconds: float

    def submit(self, job: OnboardJob) -> None: ...

    def has_done(self) -> bool: ...

    def take_done(self) -> list[OnboardJob]: ...

    def close(self) -> None: ...


class InlineOnboarder:
    """Copies each job as it is submitted."""

    def __init__(self, import_blocks: Callable[[list[int], list[Any]], None], disk: DiskFiles | None) -> None:
        self._import, self._disk = import_blocks, disk
        self._done: deque[OnboardJob] = deque()  # appended by the copying thread, taken by the engine loop
        self.num_failed = self.num_bytes = 0
        self.seconds = 0.0

    def submit(self, job: OnboardJob) -> None:
        self._run(job)

    def has_done(self) -> bool:
        return bool(self._done)

    def take_done(self) -> list[OnboardJob]:
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    def close(self) -> None:
        pass

    def _run(self, job: OnboardJob) -> None:
        started = time.perf_counter()
        for block_id, source in zip(job.block_ids, job.sources):
            payload = self._read(source)
            if payload is None or not self._copy(block_id, payload, source.frame_sizes):
                job.num_failed = len(job.sources) - job.num_loaded
                self.num_failed += 1
                break
            self.num_bytes += len(payload)
            job.num_loaded += 1
        for source in job.sources:  # the disk copies were moved up (or are useless): their files go
            if source.disk is not None and self._disk is not None:
                self._disk.delete(source.disk)
        self.seconds += time.perf_counter() - started
        self._done.append(job)

    def _copy(self, block_id: int, payload: bytes | memoryview, frame_sizes: tuple[int, ...]) -> bool:
        try:
            self._import([block_id], _frames(payload, frame_sizes))
        except Exception:  # the request must not wait forever: it computes the block instead
            log.exception("KV tiers: importing a block into the pool failed; it is computed instead")
            return False
        return True

    def _read(self, source: TierSource) -> bytes | memoryview | None:
        if source.host is not None:
            return source.host
        if source.disk is None or self._disk is None:
            return None
        return self._disk.read(source.disk)


class ThreadOnboarder(InlineOnboarder):
    """Copies jobs in order on a background thread."""

    def __init__(self, import_blocks: Callable[[list[int], list[Any]], None], disk: DiskFiles | None) -> None:
        super().__init__(import_blocks, disk)
        self._jobs: deque[OnboardJob | None] = deque()
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="kv-onboard", daemon=True)
        self._thread.start()

    def submit(self, job: OnboardJob) -> None:
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._jobs.append(None)
            self._wake.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
                job = self._jobs.popleft()
            if job is None:
                return
            self._run(job)


def _frames(payload: bytes | memoryview, sizes: tuple[int, ...]) -> list[memoryview]:
    """The block's frames as the executor exported them (the payload is their concatenation)."""
    view, frames, offset = memoryview(payload), [], 0
    for size in sizes:
        frames.append(view[offset:offset + size])
        offset += size
    return frames
