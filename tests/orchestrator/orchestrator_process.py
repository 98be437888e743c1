"""Start a real ``disagg orchestrator`` as a subprocess for tests.

    url, proc = start_orchestrator(tmp_path, model_dir, workers=[("both", url)], processes=2)
    ...
    stop_orchestrator(proc)
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import httpx
from worker_process import free_port

from common.processes import stop_process
from orchestrator.readiness import health_progress
from orchestrator.server import READY_MESSAGE

__all__ = ["start_orchestrator", "stop_orchestrator", "wait_until", "orchestrator_log", "STARTED"]

# Every orchestrator a test started: a failing test shows the logs of those still running (tests/conftest.py).
STARTED: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()


def start_orchestrator(tmp_path: Path, model_dir: str | Path, workers: list[tuple[str, str]], processes: int = 2,
                       wait_healthy: bool = True, timeout: float = 120.0, **overrides: Any
                       ) -> tuple[str, subprocess.Popen]:
    port = free_port()
    state_dir = Path(tmp_path) / f"orch-{port}"
    config = {"model_dir": str(model_dir), "state_dir": str(state_dir), "port": port, "processes": processes,
              "health": {"interval_seconds": 0.2}, "log_level": "warning",
              "workers": [{"role": role, "url": url} for role, url in workers], **overrides}
    path = Path(tmp_path) / f"orchestrator-{port}.json"
    path.write_text(json.dumps(config))
    log = open(Path(tmp_path) / f"orchestrator-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "disagg.cli", "orchestrator", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    proc.log_path = log.name
    log.close()
    STARTED.add(proc)
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(READY_MESSAGE):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_orchestrator(proc)
            raise RuntimeError(f"orchestrator did not start:\n{orchestrator_log(proc)}")
    url = f"http://127.0.0.1:{port}"
    if wait_healthy:
        ready_processes: set[int] = set()  # every process must have seen a healthy worker
        wait_until(lambda: health_progress(url, ready_processes) == "ready", timeout)
    return url, proc


def orchestrator_log(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")


def stop_orchestrator(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    return stop_process(proc, timeout)


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)
