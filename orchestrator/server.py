"""``disagg orchestrator --config FILE``: a keeper and K_o serving processes on one port.

The command itself is the keeper (``orchestrator.keeper``): it takes the
port, starts processes 0..K_o-1 (this module again, with ``--process-index
i --port P``), respawns any that dies, and drains them all on SIGTERM. The
serving processes are alike: each serves the same app on its own socket of
the port (SO_REUSEPORT), follows the shared state through its ``StateLink``
and writes ``ready-<i>`` in the state dir once it accepts connections and
holds the owner's first snapshot. One of them, elected by a lock, also owns
the shared state (``orchestrator.leadership``); when it dies another takes it
over, and the others' streams go on.

A serving process told to stop (SIGTERM/SIGINT) stops accepting, finishes its
in-flight requests within ``grace_seconds``, then closes what is left; it
exits within ``grace_seconds + EXIT_MARGIN_SECONDS`` whatever happens (a
watchdog thread ends it past that). A process whose keeper is gone serves on
(a restarted keeper adopts it) and drains after ``ORPHAN_SECONDS`` with none.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.keeper import READY_MESSAGE

if TYPE_CHECKING:  # the CLI imports this module to add its arguments: keep that import light
    from orchestrator.config import OrchestratorConfig

__all__ = ["add_orchestrator_arguments", "run_orchestrator", "READY_MESSAGE"]

log = logging.getLogger("disagg.orchestrator")

START_TIMEOUT_SECONDS = 60.0
EXIT_MARGIN_SECONDS = 5.0
"""Past the grace period: closing clients and the state owner; then the process ends regardless."""
KEEPER_WATCH_SECONDS = 0.5
GC_YOUNG_THRESHOLD = 10_000  # allocations between young collections (Python's default: 700)


def add_orchestrator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="orchestrator config (JSON or YAML), see orchestrator.config")
    parser.add_argument("--port", type=int, default=None, help="override the config's port")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                        help="one INFO line per HTTP request (default: the config's access_log, off)")
    parser.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)


@dataclasses.dataclass(frozen=True)
class OrchestratorFlags:
    """``disagg orchestrator``'s flags, typed, built once from the parsed arguments."""

    config: str
    port: int | None
    access_log: bool | None
    process_index: int | None
    """None: the keeper."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OrchestratorFlags:
        return cls(config=args.config, port=args.port, access_log=args.access_log, process_index=args.process_index)

    def child_overrides(self) -> list[str]:
        """The command-line overrides the keeper passes on to the serving processes."""
        return [] if self.access_log is None else ["--access-log" if self.access_log else "--no-access-log"]


def run_orchestrator(parsed: argparse.Namespace) -> int:
    from api.server import make_listen_socket, run_event_loop
    from common.log_format import configure_logging
    from orchestrator.config import check_worker_key_file, load_orchestrator_config
    from orchestrator.request_end import not_a_client_request

    args = OrchestratorFlags.from_args(parsed)

    config = load_orchestrator_config(args.config)
    check_worker_key_file(config, args.config)
    config = dataclasses.replace(config, access_log=_access_log(args, config))  # the flag over the file
    configure_logging(config.log_level, config.log_format, "orchestrator")
    logging.getLogger("uvicorn.access").addFilter(not_a_client_request)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per worker poll otherwise
    port = config.port if args.port is None else args.port
    if args.process_index is None:
        from orchestrator.keeper import run_keeper

        return run_keeper(config, args.config, port, args.child_overrides())
    sock = make_listen_socket(config.host, port)
    port = sock.getsockname()[1]
    return run_event_loop(_serve(config, args, sock, port))


async def _serve(config: OrchestratorConfig, args: OrchestratorFlags, sock: socket.socket, port: int) -> int:
    import uvicorn

    from api.header_limit import h11_head_limit
    from api.server import QuietServer
    from api.tokenizer import Tokenizer
    from orchestrator.app import Orchestrator, build_app
    from orchestrator.fast_http import fast_http_protocol
    from orchestrator.leadership import Leadership

    index = args.process_index
    assert index is not None  # the keeper never serves
    orch = Orchestrator(config, index, Tokenizer.from_model_path(config.model_dir))
    # Drains at least as long as the workers do: `disagg down` stops the orchestrator first.
    server = QuietServer(uvicorn.Config(
        build_app(orch), log_level=config.log_level, access_log=config.access_log,
        log_config=None,  # uvicorn's lines (the access log too) through the root logger: stderr, our format
        lifespan="on",
        timeout_graceful_shutdown=config.grace_seconds,  # type: ignore[arg-type]  # stub says int; wait_for takes float
        http=fast_http_protocol(orch), **h11_head_limit()))  # the generation routes skip ASGI
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    leadership = Leadership(orch, port)
    leadership.start()
    # Held, and cancelled at exit: the loop keeps only a weak reference to a task.
    keeper_watch = asyncio.create_task(_watch_keeper(config.state_dir, stopping))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)  # uvicorn has no "started" event
        # Ready = serving and holding the owner's state (else it would answer 503s for a moment).
        await asyncio.wait_for(orch.link.first_snapshot.wait(), START_TIMEOUT_SECONDS)
        _settle_gc()
        (Path(config.state_dir) / f"ready-{index}").touch()
        await asyncio.wait([serving, asyncio.create_task(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
    finally:
        _exit_deadline(config.grace_seconds + EXIT_MARGIN_SECONDS)
        keeper_watch.cancel()
        leadership.stop_contending()
        await leadership.close_batches()  # first: its requests stay pending, not failed by the flow closing
        # Drain: stop accepting, finish in-flight requests within grace_seconds, close the rest. The
        # state owner (if this process leads) stays up meanwhile: the others still follow it.
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        await leadership.close()
        (Path(config.state_dir) / f"ready-{index}").unlink(missing_ok=True)
        sock.close()
    return 0


def _exit_deadline(seconds: float) -> None:
    """End the process ``seconds`` from now unless it has ended: a thread, so that a shutdown step
    that never returns (an await on the event loop) cannot keep it alive."""

    def expire() -> None:
        log.error("orchestrator process did not exit within %g s of being told to stop; ending it", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


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


def _access_log(args: OrchestratorFlags, config: OrchestratorConfig) -> bool:
    return config.access_log if args.access_log is None else args.access_log


async def _watch_keeper(state_dir: str, stopping: asyncio.Event) -> None:
    """Serve on while a keeper runs (a restarted one adopts this process); drain once none has for
    ``ORPHAN_SECONDS``: with nobody to respawn or stop it, it must not serve for ever."""
    from orchestrator.process_records import ORPHAN_SECONDS, keeper_alive

    alone_since: float | None = None
    while True:
        await asyncio.sleep(KEEPER_WATCH_SECONDS)
        if keeper_alive(state_dir):
            alone_since = None
        elif alone_since is None:
            alone_since = time.monotonic()
            log.warning("the orchestrator's keeper is gone; serving on for up to %g s for a new one", ORPHAN_SECONDS)
        elif time.monotonic() - alone_since > ORPHAN_SECONDS:
            log.error("no keeper for %g s; draining and exiting", ORPHAN_SECONDS)
            stopping.set()
            return
