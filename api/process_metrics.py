"""``process_*`` and ``disagg_build_info``: what every process that exports Prometheus text reports about itself.

prometheus_client's own ``ProcessCollector`` reads ``/proc`` of the process
that renders the scrape, and only in single-process mode. A worker's K
frontends (and the orchestrator's K_o processes) share one multiprocess
directory and any of them may answer a scrape, so each process writes its
own figures there instead, as gauges in ``liveall`` mode: one series per
process, labelled ``process`` (its role: ``launcher``, ``frontend``,
``engine``, ``orchestrator``) and ``pid`` (added by prometheus_client: the
process that wrote the series), dropped when the writer is marked dead. A background thread samples them every
``SAMPLE_SECONDS`` (the scraping process also samples just before it
renders), so a scrape shows every live process, whichever answered it. The
launcher also samples its engine's process (``watch``): the engine imports
torch and exports nothing itself, and its memory is the figure an operator
watches; its series carries the launcher's ``pid``. ``process_cpu_seconds_total`` is therefore a gauge, not a counter;
``rate()`` works on it all the same.

``disagg_build_info{version,commit}`` (value 1) says what is running: the
installed package's version and the git commit of the source tree it was
imported from (``unknown`` outside a git checkout).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ProcessMetrics", "build_version", "build_commit", "SAMPLE_SECONDS"]

SAMPLE_SECONDS = 2.0
"""How often each process writes its own figures (a few /proc reads: about 0.1 ms)."""
# The samples of prometheus_client's ProcessCollector, exported under the same names.
_FIGURES = {
    "process_cpu_seconds_total": "Total user and system CPU time spent in seconds.",
    "process_resident_memory_bytes": "Resident memory size in bytes.",
    "process_virtual_memory_bytes": "Virtual memory size in bytes.",
    "process_open_fds": "Number of open file descriptors.",
    "process_max_fds": "Maximum number of open file descriptors.",
    "process_start_time_seconds": "Start time of the process since unix epoch in seconds.",
}


@functools.cache
def build_version() -> str:
    try:
        return importlib.metadata.version("disagg")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def build_commit() -> str:
    """The commit of the checkout this code was imported from, once per process (a ``git`` run)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


class ProcessMetrics:
    """This process's ``process_*`` gauges (``process`` label: its role) and ``disagg_build_info``,
    in ``registry``; ``start()`` begins the sampling thread, ``sample()`` writes the figures now."""

    def __init__(self, registry: Any, process: str) -> None:
        from prometheus_client import Gauge

        self._gauges = {name: Gauge(name, doc, ["process"], registry=registry, multiprocess_mode="liveall")
                        for name, doc in _FIGURES.items()}
        info = Gauge("disagg_build_info", "The running build (value 1).", ["version", "commit"], registry=registry,
                     multiprocess_mode="max")
        info.labels(build_version(), build_commit()).set(1)
        self._watched: dict[str, Callable[[], int | str]] = {process: lambda: "self"}
        self._tickers: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, process: str, pid: int) -> None:
        """Also sample another process of this host (the launcher's engine), as ``process``."""
        with self._lock:
            self._watched[process] = lambda: pid

    def on_sample(self, tick: Callable[[], None]) -> None:
        """Run ``tick`` at every sample too: a gauge read from this process's memory (requests in flight)."""
        self._tickers.append(tick)

    def sample(self) -> None:
        from prometheus_client import ProcessCollector

        with self._lock:
            watched = list(self._watched.items())
        for process, pid in watched:
            for family in ProcessCollector(pid=pid, registry=None).collect():
                for s in family.samples:
                    gauge = self._gauges.get(s.name)
                    if gauge is not None:
                        gauge.labels(process).set(s.value)
        for tick in self._tickers:
            tick()

    def start(self) -> None:
        """Sample every ``SAMPLE_SECONDS`` on a daemon thread (it dies with the process)."""
        if self._thread is None and os.path.isdir("/proc"):
            self._thread = threading.Thread(target=self._run, name="process-metrics", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:  # as long as the process
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a watched process gone, /proc unreadable: try again later
                pass
            time.sleep(SAMPLE_SECONDS)
