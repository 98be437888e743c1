"""The keeper's serving processes: spawned (or adopted), respawned when they die, stopped in step.

A process that dies (SIGKILL, OOM, a crash) is respawned on the same port
(SO_REUSEPORT) while it has died fewer than ``max_process_restarts`` times
within ``process_restart_window_seconds`` (``common.restart_budget``); past
that it is left down, logged, and the others keep serving. Either way
``on_exit`` runs (its live metric series are dropped); the state owner
releases the in-flight counts it held itself (``orchestrator.state``).

A keeper started while serving processes of an earlier keeper still run
*adopts* them (``orchestrator.process_records``): they keep their streams;
it watches them by pid (they are not its children: their exit code is
unknown) and respawns them like its own.

Stopping is asynchronous (SIGTERM to all at once, then wait up to the
deadline, then SIGKILL): every process drains in parallel.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.processes import terminate
from common.restart_budget import RestartBudget
from orchestrator.process_records import ProcessRecord, forget_records, read_records, write_record

__all__ = ["ProcessGroup", "Member"]

log = logging.getLogger("disagg.orchestrator")

WATCH_SECONDS = 0.2


@dataclass
class Member:
    """One serving process: our child (``popen``) or adopted from an earlier keeper (``record``)."""

    index: int
    pid: int
    popen: subprocess.Popen[bytes] | None = None
    record: ProcessRecord | None = None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None  # reaps: an unreaped child's pid is never recycled
        return self.record is not None and self.record.running()

    def exit_code(self) -> int | str:
        return self.popen.returncode if self.popen is not None else "adopted: exit code unknown"


class ProcessGroup:
    def __init__(self, config_path: str, state_dir: str, port: int, processes: int,
                 budget: Callable[[], RestartBudget], on_exit: Callable[[Member], None],
                 extra_argv: Sequence[str] = ()) -> None:
        self._config_path = config_path
        self._state_dir = state_dir
        self._extra_argv = list(extra_argv)  # the keeper's command-line overrides, passed on
        self._port = port
        self._budgets = {i: budget() for i in range(processes)}
        self._on_exit = on_exit
        records = read_records(state_dir)
        extra = [r for i, r in records.items() if i >= processes and r.running()]
        if extra:  # an earlier keeper ran more processes than the config now says: they drain and go
            log.warning("stopping %d orchestrator processes beyond processes=%d", len(extra), processes)
            for surplus in extra:
                os.kill(surplus.pid, signal.SIGTERM)  # each exits within its own deadline
        self.members: dict[int, Member] = {}
        for index in range(processes):
            record = records.get(index)
            if record is not None and record.running():
                self.members[index] = Member(index, record.pid, record=record)
            else:
                self.members[index] = self._spawn(index)
        self.left_down: set[int] = set()
        self._stopping = False

    @property
    def adopted(self) -> list[int]:
        return [i for i, m in self.members.items() if m.popen is None]

    def _spawn(self, index: int) -> Member:
        argv = [sys.executable, "-m", "disagg.cli", "orchestrator", "--config", self._config_path,
                "--port", str(self._port), "--process-index", str(index), *self._extra_argv]
        child = subprocess.Popen(argv)
        # Recorded at once: a keeper that dies now leaves a process that `down` still finds.
        write_record(self._state_dir, index, child.pid)
        return Member(index, child.pid, popen=child)

    def exited(self) -> list[int]:
        return [i for i, member in self.members.items() if not member.alive()]

    async def watch(self) -> None:
        """Until cancelled: respawn (or leave down) every process that dies."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            for index in self.exited():
                if self._stopping or index in self.left_down:
                    continue
                member = self.members[index]
                self._on_exit(member)
                budget = self._budgets[index]
                if budget.allow(time.monotonic()):
                    log.warning("orchestrator process %d (pid %d) exited (%s); respawning it", index, member.pid,
                                member.exit_code())
                    self.members[index] = self._spawn(index)
                else:
                    self.left_down.add(index)
                    log.error("orchestrator process %d exited (%s) %d times within %g s: leaving it down, "
                              "the others keep serving", index, member.exit_code(), budget.recent_exits,
                              budget.window_seconds)

    async def stop(self, timeout: float) -> list[int]:
        """SIGTERM every process, wait up to ``timeout`` for them to drain and exit, SIGKILL the
        rest; the pids that had to be killed."""
        self._stopping = True
        running = {m.pid: m for m in self.members.values() if m.alive()}
        # A thread waits: the keeper's loop stays responsive meanwhile.
        killed = await asyncio.to_thread(terminate, list(running), timeout, alive=lambda pid: running[pid].alive())
        for member in self.members.values():
            if member.popen is not None:
                member.popen.wait()
        for pid in killed:
            log.warning("orchestrator process pid %d did not stop within %g s; killed it", pid, timeout)
        forget_records(self._state_dir)
        return killed
