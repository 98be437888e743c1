"""Stopping child processes: SIGTERM, a grace period, then SIGKILL.

Shared by everything that supervises ``subprocess.Popen`` children (``disagg
up``, the orchestrator's K_o processes, the tests' worker fixtures).
"""

from __future__ import annotations

import subprocess
from typing import Iterable

__all__ = ["stop_process", "stop_processes"]


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM ``proc`` if it runs, wait up to ``timeout`` s, SIGKILL it then; its exit code."""
    if proc.poll() is None:
        proc.terminate()
    _wait_or_kill(proc, timeout)
    return proc.returncode


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float) -> None:
    """``stop_process`` for all at once: every one gets SIGTERM first, so they stop in parallel."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        _wait_or_kill(proc, timeout)


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
