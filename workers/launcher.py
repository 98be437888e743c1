"""Process supervision of one worker: the engine and the attached frontends.

``WorkerGroup`` is what the launcher (frontend 0) owns besides its own HTTP
server: the private IPC directory and HMAC key, the engine process, the K-1
attached frontends (the same command line re-executed with an attach file),
their readiness, and the one shutdown path. It never imports ``frontends``:
the frontend side is handed the attach info and reports on status.sock.

A tensor-parallel engine (``tensor_parallel_size`` > 1) is rank 0 plus
followers that the group spawns too, unless an ``srun`` step started them
(``rank_group.plan_ranks``); a follower that exits during the start fails it.

Shutdown order (``shutdown``): attached frontends get SIGTERM and drain within
the grace period (SIGKILL after it), then the engine is told to stop (control
message, SIGTERM, SIGKILL, each after a wait), then the followers (SIGTERM,
SIGKILL), then the directory with the
sockets and attach files is removed. Every path, including a failed start,
goes through it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO

import msgspec
import zmq

from common.processes import stop_process
from common.restart_budget import RestartBudget
from workers.attach import ATTACH_FILE_ENV, AttachInfo, write_attach_file
from workers.config import ConfigError, EngineConfig
from workers.engine_proc import EngineProcSpec
from workers.frontends_down import FrontendsDown, write_frontends_down
from workers.ipc import ENGINE_WEDGED_SECONDS, LANE_SNDHWM, FrameCodec, make_ipc_dir, new_key, write_private_file
from workers.ipc_dir_owners import record_owner, sweep_stale_ipc_dirs
from workers.kv_transfer import DisaggEngineSpec
from workers.protocol import (
    ControlReply,
    ControlRequest,
    EngineFailed,
    EngineInfo,
    EngineReady,
    FrontendFailed,
    FrontendReady,
    Shutdown,
    StatusMessage,
)
from workers.rank_env import RANK_VARS, RankEnv
from workers.rank_group import LocalFollowers, plan_ranks

__all__ = ["LaunchError", "check_port_free", "WorkerGroup", "RANK_ENV_VARS"]

log = logging.getLogger("disagg.launcher")

# An attached frontend is not an MPI/Slurm rank: left in its environment these
# would make it believe it is one (e.g. join a tensor-parallel group).
RANK_ENV_VARS = (
    "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "MPI_LOCALRANKID",
    *RANK_VARS,
)
_TAIL_LINES = 40
# A crashed attached frontend is respawned in its slot, unless it crashed this often
# recently: then it is left down (the others keep serving) and that is logged loudly.
RESPAWN_WINDOW_SECONDS = 60.0
MAX_CRASHES_IN_WINDOW = 3


class LaunchError(RuntimeError):
    """The worker could not start; the message says which part and why."""


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before anything loads, when ``host:port`` is taken.

    Bound without SO_REUSEPORT on purpose: a worker's frontends share their
    port with each other through SO_REUSEPORT, and this test makes sure a
    second worker group never joins an existing one.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "in use"
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"port {port} on {host} is already in use ({exc.strerror})") from None


class _Child:
    """A child process whose output is forwarded to our stderr; the last lines are kept."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._reader = threading.Thread(target=self._forward, args=(self.popen.stdout,), daemon=True,
                                        name=f"{name}-output")
        self._reader.start()

    def _forward(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace")
            self.tail.append(line)
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (ValueError, OSError):  # our stderr is gone; keep draining the pipe
                pass

    def describe_exit(self) -> str:
        self._reader.join(timeout=2)
        tail = "".join(self.tail).rstrip()
        return f"{self.name} (pid {self.popen.pid}) exited with code {self.popen.returncode}" + (
            f"; its last output:\n{tail}" if tail else "")

    def stop(self, sig: int, wait_seconds: float) -> None:
        """Send ``sig``, wait, then SIGKILL."""
        stop_process(self.popen, wait_seconds, sig, name=self.name)
        self._reader.join(timeout=2)


class WorkerGroup:
    """The launcher's children and private state. Use as a context manager."""

    def __init__(self, engine_config: EngineConfig, num_frontends: int, host: str, port: int,
                 *, grace_seconds: float = 30.0, lane_sndhwm: int = LANE_SNDHWM, log_level: str = "info",
                 log_format: str = "text", disagg: DisaggEngineSpec | None = None,
                 engine_wedged_seconds: float = ENGINE_WEDGED_SECONDS,
                 tensor_parallel_size: int = 1, rank_env: RankEnv | None = None) -> None:
        if num_frontends < 1:
            raise LaunchError(f"num_frontends must be >= 1, got {num_frontends}")
        self.engine_config = engine_config
        self.tensor_parallel_size = tensor_parallel_size
        self.rank_env = rank_env  # this launcher is rank 0 of ranks started externally (srun)
        self.followers: LocalFollowers | None = None
        self.disagg = disagg  # the engine's KV-transfer agent (role, cluster key); None: aggregated
        self.num_frontends = num_frontends
        self.host, self.port = host, port
        self.grace_seconds = grace_seconds
        self.engine_wedged_seconds = engine_wedged_seconds
        self.lane_sndhwm = lane_sndhwm
        self.log_level = log_level
        self.log_format = log_format  # common.log_format: the engine and its ranks log as the launcher does
        sweep_stale_ipc_dirs()  # those of workers whose processes were all killed before they could clean up
        self.paths = make_ipc_dir()
        record_owner(self.paths.dir, os.getpid())
        # Every process's Prometheus samples (``disagg serve`` exports it as PROMETHEUS_MULTIPROC_DIR).
        self.paths.prometheus_dir.mkdir(mode=0o700)
        self.key = new_key()
        self.engine: _Child | None = None
        self.engine_info: EngineInfo | None = None
        self.frontends: dict[int, _Child] = {}
        self._frontend_argv: list[str] = []
        self._generations: dict[int, int] = {}  # respawns per slot
        self._restart_budgets: dict[int, RestartBudget] = {}
        self.abandoned_frontends: set[int] = set()  # crashed too often: not respawned
        self.engine_failed = False  # the engine died or hung while serving: kill it, do not ask
        self._ready_frontends: set[int] = set()
        self._status_codec: FrameCodec = FrameCodec(self.key, StatusMessage, "launcher status")
        self._control_codec: FrameCodec = FrameCodec(self.key, ControlReply, "launcher control")
        self._ctx = zmq.Context()
        self._status = self._ctx.socket(zmq.PULL)
        self._status.setsockopt(zmq.LINGER, 0)
        self._status.bind(self.paths.status)
        self._closed = False
        self.stopping = False  # a stop was requested (signal): readiness waits end early

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- start -----------------------------------------------------------------

    def log_flags(self) -> list[str]:
        """The engine's and its ranks' ``--log-level`` and ``--log-format``."""
        return ["--log-level", self.log_level.upper(), "--log-format", self.log_format]

    def start_engine(self, timeout: float = 600.0) -> EngineInfo:
        cluster_key = bytes.fromhex(self.disagg.cluster_key_hex) if self.disagg is not None else None
        try:
            plan = plan_ranks(self.tensor_parallel_size, self.rank_env, self.key, cluster_key)
        except ConfigError as exc:
            raise LaunchError(str(exc)) from None
        spec = EngineProcSpec(str(self.paths.dir), self.key.hex(), self.num_frontends, self.engine_config,
                              self.lane_sndhwm, self.disagg, ranks=None if plan is None else plan.ranks,
                              rank_key_hex=None if plan is None else plan.key.hex(), rank_start_timeout=timeout)
        write_private_file(self.paths.engine_spec_file, msgspec.json.encode(spec))
        argv = [sys.executable, "-m", "workers.engine_proc", "--spec", str(self.paths.engine_spec_file),
                "--launcher-pid", str(os.getpid()), *self.log_flags()]
        self.engine = _Child("the engine", argv)
        record_owner(self.paths.dir, self.engine.popen.pid)  # it outlives us for a moment if we are killed
        if plan is not None and plan.spawn_followers:
            self.followers = LocalFollowers(plan, self.engine_config, self.paths.dir, os.getpid(), self.log_flags(),
                                            _Child, self.disagg)
        deadline = time.monotonic() + timeout
        while self.engine_info is None:
            if self.engine.popen.poll() is not None:
                raise LaunchError(f"the engine failed to start: {self.engine.describe_exit()}")
            if self.followers is not None and self.followers.exited():
                raise LaunchError(f"the engine failed to start: {self.followers.exited()[0]}")
            if time.monotonic() > deadline:
                raise LaunchError(f"the engine was not ready within {timeout:g} s")
            self._receive_status(timeout_ms=100)
        return self.engine_info

    def attach_info(self, frontend_id: int) -> AttachInfo:
        assert self.engine is not None and self.engine_info is not None, "start_engine() first"
        return AttachInfo(str(self.paths.dir), self.key.hex(), frontend_id, self.num_frontends, os.getpid(),
                          self.engine.popen.pid, self.engine_info, self.host, self.port,
                          self._generations.get(frontend_id, 0), self.engine_wedged_seconds)

    def spawn_frontends(self, argv: list[str]) -> None:
        """Start frontends 1..K-1 as ``argv`` with the attach file in their environment."""
        self._frontend_argv = list(argv)
        for frontend_id in range(1, self.num_frontends):
            self._spawn_frontend(frontend_id)

    def _spawn_frontend(self, frontend_id: int) -> None:
        env = {k: v for k, v in os.environ.items() if k not in RANK_ENV_VARS}
        attach_file = self.paths.attach_file(frontend_id)
        attach_file.unlink(missing_ok=True)  # a predecessor that died before reading its own
        env[ATTACH_FILE_ENV] = str(write_attach_file(self.attach_info(frontend_id)))
        self.frontends[frontend_id] = _Child(f"frontend {frontend_id}", self._frontend_argv, env)

    def wait_frontends_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self._ready_frontends) < len(self.frontends):
            if self.stopping:
                raise LaunchError("stopped by a signal before every frontend was ready")
            for frontend_id, child in self.frontends.items():
                if child.popen.poll() is not None:
                    raise LaunchError(f"frontend {frontend_id} failed to start: {child.describe_exit()}")
            if time.monotonic() > deadline:
                missing = sorted(set(self.frontends) - self._ready_frontends)
                raise LaunchError(f"frontends {missing} were not ready within {timeout:g} s")
            self._receive_status(timeout_ms=100)

    def _receive_status(self, timeout_ms: int) -> None:
        if not self._status.poll(timeout_ms):
            return
        message = self._status_codec.decode(self._status.recv_multipart())
        if isinstance(message, EngineReady):
            self.engine_info = message.info
        elif isinstance(message, EngineFailed):
            raise LaunchError(f"the engine failed to start: {message.error}")
        elif isinstance(message, FrontendReady):
            self._ready_frontends.add(message.frontend_id)
        elif isinstance(message, FrontendFailed):
            raise LaunchError(f"frontend {message.frontend_id} failed to start: {message.error}")

    # --- run -------------------------------------------------------------------

    def respawn_exited_frontends(self, on_exit: Callable[[int], None] | None = None,
                                 now: float | None = None) -> list[int]:
        """Respawn every attached frontend that exited while serving, in its slot; the slots
        respawned. ``on_exit(pid)`` runs for each exited process (e.g. to mark its metrics dead).
        A slot that crashed ``MAX_CRASHES_IN_WINDOW`` times within ``RESPAWN_WINDOW_SECONDS``
        is left down."""
        now = time.monotonic() if now is None else now
        respawned: list[int] = []
        if self.engine is None or self.engine.popen.poll() is not None:
            return respawned  # the group is going down with its engine
        for frontend_id, child in list(self.frontends.items()):
            if self.stopping or frontend_id in self.abandoned_frontends or child.popen.poll() is None:
                continue
            how = child.describe_exit()
            if on_exit is not None:
                on_exit(child.popen.pid)
            budget = self._restart_budgets.setdefault(
                frontend_id, RestartBudget(MAX_CRASHES_IN_WINDOW - 1, RESPAWN_WINDOW_SECONDS))
            if not budget.allow(now):
                self.abandoned_frontends.add(frontend_id)
                # Every frontend's /health now answers "degraded" (workers.frontends_down).
                write_frontends_down(self.paths.frontends_down,
                                     FrontendsDown(sorted(self.abandoned_frontends), self.num_frontends))
                log.critical("!!! %s; frontend %d crashed %d times within %.0f s: NOT respawning it again; "
                             "%d of %d frontends left serving", how, frontend_id, budget.recent_exits,
                             RESPAWN_WINDOW_SECONDS, self.num_frontends - len(self.abandoned_frontends),
                             self.num_frontends)
                continue
            self._generations[frontend_id] = self._generations.get(frontend_id, 0) + 1
            log.error("%s; respawning frontend %d (crash %d within %.0f s)", how, frontend_id, budget.recent_exits,
                      RESPAWN_WINDOW_SECONDS)
            self._spawn_frontend(frontend_id)
            respawned.append(frontend_id)
        return respawned

    def control(self, request: ControlRequest, timeout: float = 10.0) -> ControlReply:
        """One request/reply on control.sock (a fresh DEALER: callers may be on any thread)."""
        codec: FrameCodec = FrameCodec(self.key, ControlRequest, "launcher control")
        with self._ctx.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.paths.control)
            dealer.send_multipart(codec.encode(request))
            if not dealer.poll(int(timeout * 1000)):
                raise TimeoutError(f"the engine did not answer {type(request).__name__} within {timeout:g} s")
            reply = self._control_codec.decode(dealer.recv_multipart())
        if reply is None:
            raise RuntimeError("the engine's control reply failed its check")
        return reply

    def request_stop(self, sig: int) -> None:
        """A signal asked the launcher to stop: forward it so that every frontend drains at once."""
        self.stopping = True
        self.signal_frontends(sig)

    def signal_frontends(self, sig: int) -> None:
        for child in self.frontends.values():
            if child.popen.poll() is None:
                child.popen.send_signal(sig)

    # --- stop ------------------------------------------------------------------

    def shutdown(self) -> None:
        """Frontends (graceful, then killed), then the engine, then the IPC directory."""
        if self._closed:
            return
        self._closed = True
        try:
            self.signal_frontends(signal.SIGTERM)
            for child in self.frontends.values():
                child.stop(signal.SIGTERM, self.grace_seconds + 5.0)
            if self.engine is not None:
                self._stop_engine()
        finally:
            if self.followers is not None:  # after rank 0, which tells them to stop
                self.followers.stop()
            self._status.close(linger=0)
            self._ctx.term()
            shutil.rmtree(self.paths.dir, ignore_errors=True)

    def _stop_engine(self) -> None:
        assert self.engine is not None
        try:
            if self.engine_failed:  # dead or hung (e.g. SIGSTOP): asking would only wait
                self.engine.stop(signal.SIGKILL, 5.0)
                return
            if self.engine_info is None:  # a failed start: it is exiting on its own
                self.engine.popen.wait(timeout=2.0)
            elif self.engine.popen.poll() is None:
                self.control(Shutdown(), timeout=2.0)
                self.engine.popen.wait(timeout=10.0)
        except (TimeoutError, subprocess.TimeoutExpired) as exc:
            log.warning("the engine did not stop on request (%s): sending SIGTERM", exc)
        self.engine.stop(signal.SIGTERM, 10.0)
