"""Start a real ``disagg serve`` worker as a subprocess (shared by worker and frontend tests).

    url, proc = start_worker(model_dir, num_frontends=2)
    ...
    assert stop_worker(proc) == 0

The worker runs with its own TMPDIR (``proc.ipc_root``) so a test can check
that the IPC directory is gone afterwards; its stderr goes to ``proc.log_path``.
Both live in one /tmp/dw-* directory, removed when ``proc`` is garbage collected.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from common.processes import stop_process
from disagg.serve import READY_MESSAGE  # the line the launcher prints when every frontend is ready
from workers.ipc import write_private_file

__all__ = ["STARTED", "free_port", "spawn_worker", "start_worker", "stop_worker", "port_is_free", "worker_log", "READY_MESSAGE",
           "disagg_worker_args"]


# Every worker a test started: tests/conftest.py stops those still running when their module ends.
STARTED: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def spawn_worker(model_dir: str | Path, num_frontends: int, engine: str = "synthetic", port: int | None = None,
                 extra_args: list[str] | tuple[str, ...] = ()) -> subprocess.Popen:
    """Start ``disagg serve`` without waiting; ``proc.port``, ``proc.ipc_root``, ``proc.log_path`` are set."""
    port = free_port() if port is None else port
    base = Path(tempfile.mkdtemp(prefix="dw-", dir="/tmp"))  # short: Unix socket paths
    ipc_root = base / "tmp"
    ipc_root.mkdir()
    log = open(base / "worker.log", "w")
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--port", str(port),
            "--num-frontends", str(num_frontends), "--engine", engine, "--log-level", "warning", *extra_args]
    if "--state-dir" not in extra_args:
        argv += ["--state-dir", str(base / "state")]
    env = {**os.environ, "TMPDIR": ipc_root}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    log.close()
    proc.port, proc.ipc_root, proc.log_path = port, str(ipc_root), log.name
    STARTED.add(proc)
    weakref.finalize(proc, shutil.rmtree, base, True)  # the log and TMPDIR go when the test drops proc
    proc.stdout_lines = []
    proc.ready = threading.Event()

    def read_stdout() -> None:
        for line in proc.stdout:
            proc.stdout_lines.append(line)
            if line.startswith(READY_MESSAGE):
                proc.ready.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    return proc


def start_worker(model_dir: str | Path, num_frontends: int, engine: str = "synthetic", port: int | None = None,
                 extra_args: list[str] | tuple[str, ...] = (), timeout: float = 60.0) -> tuple[str, subprocess.Popen]:
    """Start a worker and wait until it printed its URL (every frontend ready)."""
    proc = spawn_worker(model_dir, num_frontends, engine, port, extra_args)
    deadline = time.monotonic() + timeout
    while not proc.ready.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_worker(proc)
            raise RuntimeError(f"worker did not start (exit code {proc.returncode}):\n{worker_log(proc)}")
    return f"http://127.0.0.1:{proc.port}", proc


def worker_log(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")


def stop_worker(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM the launcher and wait; its exit code (SIGKILL after ``timeout``)."""
    return stop_process(proc, timeout)


def disagg_worker_args(tmp: Path) -> list[str]:
    """``disagg serve`` flags for ctx and gen workers of one test cluster: a fresh cluster key
    (written to ``tmp/cluster.key``, mode 0600) and a free KV-transfer port."""
    key_file = Path(tmp) / "cluster.key"
    write_private_file(key_file, secrets.token_hex(32).encode())
    return ["--cluster-key-file", str(key_file), "--kv-port", "0"]
