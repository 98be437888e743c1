"""``disagg status [--json]`` of a local deployment: one typed ``DeploymentStatus``, printed as text or JSON.

The JSON is ``msgspec.json.encode(DeploymentStatus)``: stable field names
documented here and in docs/operations.md, every field present (null when
unknown). Exit code 0 when the deployment runs and its orchestrator answers,
1 otherwise (nothing running, the orchestrator silent), so a
script can test ``disagg status --json >/dev/null`` and read the details.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from disagg.run_dir_guard import recorded_processes
from orchestrator.prometheus_sd import CONFIG_FILE, prometheus_command

if TYPE_CHECKING:
    from disagg.run_state import LocalRunState

__all__ = ["ProcessStatus", "WorkerStatus", "DeploymentStatus", "local_status", "not_running", "print_status",
           "cluster_workers", "prometheus_fields"]


class ProcessStatus(msgspec.Struct, kw_only=True):
    name: str
    """supervisor, ctx-<i>, gen-<i>, orchestrator."""
    pid: int | None = None
    """null for a Slurm step (see ``step``)."""
    state: str
    """running | exited (restarted or about to be) | left_down (past its restart budget) | retired (stopped
    for good by `disagg drain` or `disagg scale`) | gone (supervisor) | ended (a Slurm step)."""
    step: str | None = None
    """A Slurm step's id (JOB.STEP) while it runs."""
    nodes: str | None = None
    """A running Slurm step's node list as Slurm writes it (``n[11-14]``)."""
    ranks: int | None = None
    """A Slurm worker step's tasks: its tensor-parallel ranks."""
    url: str | None = None
    restarts: int = 0
    log: str | None = None
    left_down_reason: str | None = None


class WorkerStatus(msgspec.Struct, kw_only=True):
    """The orchestrator's view of one worker (its ``/cluster_info``)."""

    worker_id: str
    role: str
    url: str
    healthy: bool
    degraded: bool = False
    """Serving on fewer frontends than configured (one left down by its restart budget)."""
    last_error: str | None = None
    in_flight_requests: int = 0
    num_cached_blocks: int = 0
    draining: bool = False
    """`disagg drain`: routed nothing new (``drained`` once nothing is in flight)."""

    @property
    def rotation(self) -> str:
        """healthy | draining | drained | UNHEALTHY: what the text status shows."""
        if self.draining:
            return "draining" if self.in_flight_requests else "drained"
        return "healthy" if self.healthy else "UNHEALTHY"


class DeploymentStatus(msgspec.Struct, kw_only=True):
    running: bool
    """A recorded process of the deployment still runs."""
    run_dir: str | None
    """The deployment's run directory; null when none was found."""
    message: str | None = None
    """Why it is not running (one line), else null."""
    launcher: str = "local"
    """local | slurm."""
    job_id: int | None = None
    """launcher slurm: the Slurm job."""
    config: str | None = None
    url: str | None = None
    """The orchestrator: the URL clients use."""
    supervisor: ProcessStatus | None = None
    processes: list[ProcessStatus] = []
    workers: list[WorkerStatus] | None = None
    """null when the orchestrator did not answer /cluster_info."""
    prometheus_config: str | None = None
    """<run dir>/prometheus.yml, when `disagg up` wrote one."""
    prometheus_command: str | None = None

    @property
    def answering(self) -> bool:
        """Running, and its orchestrator answers (status' exit code 0; a process left down does not change it)."""
        return self.running and self.workers is not None


def not_running(run_dir: Path | None, message: str) -> DeploymentStatus:
    return DeploymentStatus(running=False, run_dir=None if run_dir is None else str(run_dir), message=message)


def prometheus_fields(run_dir: Path) -> dict[str, Any]:
    config = run_dir / CONFIG_FILE
    if not config.is_file():
        return {}
    return {"prometheus_config": str(config.resolve()), "prometheus_command": prometheus_command(run_dir)}


def cluster_workers(url: str, run_dir: Path) -> list[WorkerStatus] | None:
    """The orchestrator's view of its workers (None: it does not answer), asked with the API key of
    the deployment in ``run_dir``."""
    import httpx

    from disagg.deploy_plan import api_headers

    try:
        info = httpx.get(f"{url}/cluster_info", headers=api_headers(run_dir), timeout=3).json()
        return msgspec.convert(info["workers"], list[WorkerStatus])
    except (httpx.HTTPError, ValueError, KeyError, msgspec.ValidationError):
        return None


def local_status(run_dir: Path, state: LocalRunState | None) -> DeploymentStatus:
    """``state``: the run dir's state.json (None: nothing running from it)."""
    if state is None:
        return not_running(run_dir, f"no deployment running from {run_dir}")
    recorded = {p.name: p for p in recorded_processes(state)}
    supervisor = recorded.pop("supervisor")
    processes = []
    for process in state.processes:
        alive = process.name in recorded and recorded[process.name].may_be_running()
        processes.append(ProcessStatus(
            name=process.name, pid=process.pid, url=process.url, restarts=process.restarts, log=process.log,
            left_down_reason=process.given_up,
            state="left_down" if process.given_up else "running" if alive else "retired" if process.retired
            else "exited"))
    return DeploymentStatus(
        running=supervisor.may_be_running() or any(p.state == "running" for p in processes), run_dir=str(run_dir),
        config=state.config, url=state.url, processes=processes,
        supervisor=ProcessStatus(name="supervisor", pid=supervisor.pid, log=str(run_dir / "up.log"),
                                 state="running" if supervisor.may_be_running() else "gone"),
        workers=cluster_workers(state.url, run_dir), **prometheus_fields(run_dir))


def print_status(status: DeploymentStatus, as_json: bool) -> int:
    if as_json:
        print(json.dumps(msgspec.to_builtins(status), indent=2))
    elif not status.running:
        print(status.message)
        _print_last_supervisor_log(status.run_dir)
    else:
        _print_text(status)
    return 0 if status.answering else 1


def _print_last_supervisor_log(run_dir: str | None) -> None:
    up_log = Path(run_dir) / "up.log" if run_dir else None
    if up_log is not None and up_log.is_file():  # why the last one ended is at the end of its supervisor's log
        last = up_log.read_text(errors="replace").rstrip().splitlines()[-3:]
        print(f"  the last one's supervisor log is {up_log}; it ends:", *(f"    {line}" for line in last), sep="\n")


def _print_text(status: DeploymentStatus) -> None:
    print(f"deployment {status.run_dir} ({status.config}), orchestrator {status.url}")
    supervisor = status.supervisor
    if supervisor is not None and supervisor.state == "running":
        print(f"  supervisor pid {supervisor.pid}: running")
    elif supervisor is not None:  # an orphan: its processes serve unsupervised (no restarts); `down` finds them
        print(f"  supervisor pid {supervisor.pid}: GONE; the processes below run unsupervised; "
              f"`disagg down` stops them (its log: {supervisor.log})")
    for process in status.processes:
        shown = "exited" if process.state == "left_down" else process.state
        print(f"  {process.name:<14} pid {process.pid:<8} {shown:<8} {process.url}")
        if process.left_down_reason:
            print(f"    LEFT DOWN: it {process.left_down_reason} (restarts: {process.restarts}); "
                  f"its log: {process.log}")
    if status.workers is None:
        print("  the orchestrator does not answer /cluster_info")
    else:
        print("  the orchestrator's view of the workers:")
        for worker in status.workers:
            health = f"UNHEALTHY ({worker.last_error})" if worker.rotation == "UNHEALTHY" else worker.rotation
            if worker.rotation == "healthy" and worker.degraded:
                health = "DEGRADED (a frontend left down by its restart budget; see its log)"
            print(f"    {worker.worker_id:<10} {worker.role:<5} {worker.url:<26} {health}; in flight "
                  f"{worker.in_flight_requests}, cached blocks {worker.num_cached_blocks}")
    if status.prometheus_command:
        print(f"  metrics: {status.prometheus_command}  (then import dashboards/disagg.json into Grafana)")
