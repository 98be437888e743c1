"""A deployment's run state: what ``disagg up`` records in its run directory for ``status``, ``down`` and ``logs``.

One typed struct per launcher, each in its own file so that the commands
know which launcher to ask before reading anything:

- ``state.json``: ``LocalRunState``, the supervisor and every process it
  started, each as ``(pid, start_time)`` (``disagg.run_dir_guard`` checks
  both before it signals), with its restarts and, past its budget, why it
  was left down. The supervisor rewrites it on every change.
- ``slurm.json``: ``SlurmRunState``, the job and its steps (name, port,
  ranks); Slurm knows the rest.

Both are written atomically (a temporary file renamed over the old one) and
decoded with ``type=``: a file that is missing, torn or not this shape reads
as no state (nothing to act on). Only what ``down`` needs to find the
processes is required (pids, the job id); everything else has a default, so
that a state written by an older disagg still lets ``down`` stop it. ``clean`` removes a launcher's runtime
files; logs, ``up.log`` and the workers' persistent state stay.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import ClassVar, TypeVar

import msgspec

from disagg.deploy_plan import API_KEY_FILE, KEY_FILE, ORCHESTRATOR_CONFIG_FILE, ORCHESTRATOR_STATE_DIR, WORKER_KEY_FILE
from disagg.supervisor_control import CONTROL_DIR
from orchestrator.prometheus_sd import CONFIG_FILE as PROMETHEUS_CONFIG
from orchestrator.prometheus_sd import TARGETS_DIR

__all__ = ["ProcessRecord", "LocalRunState", "SlurmStep", "SlurmRunState", "RunState", "read_state", "find_state",
           "write_state", "clean", "STATE_FILES",
           "STOP_SECONDS", "ORCHESTRATOR_STOP_SECONDS", "orchestrator_stop_seconds"]

STOP_SECONDS = 30.0  # a worker's window: its --grace-seconds (30) drain, then SIGKILL
# The orchestrator drains for its grace_seconds (30 by default), its non-zero processes in parallel,
# then stops its state owner: its window covers all of that, and is never shorter than the workers'.
ORCHESTRATOR_STOP_MARGIN_SECONDS = 25.0
ORCHESTRATOR_STOP_SECONDS = STOP_SECONDS + ORCHESTRATOR_STOP_MARGIN_SECONDS


def orchestrator_stop_seconds(grace_seconds: float) -> float:
    """How long the supervisor (and `down`) waits for the orchestrator before SIGKILL."""
    return max(grace_seconds, STOP_SECONDS) + ORCHESTRATOR_STOP_MARGIN_SECONDS


class ProcessRecord(msgspec.Struct, kw_only=True):
    """One process the local supervisor runs (a worker or the orchestrator)."""

    name: str
    """ctx-<i>, gen-<i>, orchestrator: also its log, logs/<name>.log."""
    url: str = ""
    argv: list[str] = []
    pid: int | None = None
    """None until it is started."""
    start_time: int | None = None
    """``common.process_identity.process_start_time`` of ``pid``; None: recorded by a disagg that did
    not record start times, never signalled."""
    log: str | None = None
    restarts: int = 0
    given_up: str | None = None
    """Why it was left down (past its restart budget); None while it is supervised."""
    retired: str | None = None
    """Why an operator stopped it for good (``disagg drain``, ``disagg scale``): never restarted."""
    pool: str | None = None
    """A worker's pool (ctx or gen); None for the orchestrator."""


class LocalRunState(msgspec.Struct, kw_only=True):
    FILE: ClassVar[str] = "state.json"
    RUNTIME_FILES: ClassVar[tuple[str, ...]] = ("state.json", KEY_FILE, WORKER_KEY_FILE, ORCHESTRATOR_CONFIG_FILE,
                                                API_KEY_FILE)
    # prometheus.yml stays (Prometheus may still be pointed at it); its targets go: nothing to scrape
    RUNTIME_DIRS: ClassVar[tuple[str, ...]] = (ORCHESTRATOR_STATE_DIR, TARGETS_DIR, CONTROL_DIR)

    config: str = ""
    url: str = ""
    """The orchestrator's: the URL clients use."""
    supervisor_pid: int
    supervisor_start_time: int | None = None
    processes: list[ProcessRecord]
    """Workers (ctx, then gen, then any ``disagg scale`` added), then the orchestrator, always last: the
    order they start in (``down`` stops them in reverse)."""
    started_at: float = 0.0
    orchestrator_stop_seconds: float = ORCHESTRATOR_STOP_SECONDS


class SlurmStep(msgspec.Struct, kw_only=True):
    name: str
    port: int
    ranks: int = 1
    """Its tasks: a worker's tensor-parallel ranks."""


class SlurmRunState(msgspec.Struct, kw_only=True):
    FILE: ClassVar[str] = "slurm.json"
    RUNTIME_FILES: ClassVar[tuple[str, ...]] = (KEY_FILE, WORKER_KEY_FILE, API_KEY_FILE, "orchestrator.url",
                                                ORCHESTRATOR_CONFIG_FILE, "nodes", "slurm.json", PROMETHEUS_CONFIG)
    RUNTIME_DIRS: ClassVar[tuple[str, ...]] = ("orchestrator", "state", "submitit", "prometheus", "ranks")

    launcher: str = "slurm"
    job_id: int
    config: str
    job_name: str
    steps: list[SlurmStep]
    """The orchestrator, then every worker."""
    orchestrator_port: int


RunState = LocalRunState | SlurmRunState
S = TypeVar("S", LocalRunState, SlurmRunState)
STATE_FILES = (LocalRunState.FILE, SlurmRunState.FILE)


def read_state(run_dir: Path, kind: type[S]) -> S | None:
    try:
        return msgspec.json.decode((run_dir / kind.FILE).read_bytes(), type=kind)
    except (OSError, msgspec.DecodeError):  # ValidationError is a DecodeError
        return None


def find_state(run_dir: Path) -> RunState | None:
    """The run dir's state under either launcher (Slurm's first: a run dir holds one of them)."""
    return read_state(run_dir, SlurmRunState) or read_state(run_dir, LocalRunState)


def write_state(run_dir: Path, state: RunState) -> None:
    path = run_dir / state.FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state), indent=2))
    tmp.replace(path)


def clean(run_dir: Path, kind: type[RunState]) -> None:
    """Remove ``kind``'s runtime files and directories, and a parent left empty by them (unless it is
    the run dir): logs and what outlives a run stay."""
    for name in kind.RUNTIME_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in kind.RUNTIME_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
        if Path(name).parent != Path("."):
            with contextlib.suppress(OSError):
                (run_dir / name).parent.rmdir()  # unless something else keeps data there (Prometheus's)
