"""A frontend's watchdog: decides once that the process must stop serving.

Each round (``check``) runs every probe; a probe answers None (healthy) or
why it failed. A probe that fails ``limit`` rounds in a row is fatal: the
reason is recorded (once) and ``on_fatal`` runs (once). When a shutdown is
already under way (``is_shutting_down``) a failing probe is expected, e.g.
the engine stops first, and nothing is recorded or raised.

The probes a frontend runs (``frontend_probes``):

- the launcher (attached frontends only): its pid gone means the worker is
  gone; fatal at once (the frontend then exits within a second or two).
- the engine: the engine client's own verdict (its process exited, or its
  lane heard no heartbeat for ``ENGINE_SILENCE_LIMIT`` seconds, which covers
  a hung, e.g. SIGSTOPped, engine). By then the client has failed every
  in-flight request with a clear error and ``/health`` answers 503.

The clock and the probes are injected, so the fatal path is unit-tested
without processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Probe", "Watchdog", "frontend_probes"]

log = logging.getLogger("disagg.watchdog")


@dataclass
class Probe:
    name: str
    check: Callable[[], str | None]  # None: healthy; else why it failed
    limit: int = 1  # consecutive failures that are fatal
    failures: int = field(default=0, init=False)


class Watchdog:
    def __init__(self, probes: Sequence[Probe], on_fatal: Callable[[str], None],
                 is_shutting_down: Callable[[], bool], *, interval: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.probes = list(probes)
        self.on_fatal = on_fatal
        self.is_shutting_down = is_shutting_down
        self.interval = interval
        self.clock = clock
        self.fatal_reason: str | None = None
        self.fatal_at: float | None = None

    def check(self) -> str | None:
        """One round; the fatal reason when this round found one (None otherwise, and after)."""
        if self.fatal_reason is not None:
            return None
        for probe in self.probes:
            why = probe.check()
            probe.failures = 0 if why is None else probe.failures + 1
            if why is not None and probe.failures >= probe.limit:
                return self._fatal(f"{probe.name}: {why}")
        return None

    def _fatal(self, reason: str) -> str | None:
        if self.is_shutting_down():
            return None  # an orderly stop: its probes failing is expected
        self.fatal_reason = reason
        self.fatal_at = self.clock()
        log.error("watchdog: %s; this frontend stops serving", reason)
        self.on_fatal(reason)
        return reason

    async def run(self) -> None:
        while self.fatal_reason is None:
            self.check()
            await asyncio.sleep(self.interval)


def frontend_probes(client: object, launcher_pid: int | None, process_alive: Callable[[int], bool]) -> list[Probe]:
    """The probes of a serving frontend; ``launcher_pid`` None in the launcher itself."""

    def engine() -> str | None:
        return getattr(client, "dead_reason", None)

    probes = [Probe("engine", engine)]
    if launcher_pid is not None:
        pid = launcher_pid
        probes.insert(0, Probe("launcher", lambda: None if process_alive(pid) else f"pid {pid} is gone"))
    return probes
