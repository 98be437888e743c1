"""What a local deployment's run directory says is still running, checked before anyone acts on it.

``state.json`` (``disagg.run_state.LocalRunState``) records every process as
``(pid, start_time)`` (``common.process_identity``): the supervisor as
``supervisor_pid`` / ``supervisor_start_time``, each child in ``processes[i]``. A process counts as
running only while its pid still has that start time, so a recycled pid is
never signalled and never blocks a new ``up``. A deployment whose supervisor
was SIGKILLed (an *orphan*: its workers and orchestrator still serve) is
found the same way, from its run directory.

``up`` refuses (rather than start beside it, and later delete its key and
state) when the run directory has a live owner or when any port the config
fixes is taken.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.process_identity import process_start_time, same_process
from common.processes import terminate

if TYPE_CHECKING:
    from disagg.deploy_config import DeployConfig
    from disagg.run_state import LocalRunState

__all__ = ["RecordedProcess", "recorded_processes", "live_processes", "busy_ports", "stop_recorded"]


@dataclass(frozen=True)
class RecordedProcess:
    name: str
    pid: int
    start_time: int | None  # None: recorded by a disagg that did not record start times; never signalled

    def running(self) -> bool:
        """Certainly the recorded process: safe to signal."""
        return same_process(self.pid, self.start_time)

    def is_running(self, pid: int) -> bool:
        """``running`` as ``common.processes.terminate``'s ``alive``."""
        return same_process(pid, self.start_time)

    def may_be_running(self) -> bool:
        """Running, or a pid recorded without a start time that some process holds: enough to refuse
        an ``up`` over it, never enough to signal it."""
        return self.running() or (self.start_time is None and process_start_time(self.pid) is not None)


def recorded_processes(state: LocalRunState) -> list[RecordedProcess]:
    """The supervisor, then every child in start order (those started)."""
    supervisor = RecordedProcess("supervisor", state.supervisor_pid, state.supervisor_start_time)
    return [supervisor, *(RecordedProcess(p.name, p.pid, p.start_time) for p in state.processes if p.pid is not None)]


def live_processes(state: LocalRunState) -> list[RecordedProcess]:
    return [p for p in recorded_processes(state) if p.may_be_running()]


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # SO_REUSEADDR: a port in TIME_WAIT after a clean stop is free; a listener (ours use
        # SO_REUSEPORT, which a plain bind does not share) still makes bind fail.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def busy_ports(config: DeployConfig) -> list[str]:
    """``name host:port`` for every fixed port of the config that something already listens on."""
    wanted = []
    if config.orchestrator.port:
        wanted.append(("orchestrator", config.orchestrator.host, config.orchestrator.port))
    for role, pool in (("ctx", config.pools.ctx), ("gen", config.pools.gen)):
        if pool.base_port:
            wanted += [(f"{role}-{i}", pool.host, pool.base_port + i) for i in range(pool.instances)]
    return [f"{name} {host}:{port}" for name, host, port in wanted if _port_taken(host, port)]


def stop_recorded(processes: list[RecordedProcess], timeout: float) -> list[str]:
    """SIGTERM each process that is still the one recorded (one after the other, in the order
    given), SIGKILL it after ``timeout``; the names of those stopped. A recycled pid is left alone."""
    stopped = []
    for process in processes:
        if process.running():
            terminate([process.pid], timeout, alive=process.is_running)
            stopped.append(process.name)
    return stopped
