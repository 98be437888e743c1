"""Which serving process owns the shared state: elected by a lock, handed over when it dies.

The K_o serving processes are alike; one of them, the *leader*, runs the
state owner (``orchestrator.state``: registry, health checks, KV index,
loads, live settings, perf) on ``<state_dir>/state.sock``, the Message
Batches runner (``orchestrator.batches``), the OpenAI Files and Batches
(``orchestrator.openai_batches``) and the Prometheus target files.
Every process, the leader included, follows the owner's snapshots through
its ``StateLink``, so each holds a copy of the registry at most one long
poll old.

Election: every process tries ``flock(LOCK_EX | LOCK_NB)`` on
``<state_dir>/leader.lock`` every ``ELECT_SECONDS``. The kernel releases the
lock of a process that dies however it dies (SIGKILL included), so the next
try of another process wins it: no heartbeat, no timeout to tune, no
split brain (a lock held is a leader alive, on this one host).

Hand-over: the new leader seeds its owner from its own copy (the workers
with their health, block sizes, drains, and the KV index; every registered
worker gets a fresh TTL, since heartbeats are not published), takes the live
settings it already applies, and starts with a new ``epoch``. It binds the
socket under a temporary name and renames it over ``state.sock``, so a
follower connects to the new owner or gets refused, never half of each. A
follower that sees another epoch takes the whole snapshot and pushes its
loads again; the dead leader's own loads die with it. The batch stores are on
disk, their locks died with the old leader: the new one opens them and their
runners take up the requests left pending. Lost at a hand-over: the perf
records not yet joined (``GET /perf_metrics``), KV events drained but not yet
published (each worker's index is resynchronised from its snapshot).

In-flight streams never touch the state owner: a leader's death cuts only
its own streams; the others go on, and new requests route on the last
snapshot meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from orchestrator.app import Orchestrator
    from orchestrator.state import StateOwner

__all__ = ["Leadership", "ELECT_SECONDS", "LOCK_FILE", "read_leader"]

log = logging.getLogger("disagg.orchestrator")

LOCK_FILE = "leader.lock"
ELECT_SECONDS = 0.05
"""How often a follower tries the lock: the longest a dead leader goes unreplaced (plus a start)."""
SWEEP_SECONDS = 0.5
"""How often the leader drops the loads of processes that died (their counts would never fall)."""
OWNER_STOP_SECONDS = 10.0


class Leadership:
    def __init__(self, orch: Orchestrator, port: int) -> None:
        self.orch = orch
        self.port = port
        self.state_dir = Path(orch.config.state_dir)
        self.leading = asyncio.Event()
        self.owner: StateOwner | None = None
        self._fd: int | None = None
        self._contending = True
        self._stop = asyncio.Event()
        self._batches: Any = None
        self._openai_batches: Any = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop_contending(self) -> None:
        """Shutting down: a process that drains does not take the lead (it would only hand it over again)."""
        self._contending = False

    async def close_batches(self) -> None:
        """First at shutdown: the batch requests stay pending (taken up again), not failed by the flow closing."""
        if self._batches is not None:
            await self._batches.close()
            self._batches = None
        if self._openai_batches is not None:
            await self._openai_batches.close()
            self._openai_batches = None

    async def close(self) -> None:
        """Last at shutdown: the owner stops (its long polls answer first), the lock goes."""
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, OWNER_STOP_SECONDS)
            except Exception:  # a failed or slow owner must not stop the cleanup
                log.warning("the state owner did not stop cleanly", exc_info=True)
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def _try_lock(self) -> bool:
        if self._fd is None:
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    async def _run(self) -> None:
        while not self._try_lock():
            if not self._contending or self._stop.is_set():
                return
            await asyncio.sleep(ELECT_SECONDS)
        if not self._contending or self._stop.is_set():
            assert self._fd is not None
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # won while stopping: a process staying on takes it
            return
        await self._lead()

    async def _lead(self) -> None:
        from api.batches import batch_routes
        from api.batches.openai_routes import openai_batch_routes
        from orchestrator.batches import open_batch_runner
        from orchestrator.openai_batches import open_openai_batches
        from orchestrator.state import StateOwner

        orch = self.orch
        began = time.monotonic()
        assert self._fd is not None
        # Who leads, for people and tools (the lock is what counts): "<process index> <pid>".
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{orch.process_index} {os.getpid()}\n".encode(), 0)
        took_over = orch.view.version >= 0  # this process followed an owner before: it died
        targets = _prometheus_targets(orch.config, self.port)
        owner = StateOwner(orch.config, targets.update if targets is not None else None, epoch=time.time_ns(),
                           seed=orch.view if took_over else None)
        self.owner = owner
        self._batches = open_batch_runner(orch)
        await self._batches.start()
        self._openai_batches = open_openai_batches(orch)
        await self._openai_batches.start()
        if took_over:
            log.warning("orchestrator process %d took over the shared state (the leader died; %d workers "
                        "carried over, %.0f ms)", orch.process_index, len(owner.registry.workers),
                        (time.monotonic() - began) * 1000)
        else:
            log.info("orchestrator process %d leads the shared state", orch.process_index)
        self.leading.set()
        routes = [*batch_routes(self._batches),
                  *openai_batch_routes(self._openai_batches, orch.config.max_upload_bytes)]
        await _run_owner(orch.config, owner, self._stop, routes)


def read_leader(state_dir: str | Path) -> tuple[int, int] | None:
    """(process index, pid) of the process that last took the lead (it may have died since)."""
    try:
        index, pid = (Path(state_dir) / LOCK_FILE).read_text().split()
        return int(index), int(pid)
    except (OSError, ValueError):
        return None


def _prometheus_targets(config: Any, port: int) -> Any:
    """The file_sd target files the leader keeps (None unless ``prometheus_targets_dir`` is set)."""
    if config.prometheus_targets_dir is None:
        return None
    from orchestrator.prometheus_sd import TargetFiles

    return TargetFiles(config.prometheus_targets_dir, config.host, port)


def _bind_state_socket(path: Path) -> socket.socket:
    """Listening on ``path``: bound under a private name, then renamed over it at once (atomic), so a
    follower reaches the old owner or the new one, never no file."""
    # No longer than the socket's own name: a Unix socket's path has at most 107 bytes, and a run
    # directory deep in a temporary tree comes near that (".state.sock.<pid>" went over).
    tmp = path.with_name(f".{os.getpid():x}"[:len(path.name)])
    tmp.unlink(missing_ok=True)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(tmp))
    os.chmod(tmp, 0o600)
    unix.listen(1024)
    tmp.replace(path)
    return unix


async def _run_owner(config: Any, owner: StateOwner, stop: asyncio.Event, extra_routes: Sequence[BaseRoute]) -> None:
    """The state owner: the Unix-socket state app (plus ``extra_routes``: the batch routes), the
    health checker and the loads sweep, until ``stop``."""
    import httpx
    import uvicorn

    from api.server import QuietServer
    from orchestrator.app import worker_key_headers
    from orchestrator.health import HealthChecker
    from orchestrator.http_client import HttpClient
    from orchestrator.perf import PerfJoiner
    from orchestrator.state import state_app

    path = Path(config.state_socket)
    unix = _bind_state_socket(path)
    inode = os.stat(path).st_ino
    client = httpx.AsyncClient(timeout=config.health.timeout_seconds, headers=worker_key_headers(config))
    # uvicorn.Config sets the (process-global) uvicorn loggers up in its __init__: none given here,
    # so the client server's log level and access log stand; this server logs no access line.
    owner_config = uvicorn.Config(state_app(owner, PerfJoiner(client, config.health.timeout_seconds), extra_routes),
                                  log_level=None, log_config=None, lifespan="off")
    owner_config.access_log = False
    server = QuietServer(owner_config)
    timeout = config.health.timeout_seconds
    checks = HttpClient(connect_timeout=timeout, idle_timeout=timeout, headers=worker_key_headers(config))
    checker = asyncio.create_task(HealthChecker(owner, checks).run())
    sweeper = asyncio.create_task(_sweep_loads(owner))
    serving = asyncio.create_task(server.serve(sockets=[unix]))
    try:
        await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    finally:
        owner.close()  # long polls answer now: the server stops with no request to cancel
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        for task in (checker, sweeper):
            task.cancel()
        await asyncio.gather(checker, sweeper, return_exceptions=True)
        await client.aclose()
        checks.close()
        unix.close()
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:  # still ours (not a successor's)
                path.unlink()


async def _sweep_loads(owner: StateOwner) -> None:
    while True:
        await asyncio.sleep(SWEEP_SECONDS)
        owner.drop_dead_loads()
