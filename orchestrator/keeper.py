"""The keeper: ``disagg orchestrator`` itself, which runs the K_o serving processes and nothing else.

It serves no request and holds no state, so its death cuts nothing. It:

1. takes the port (bound, never listening: a port of 0 becomes a real one,
   and the port stays ours while the serving processes come and go),
2. records itself (``orchestrator.process_records``), exports a fresh
   ``PROMETHEUS_MULTIPROC_DIR``, and starts processes 0..K_o-1
   (``--process-index i --port P``); a keeper started while an earlier
   keeper's processes still run *adopts* them (same port, same metrics
   directory) and starts only the missing ones;
3. prints ``READY_MESSAGE URL`` once every process wrote ``ready-<i>`` (it
   serves and holds the state owner's first snapshot);
4. respawns a process that dies (``orchestrator.process_group``);
5. on SIGTERM/SIGINT drains every process at once (each finishes its
   in-flight requests within ``grace_seconds``, then exits within its own
   hard deadline; SIGKILL past ``grace_seconds + CHILD_STOP_MARGIN_SECONDS``)
   and removes the runtime files.

Which process owns the shared state is theirs to settle (``orchestrator.leadership``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.config import OrchestratorConfig
    from orchestrator.process_group import Member, ProcessGroup

__all__ = ["run_keeper", "READY_MESSAGE", "CHILD_STOP_MARGIN_SECONDS"]

log = logging.getLogger("disagg.orchestrator")

READY_MESSAGE = "disagg orchestrator: ready on"
START_TIMEOUT_SECONDS = 60.0
CHILD_STOP_MARGIN_SECONDS = 10.0
"""Past the grace period: a process's own exit deadline (``orchestrator.server``) comes first."""


def _reserve_port(host: str, port: int) -> socket.socket:
    """Bound with SO_REUSEPORT but not listening: it holds the port and takes no connection."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_keeper(config: OrchestratorConfig, config_path: str, port: int, extra_argv: list[str]) -> int:
    from api.server import run_event_loop
    from orchestrator.process_records import read_keeper, read_records, write_keeper

    state_dir = Path(config.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    earlier = read_keeper(state_dir)
    if earlier is not None and earlier.running():
        log.error("another orchestrator (pid %d) keeps %s; not starting a second one", earlier.pid, state_dir)
        return 1
    adopting = earlier is not None and any(r.running() for r in read_records(state_dir).values())
    prom_dir = state_dir / "prometheus"
    if earlier is not None and adopting:
        port = earlier.port  # they serve there already
        log.warning("orchestrator processes of an earlier keeper still run: adopting them on port %d", port)
    else:
        shutil.rmtree(prom_dir, ignore_errors=True)
        prom_dir.mkdir()
        for stale in state_dir.glob("ready-*"):
            stale.unlink()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)  # inherited by every process
    sock = _reserve_port(config.host, port)
    port = sock.getsockname()[1]
    write_keeper(state_dir, port)
    try:
        return run_event_loop(_keep(config, config_path, port, extra_argv))
    finally:
        sock.close()


async def _keep(config: OrchestratorConfig, config_path: str, port: int, extra_argv: list[str]) -> int:
    from common.log_format import stdout_line
    from common.restart_budget import RestartBudget
    from orchestrator.process_group import ProcessGroup

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    state_dir = Path(config.state_dir)
    group = ProcessGroup(config_path, str(state_dir), port, config.processes,
                         lambda: RestartBudget(config.max_process_restarts, config.process_restart_window_seconds),
                         on_exit=lambda member: _process_exited(state_dir, member), extra_argv=extra_argv)
    watch = None
    try:
        ready = asyncio.create_task(_wait_ready(state_dir, group))
        await asyncio.wait([ready, asyncio.create_task(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()  # raises: they did not start
            watch = asyncio.create_task(group.watch())
            print(stdout_line(f"{READY_MESSAGE} http://{config.host}:{port} ({config.processes} processes)",
                              config.log_format, "orchestrator"), flush=True)
            await stopping.wait()
        else:
            ready.cancel()
    finally:
        if watch is not None:
            watch.cancel()
        await group.stop(config.grace_seconds + CHILD_STOP_MARGIN_SECONDS)
        _remove_runtime_files(config, port)
    return 0


def _process_exited(state_dir: Path, member: Member) -> None:
    """Process ``member`` died: its live metric series go, its readiness with it."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(member.pid, os.environ["PROMETHEUS_MULTIPROC_DIR"])  # type: ignore[no-untyped-call]
    (state_dir / f"ready-{member.index}").unlink(missing_ok=True)


def _remove_runtime_files(config: OrchestratorConfig, port: int) -> None:
    from orchestrator.process_records import KEEPER_FILE

    state_dir = Path(config.state_dir)
    shutil.rmtree(state_dir / "prometheus", ignore_errors=True)
    if config.prometheus_targets_dir is not None:
        from orchestrator.prometheus_sd import TargetFiles

        TargetFiles(config.prometheus_targets_dir, config.host, port).clear()  # a Prometheus that outlives it stops scraping
    for path in state_dir.glob("ready-*"):
        path.unlink(missing_ok=True)
    (state_dir / KEEPER_FILE).unlink(missing_ok=True)


async def _wait_ready(state_dir: Path, group: ProcessGroup) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    ready = [state_dir / f"ready-{i}" for i in group.members]
    while not all(path.exists() for path in ready):
        dead = group.exited()
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"orchestrator processes did not start (exited: {dead})")
        await asyncio.sleep(0.05)
