"""Runs one frontend process of a worker: its engine client and its uvicorn server.

Shutdown (SIGTERM/SIGINT, a dead engine, or, for an attached frontend, a
launcher that disappeared): stop accepting, let in-flight requests finish
within ``grace_seconds``, close the engine client. uvicorn's own signal
handlers are off (``api.server.QuietServer``): they re-raise the signal after
serving, which would kill the launcher before it stops the engine and removes
the IPC directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from api.header_limit import h11_head_limit, http_protocol
from api.server import QuietServer, make_listen_socket, make_unix_listen_socket, settle_gc
from common.processes import pid_alive
from frontends.engine_client import EngineClient
from frontends.watchdog import Watchdog, frontend_probes
from workers.attach import AttachInfo

__all__ = ["ServeOptions", "serve_frontend"]

WATCH_SECONDS = 0.5


@dataclass(frozen=True)
class ServeOptions:
    grace_seconds: float = 30.0
    log_level: str = "info"
    access_log: bool = False
    dead_engine_linger_seconds: float = 1.0  # /health says 503 this long before a frontend drains and exits


async def serve_frontend(
    attach: AttachInfo,
    make_app: Callable[[EngineClient], Any],
    options: ServeOptions,
    *,
    on_ready: Callable[[], Awaitable[None]],
    on_signal: Callable[[int], None] | None = None,
) -> int:
    """Serve until told to stop; 0 after a requested shutdown, 1 when the engine died.

    ``on_ready`` runs once the server accepts connections (an exception from it
    stops the server and propagates); ``on_signal`` runs on SIGTERM/SIGINT
    before the drain starts (the launcher forwards the signal to its frontends).
    """
    client = EngineClient(attach)
    await client.start()
    sockets = [make_listen_socket(attach.host, attach.port)]
    admin_path = str(attach.paths.launcher_admin) if attach.frontend_id == 0 else None
    if admin_path is not None:  # the launcher also answers its attached frontends' forwarded routes
        sockets.append(make_unix_listen_socket(admin_path))
    config = uvicorn.Config(
        make_app(client), log_level=options.log_level, access_log=options.access_log,
        log_config=None,  # uvicorn's lines (the access log too) through the root logger: stderr, our format
        timeout_graceful_shutdown=options.grace_seconds,  # type: ignore[arg-type]  # stub says int; wait_for takes float
        http=http_protocol(), lifespan="auto", **h11_head_limit(),
    )
    server = QuietServer(config)
    settle_gc()
    exit_code = 0
    loop = asyncio.get_running_loop()

    def stop(sig: int) -> None:
        if on_signal is not None:
            on_signal(sig)
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)

    def on_fatal(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        if reason.startswith("launcher"):  # the worker is gone: nothing left to drain for
            server.should_exit = server.force_exit = True
        else:  # answer 503 on /health a moment (load balancers see why), then drain and exit
            loop.call_later(options.dead_engine_linger_seconds, setattr, server, "should_exit", True)

    launcher_pid = attach.launcher_pid if attach.frontend_id != 0 else None
    watchdog = Watchdog(frontend_probes(client, launcher_pid, pid_alive), on_fatal,
                        lambda: bool(server.should_exit), interval=WATCH_SECONDS)
    watchers = [asyncio.create_task(watchdog.run(), name="frontend-watchdog")]
    serving = asyncio.create_task(server.serve(sockets=sockets))
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)  # uvicorn has no "started" event to await
        if server.started:
            await on_ready()
        await serving
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        for task in watchers:
            task.cancel()
        await client.close()
        for sock in sockets:
            sock.close()
        if admin_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(admin_path)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return exit_code
