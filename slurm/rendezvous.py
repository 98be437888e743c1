"""The run directory: how the steps of one job and the submitting machine find each other.

It lives on a filesystem every node and the submitting machine share:

    <run dir>/cluster.key       64 hex digits, mode 0600: signs KV handles between workers
    <run dir>/worker.key        64 hex digits, mode 0600: what every worker requires of its callers
                                (the orchestrator, Prometheus; docs/operations.md, "Security")
    <run dir>/nodes             the allocation's host names, one a line (NODES[i] in the script)
    <run dir>/orchestrator.url  written by the orchestrator once it answers; workers and
                                `disagg up` wait for it, then register / report the URL
    <run dir>/logs/<step>.log   one per srun step

``disagg up`` makes the directory and the keys before submitting (and passes
it as DISAGG_RUN_DIR); a script submitted by hand makes them itself. Files are
replaced atomically (write, then rename) because readers on other nodes poll them.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["KEY_FILE", "WORKER_KEY_FILE", "NODES_FILE", "ORCHESTRATOR_URL_FILE", "LOGS_DIR", "create_cluster_key",
           "publish_orchestrator_url", "read_orchestrator_url", "wait_for_orchestrator_url", "read_nodes"]

KEY_FILE = "cluster.key"
WORKER_KEY_FILE = "worker.key"
NODES_FILE = "nodes"
ORCHESTRATOR_URL_FILE = "orchestrator.url"
LOGS_DIR = "logs"
_POLL_SECONDS = 0.2


def create_cluster_key(run_dir: Path) -> Path:
    """Fresh keys (the cluster key, whose path this returns, and the worker key), readable by their
    owner only; refuses to overwrite one (FileExistsError)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (KEY_FILE, WORKER_KEY_FILE):
        fd = os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return run_dir / KEY_FILE


def publish_orchestrator_url(run_dir: Path, url: str) -> None:
    tmp = run_dir / f".{ORCHESTRATOR_URL_FILE}.{os.getpid()}"
    tmp.write_text(url + "\n", encoding="utf-8")
    tmp.replace(run_dir / ORCHESTRATOR_URL_FILE)


def read_orchestrator_url(run_dir: Path) -> str | None:
    try:
        return (run_dir / ORCHESTRATOR_URL_FILE).read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def wait_for_orchestrator_url(run_dir: Path, timeout: float, still_waiting: Callable[[], bool]) -> str:
    """Poll until the URL appears. ``still_waiting`` returning False (the job ended) stops the
    wait at once with RuntimeError; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (url := read_orchestrator_url(run_dir)) is None:
        if not still_waiting():
            raise RuntimeError(f"gave up on {run_dir / ORCHESTRATOR_URL_FILE}: the job is no longer running")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {run_dir / ORCHESTRATOR_URL_FILE} after {timeout:.0f} s")
        time.sleep(_POLL_SECONDS)
    return url


def read_nodes(run_dir: Path) -> list[str]:
    """The allocation's host names in NODES[i] order; empty before the job starts."""
    try:
        return (run_dir / NODES_FILE).read_text(encoding="utf-8").split()
    except FileNotFoundError:
        return []
