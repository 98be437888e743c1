"""``disagg orchestrator --config FILE``: K_o HTTP processes on one port, process 0 owning the state.

Process 0 (the command itself) binds the port first (SO_REUSEPORT; a port of
0 becomes a real one, passed on), creates the state dir, exports a fresh
``PROMETHEUS_MULTIPROC_DIR`` (before prometheus_client is imported
anywhere), starts the state owner (Unix socket ``state.sock`` + the health
checker) and re-executes itself K_o-1 times with ``--process-index i
--port P``. Each process serves the same app on its own socket of the port
and writes ``ready-<i>`` in the state dir once it accepts connections and
holds the owner's first state snapshot;
process 0 prints ``READY_MESSAGE URL`` when all have. Process 0 respawns a
non-zero process that dies and releases its in-flight counts
(``orchestrator.process_group``). SIGTERM/SIGINT on process 0 drains every
process at once (stop accepting, finish in-flight requests within
``grace_seconds``), then stops the state owner and removes the runtime files;
an extra process whose parent is gone exits at once. If process 0 itself
dies, the others exit too (the state owner is gone) and `disagg up`'s
supervisor restarts the whole orchestrator.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports this module to add its arguments: keep that import light
    from orchestrator.config import OrchestratorConfig
    from orchestrator.state import StateOwner

__all__ = ["add_orchestrator_arguments", "run_orchestrator", "READY_MESSAGE"]

log = logging.getLogger("disagg.orchestrator")

READY_MESSAGE = "disagg orchestrator: ready on"
START_TIMEOUT_SECONDS = 60.0
CHILD_STOP_MARGIN_SECONDS = 10.0  # past the grace period: lifespan shutdown, closing clients
OWNER_STOP_SECONDS = 10.0  # the state server drains its (answered at once) long polls within this
GC_YOUNG_THRESHOLD = 10_000  # allocations between young collections (Python's default: 700)


def add_orchestrator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="orchestrator config (JSON or YAML), see orchestrator.config")
    parser.add_argument("--port", type=int, default=None, help="override the config's port")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                        help="one INFO line per HTTP request (default: the config's access_log, off)")
    parser.add_argument("--process-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


@dataclasses.dataclass(frozen=True)
class OrchestratorSettings:
    """``disagg orchestrator``'s flags, typed, built once from the parsed arguments."""

    config: str
    port: int | None
    access_log: bool | None
    process_index: int
    parent_pid: int | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OrchestratorSettings:
        return cls(config=args.config, port=args.port, access_log=args.access_log, process_index=args.process_index,
                   parent_pid=args.parent_pid)

    def child_overrides(self) -> list[str]:
        """The command-line overrides process 0 passes on to the other processes."""
        return [] if self.access_log is None else ["--access-log" if self.access_log else "--no-access-log"]


def run_orchestrator(parsed: argparse.Namespace) -> int:
    from frontends.server import make_listen_socket, run_event_loop
    from orchestrator.config import check_worker_key_file, load_orchestrator_config
    from orchestrator.request_end import not_a_client_request
    from workers.log_format import configure_logging

    args = OrchestratorSettings.from_args(parsed)

    config = load_orchestrator_config(args.config)
    check_worker_key_file(config, args.config)
    config = dataclasses.replace(config, access_log=_access_log(args, config))  # the flag over the file
    configure_logging(config.log_level, config.log_format, "orchestrator")
    logging.getLogger("uvicorn.access").addFilter(not_a_client_request)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per worker poll otherwise
    state_dir = Path(config.state_dir)
    port = config.port if args.port is None else args.port
    if args.process_index == 0:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        prom_dir = state_dir / "prometheus"
        shutil.rmtree(prom_dir, ignore_errors=True)
        prom_dir.mkdir()
        for stale in state_dir.glob("ready-*"):
            stale.unlink()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)
    sock = make_listen_socket(config.host, port)
    port = sock.getsockname()[1]
    return run_event_loop(_serve(config, args, sock, port))


async def _serve(config: OrchestratorConfig, args: OrchestratorSettings, sock: socket.socket, port: int) -> int:
    import uvicorn

    from frontends.server import FrontendServer
    from frontends.tokenizer import Tokenizer
    from frontends.header_limit import h11_head_limit
    from orchestrator.app import Orchestrator, build_app
    from orchestrator.fast_http import fast_http_protocol
    from workers.log_format import stdout_line

    index = args.process_index
    orch = Orchestrator(config, index, Tokenizer.from_model_path(config.model_dir))
    # Drains at least as long as the workers do: `disagg down` stops the orchestrator first.
    server = FrontendServer(uvicorn.Config(
        build_app(orch), log_level=config.log_level, access_log=config.access_log,
        log_config=None,  # uvicorn's lines (the access log too) through the root logger: stderr, our format
        lifespan="on",
        timeout_graceful_shutdown=config.grace_seconds,  # type: ignore[arg-type]  # stub says int; wait_for takes float
        http=fast_http_protocol(orch), **h11_head_limit()))  # the generation routes skip ASGI
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    owner_task = group = group_watch = batches = openai_batches = parent_watch = targets = None
    if index == 0:
        from frontends.batches import batch_routes
        from frontends.batches.openai_routes import openai_batch_routes
        from orchestrator.batches import open_batch_runner
        from orchestrator.openai_batches import open_openai_batches
        from orchestrator.process_group import ProcessGroup
        from orchestrator.state import StateOwner
        from workers.restart_budget import RestartBudget

        batches = open_batch_runner(orch)  # the stores are process 0's: opened before anything is served
        await batches.start()
        openai_batches = open_openai_batches(orch)
        await openai_batches.start()
        targets = _prometheus_targets(config, port)
        owner = StateOwner(config, targets.update if targets is not None else None)
        owner_stop = asyncio.Event()
        owner_task = asyncio.create_task(_run_owner(
            config, owner, owner_stop,
            [*batch_routes(batches), *openai_batch_routes(openai_batches, config.max_upload_bytes)]))
        group = ProcessGroup(args.config, port, range(1, config.processes),
                             lambda: RestartBudget(config.max_process_restarts, config.process_restart_window_seconds),
                             on_exit=lambda i: _process_exited(owner, group, i),
                             extra_argv=args.child_overrides())
    else:
        # Held, and cancelled at exit: the loop keeps only a weak reference to a task.
        parent_watch = asyncio.create_task(_watch_parent(args.parent_pid, stopping))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)  # uvicorn has no "started" event
        # Ready = serving and holding the owner's state (else it would answer 503s for a moment).
        await asyncio.wait_for(orch.link.first_snapshot.wait(), START_TIMEOUT_SECONDS)
        _settle_gc()
        (Path(config.state_dir) / f"ready-{index}").touch()
        if group is not None:
            await _wait_ready(config, group.children)
            group_watch = asyncio.create_task(group.watch())
            print(stdout_line(f"{READY_MESSAGE} http://{config.host}:{port} ({config.processes} processes)",
                              config.log_format, "orchestrator"), flush=True)
        await asyncio.wait([serving, asyncio.create_task(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if parent_watch is not None:
            parent_watch.cancel()
        if group_watch is not None:
            group_watch.cancel()
        if batches is not None:  # first: its requests stay pending, not failed by the flow closing under them
            await batches.close()
        if openai_batches is not None:
            await openai_batches.close()
        # Every process drains at once (stop accepting, finish in-flight, exit); the state owner
        # stays up until the others are gone, since they still push their loads to it.
        stopping_children = (asyncio.create_task(group.stop(config.grace_seconds + CHILD_STOP_MARGIN_SECONDS))
                             if group is not None else None)
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        if stopping_children is not None:
            await stopping_children
        if owner_task is not None:
            owner_stop.set()
            try:
                await asyncio.wait_for(owner_task, OWNER_STOP_SECONDS)
            except Exception:  # a failed or slow owner must not stop the cleanup
                log.warning("the state owner did not stop cleanly", exc_info=True)
            shutil.rmtree(Path(config.state_dir) / "prometheus", ignore_errors=True)
            if targets is not None:
                targets.clear()  # a Prometheus that outlives the deployment stops scraping it
            for path in Path(config.state_dir).glob("ready-*"):
                path.unlink(missing_ok=True)
        sock.close()
    return 0


def _process_exited(owner: Any, group: Any, index: int) -> None:
    """Process ``index`` died: its in-flight counts are released and its live metric series dropped."""
    from prometheus_client import multiprocess

    owner.set_loads(index, {})
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        multiprocess.mark_process_dead(group.children[index].pid, path)


def _settle_gc() -> None:
    """Once started: what is alive now (tokenizer, templates, routes: ~80k objects) lives as long as
    the process, so the cyclic collector stops walking it (``gc.freeze``), and collects the young
    generation every ``GC_YOUNG_THRESHOLD`` allocations instead of 700. Each request leaves a few
    reference cycles (asyncio futures and frames); full collections over the whole heap were 8% of
    a streamed request's CPU (perf), all collections 50 µs a request; 12 µs after this."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _access_log(args: OrchestratorSettings, config: OrchestratorConfig) -> bool:
    return config.access_log if args.access_log is None else args.access_log


def _prometheus_targets(config: OrchestratorConfig, port: int):
    """The file_sd target files process 0 keeps (None unless ``prometheus_targets_dir`` is set)."""
    if config.prometheus_targets_dir is None:
        return None
    from orchestrator.prometheus_sd import TargetFiles

    return TargetFiles(config.prometheus_targets_dir, config.host, port)


async def _run_owner(config: OrchestratorConfig, owner: StateOwner, stop: asyncio.Event, extra_routes: list) -> None:
    """Process 0's state owner: the Unix-socket state app (plus ``extra_routes``: the batch routes)
    and the health checker, until ``stop``."""
    import httpx
    import uvicorn

    from frontends.server import FrontendServer
    from orchestrator.app import worker_key_headers
    from orchestrator.health import HealthChecker
    from orchestrator.perf import PerfJoiner
    from orchestrator.state import state_app

    path = Path(config.state_socket)
    path.unlink(missing_ok=True)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(path))
    os.chmod(path, 0o600)
    unix.listen(1024)
    client = httpx.AsyncClient(timeout=config.health.timeout_seconds, headers=worker_key_headers(config))
    # uvicorn.Config sets the (process-global) uvicorn loggers up in its __init__: none given here,
    # so the client server's log level and access log stand; this server logs no access line.
    owner_config = uvicorn.Config(state_app(owner, PerfJoiner(client, config.health.timeout_seconds), extra_routes),
                                  log_level=None, log_config=None, lifespan="off")
    owner_config.access_log = False
    server = FrontendServer(owner_config)
    checker = asyncio.create_task(HealthChecker(owner, client).run())
    serving = asyncio.create_task(server.serve(sockets=[unix]))
    try:
        await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    finally:
        owner.close()  # long polls answer now: the server stops with no request to cancel
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        checker.cancel()
        await asyncio.gather(checker, return_exceptions=True)
        await client.aclose()
        unix.close()
        path.unlink(missing_ok=True)


async def _wait_ready(config: OrchestratorConfig, children: dict[int, subprocess.Popen]) -> None:
    """``children``: the processes by index (ProcessGroup.children)."""
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    ready = [Path(config.state_dir) / f"ready-{i}" for i in range(config.processes)]
    while not all(path.exists() for path in ready):
        dead = [index for index, child in children.items() if child.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"orchestrator processes did not start (exited: {dead})")
        await asyncio.sleep(0.05)


async def _watch_parent(parent_pid: int | None, stopping: asyncio.Event) -> None:
    from workers.processes import pid_alive

    while parent_pid is None or pid_alive(parent_pid):
        await asyncio.sleep(0.5)
    log.error("orchestrator process 0 (pid %s) is gone; exiting", parent_pid)
    stopping.set()
