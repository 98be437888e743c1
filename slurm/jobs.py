"""A Slurm job's state from ``scontrol``/``squeue``, waiting on it, cancelling it.

Not ``sacct``: clusters without accounting (the dev cluster among them) have
none, and submitit's own job state stays UNKNOWN there. ``scontrol show job``
knows a job from submission until ``MinJobAge`` after it ends (300 s on the
dev cluster); after that the job is simply gone. ``sbatch --wait`` polls every
10 s; polling ``scontrol`` here answers in tenths of a second.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

__all__ = ["JobInfo", "job_info", "job_in_queue", "wait_for_state", "wait_until_gone", "cancel_job",
           "TERMINAL_STATES", "SlurmCommandError"]

TERMINAL_STATES = frozenset({
    "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE",
})
_POLL_SECONDS = 0.1
_COMMAND_TIMEOUT = 30.0


class SlurmCommandError(RuntimeError):
    """A Slurm command failed for a reason other than an unknown job."""


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    state: str
    """PENDING, RUNNING, COMPLETING, COMPLETED, CANCELLED, FAILED, TIMEOUT, PREEMPTED, ..."""
    reason: str
    """Why it is pending or how it ended (None, Resources, NonZeroExitCode, ...)."""
    exit_code: str
    """<exit status>:<signal> of the batch script."""
    node_list: str

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


def job_info(job_id: int) -> JobInfo | None:
    """None once Slurm no longer knows the job (it ended more than MinJobAge ago)."""
    result = _run(["scontrol", "show", "job", "-o", str(job_id)], allow_fail=True)
    if result.returncode != 0:
        if "Invalid job id" in result.stderr:
            return None
        raise SlurmCommandError(f"scontrol show job {job_id}: {result.stderr.strip()}")
    fields = dict(word.split("=", 1) for word in result.stdout.split() if "=" in word)
    return JobInfo(job_id=job_id, state=fields.get("JobState", "UNKNOWN"), reason=fields.get("Reason", ""),
                   exit_code=fields.get("ExitCode", ""), node_list=fields.get("NodeList", ""))


def job_in_queue(job_id: int) -> bool:
    """Whether the job still holds or waits for resources (pending, running or completing)."""
    result = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], allow_fail=True)
    return result.returncode == 0 and bool(result.stdout.strip())


def wait_for_state(job_id: int, states: frozenset[str] | set[str], timeout: float) -> JobInfo:
    """Poll until the job is in one of ``states`` (or has ended); TimeoutError names the last state."""
    deadline = time.monotonic() + timeout
    info = job_info(job_id)
    while info is not None and info.state not in states and not info.finished:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {info.state} ({info.reason}) after {timeout:.0f} s")
        time.sleep(_POLL_SECONDS)
        info = job_info(job_id)
    if info is None:
        raise SlurmCommandError(f"job {job_id} is unknown to Slurm")
    return info


def wait_until_gone(job_id: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while job_in_queue(job_id):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still in squeue after {timeout:.0f} s")
        time.sleep(_POLL_SECONDS)


def cancel_job(job_id: int, signal: str | None = None) -> None:
    """``scancel``: SIGTERM to every step, SIGKILL after KillWait; with ``signal``, only that signal."""
    argv = ["scancel", *([f"--signal={signal}"] if signal else []), str(job_id)]
    _run(argv)


def _run(argv: list[str], allow_fail: bool = False) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT)
    if result.returncode != 0 and not allow_fail:
        raise SlurmCommandError(f"{' '.join(argv)}: {result.stderr.strip() or f'exit {result.returncode}'}")
    return result
