"""Process 0's non-zero orchestrator processes: spawned, respawned when they die, stopped in step.

A process that dies (SIGKILL, OOM, a crash) is respawned on the same port
(SO_REUSEPORT) while it has died fewer than ``max_process_restarts`` times
within ``process_restart_window_seconds`` (``workers.restart_budget``); past
that it is left down, logged, and the others keep serving. Either way its
in-flight counts at the state owner are released at once (``on_exit``):
nobody else would ever decrement them, and ``least_load`` would steer away
from those workers forever.

Stopping is asynchronous (SIGTERM to all at once, then wait): process 0 keeps
serving its own in-flight requests, and the state owner keeps answering the
others, while they drain.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from typing import Callable, Sequence

from workers.processes import stop_processes
from workers.restart_budget import RestartBudget

__all__ = ["ProcessGroup"]

log = logging.getLogger("disagg.orchestrator")

WATCH_SECONDS = 0.2


class ProcessGroup:
    def __init__(self, config_path: str, port: int, indexes: range, budget: Callable[[], RestartBudget],
                 on_exit: Callable[[int], None], extra_argv: Sequence[str] = ()) -> None:
        self._config_path = config_path
        self._extra_argv = list(extra_argv)  # process 0's command-line overrides, passed on
        self._port = port
        self._budgets = {i: budget() for i in indexes}
        self._on_exit = on_exit
        self.children: dict[int, subprocess.Popen] = {i: self._spawn(i) for i in indexes}
        self.left_down: set[int] = set()
        self._stopping = False

    def _spawn(self, index: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "disagg.cli", "orchestrator", "--config", self._config_path,
                "--port", str(self._port), "--process-index", str(index), "--parent-pid", str(os.getpid()), *self._extra_argv]
        return subprocess.Popen(argv)

    def exited(self) -> list[int]:
        return [i for i, child in self.children.items() if child.poll() is not None]

    async def watch(self) -> None:
        """Until cancelled: respawn (or leave down) every child that dies."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            for index in self.exited():
                if self._stopping or index in self.left_down:
                    continue
                code = self.children[index].returncode
                self._on_exit(index)
                budget = self._budgets[index]
                if budget.allow(time.monotonic()):
                    log.warning("orchestrator process %d (pid %d) exited (%s); respawning it, its in-flight "
                                "counts released", index, self.children[index].pid, code)
                    self.children[index] = self._spawn(index)
                else:
                    self.left_down.add(index)
                    log.error("orchestrator process %d exited (%s) %d times within %g s: leaving it down, "
                              "the others keep serving", index, code, budget.recent_exits, budget.window_seconds)

    async def stop(self, timeout: float) -> None:
        """SIGTERM every child, wait up to ``timeout`` for them to drain and exit, SIGKILL the rest."""
        self._stopping = True
        running = [c for c in self.children.values() if c.poll() is None]
        # A thread waits: this loop keeps serving process 0's requests and the state owner meanwhile.
        for pid in await asyncio.to_thread(stop_processes, running, timeout):
            log.warning("orchestrator process pid %d did not stop within %g s; killed it", pid, timeout)
