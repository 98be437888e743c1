"""The one place a process is checked for life and stopped: SIGTERM, a grace period, then SIGKILL.

Everyone who supervises or watches processes calls this module: ``disagg up``
and ``down`` (their children and the pids recorded in the run directory), the
launcher (engine, frontends, rank followers), the frontends and the
orchestrator (is my launcher / engine / parent still there?), the tests'
worker fixtures and the benchmarks. It sits in ``workers`` because every
package may import ``workers`` (tests/test_layering.py).

Two ways to name a process:

- a ``subprocess.Popen`` we started (``stop_process``, ``stop_processes``):
  its pid cannot be recycled before we reap it, and we do reap it;
- a bare pid (``pid_alive``, ``terminate``): someone else's child, or one
  recorded in a file. ``alive`` decides what counts as still ours; a
  recorded pid passes ``common.process_identity.same_process`` so that a
  recycled pid is never signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = ["pid_alive", "terminate", "stop_process", "stop_processes", "KILL_WAIT_SECONDS"]

log = logging.getLogger(__name__)

KILL_WAIT_SECONDS = 5.0
"""How long a SIGKILLed process is waited for (it cannot refuse; this only bounds a D-state wait)."""
_POLL_SECONDS = 0.05


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no procfs (macOS): fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def _signal(pid: int, signum: int, alive: Callable[[int], bool]) -> bool:
    if not alive(pid):
        return False
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids: Sequence[int], timeout: float, alive: Callable[[int], bool]) -> list[int]:
    """Wait until none of ``pids`` is alive or ``timeout`` passes; those still alive."""
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    return left


def terminate(pids: Iterable[int], grace: float, *, sig: int | None = signal.SIGTERM,
              alive: Callable[[int], bool] = pid_alive) -> list[int]:
    """Send ``sig`` to every pid still ``alive`` (all at once, so they stop in parallel), wait up to
    ``grace`` s, SIGKILL the rest and wait for them; the pids that had to be killed. ``sig`` None:
    give them ``grace`` to exit on their own (their parent told them to) before the SIGKILL."""
    pids = [pid for pid in pids if alive(pid)]
    if sig is not None:
        pids = [pid for pid in pids if _signal(pid, sig, alive)]
    killed = [pid for pid in _wait_gone(pids, grace, alive) if _signal(pid, signal.SIGKILL, alive)]
    _wait_gone(killed, KILL_WAIT_SECONDS, alive)
    return killed


def stop_process(proc: subprocess.Popen[bytes], timeout: float, sig: int = signal.SIGTERM, name: str | None = None) -> int:
    """Send ``sig`` to our child ``proc`` if it runs, wait up to ``timeout`` s, SIGKILL it then (a
    warning naming ``name``, when given); its exit code, reaped."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if name is not None:
            log.warning("%s did not stop within %.0f s: killing it", name, timeout)
        proc.kill()
        proc.wait()
    return proc.returncode


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    """``stop_process`` for all at once: every one gets SIGTERM first, so they stop in parallel; the
    pids that had to be killed."""
    procs = list(procs)
    killed = terminate([p.pid for p in procs if p.poll() is None], timeout, alive=_child_alive(procs))
    for proc in procs:
        proc.wait()  # reaped: gone already, or SIGKILLed
    return killed


def _child_alive(procs: Sequence[subprocess.Popen[bytes]]) -> Callable[[int], bool]:
    """Liveness through ``Popen.poll`` (which reaps): an unreaped child's pid is never recycled."""
    by_pid = {p.pid: p for p in procs}
    return lambda pid: by_pid[pid].poll() is None
