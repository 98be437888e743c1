"""``disagg render`` and the Slurm side of ``disagg up | status | down``.

One deployment = one Slurm job whose batch script is ``render_script`` of the
``disagg.deploy_plan.slurm_plan`` of the YAML: a setup command (model,
orchestrator.json), the orchestrator on node 0 and every worker as concurrent
``srun`` steps. Workers wait for the
orchestrator's URL in the run directory, then register with heartbeats
(``slurm.step``). ``up`` makes the run directory (key 0600) before submitting
through submitit and records the job in ``<run dir>/slurm.json``
(``disagg.run_state.SlurmRunState``), which
``status`` and ``down`` read; ``logs`` reads ``<run dir>/logs/<step>.log``
exactly as for a local deployment.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disagg.deploy_logs import tail
from disagg.deploy_plan import api_headers
from disagg.progress import ProgressLine
from disagg.run_state import SlurmRunState, SlurmStep, clean, read_state, write_state
from orchestrator.readiness import health_progress

if TYPE_CHECKING:
    from disagg.deploy_config import DeployConfig
    from slurm.plan import JobPlan

__all__ = ["build_slurm_plan", "add_render_arguments", "run_render", "slurm_up", "slurm_status", "slurm_down",
           "running_steps"]

CANCEL_WAIT_SECONDS = 60.0


# -- the plan ----------------------------------------------------------------------------------

def build_slurm_plan(config: DeployConfig, config_path: str) -> JobPlan:
    """The job for ``config``; ``config_path`` is how the job's setup command names the YAML."""
    from disagg.deploy_plan import slurm_plan
    from slurm.plan import build_plan

    plan = slurm_plan(config, config_path)
    argv = {worker.name: worker.argv for worker in plan.workers}
    return build_plan(config.slurm, [w.placement for w in plan.workers if w.placement is not None],
                      plan.orchestrator.argv, lambda worker: argv[worker.name],
                      f"disagg deployment {config.name!r} from {config_path}", setup=plan.setup)


# -- render ------------------------------------------------------------------------------------

def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the deployment YAML")
    parser.add_argument("-o", "--output", default=None, help="write the script here (default: stdout)")


def run_render(args: argparse.Namespace) -> int:
    from common.config_errors import ConfigError
    from disagg.deploy_config import load_deploy_config
    from slurm.render import render_script

    try:
        config = load_deploy_config(args.config)
        # Absolute: the job runs the setup from wherever it was submitted.
        script = render_script(build_slurm_plan(config, str(Path(args.config).resolve())))
    except ConfigError as exc:
        print(f"disagg render: {exc}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(script)
        Path(args.output).chmod(0o755)
    else:
        sys.stdout.write(script)
    return 0


# -- up ----------------------------------------------------------------------------------------

def slurm_up(config: DeployConfig, config_path: str, run_dir: Path, stop: str = "disagg down") -> int:
    """``stop``: the ``down`` command that finds this deployment (``disagg.run_dir_link``)."""
    from disagg.deploy_plan import write_scrape_config
    from slurm.jobs import job_in_queue
    from slurm.rendezvous import LOGS_DIR, create_cluster_key
    from slurm.submit import submit_with_submitit

    config = dataclasses.replace(config, launcher="slurm")
    plan = build_slurm_plan(config, str(Path(config_path).resolve()))
    previous = read_state(run_dir, SlurmRunState)
    if previous is not None and job_in_queue(previous.job_id):
        print(f"disagg up: job {previous.job_id} already runs from {run_dir}; `disagg down` first", file=sys.stderr)
        return 1
    clean(run_dir, SlurmRunState)
    (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    for old in (run_dir / LOGS_DIR).glob("*.log"):
        old.unlink()
    create_cluster_key(run_dir)  # and the worker key
    run_dir = run_dir.resolve()
    write_scrape_config(config, run_dir)
    ports = {worker.name: worker.port for worker in config.placement()}
    job_id = submit_with_submitit(plan, run_dir / "submitit", Path.cwd(), env={"DISAGG_RUN_DIR": str(run_dir)})
    state = SlurmRunState(job_id=job_id, config=str(config_path), job_name=config.slurm.job_name,
                          steps=[SlurmStep(name=s.name, port=ports.get(s.name, config.orchestrator.port),
                                           ranks=s.num_tasks) for s in plan.steps],
                          orchestrator_port=config.orchestrator.port)
    write_state(run_dir, state)
    print(f"disagg up: submitted job {job_id} ({len(plan.steps)} steps); run dir {run_dir}", flush=True)
    try:
        return _wait_healthy(run_dir, state, config.startup_timeout_seconds, stop)
    except KeyboardInterrupt:  # a half-started deployment is no use: leave no allocation behind
        print(f"\ndisagg up: interrupted; cancelling job {job_id}", file=sys.stderr)
        _cancel(job_id)
        clean(run_dir, SlurmRunState)
        return 130


def _wait_healthy(run_dir: Path, state: SlurmRunState, timeout: float, stop: str) -> int:
    from slurm.jobs import job_info
    from slurm.rendezvous import read_orchestrator_url

    job_id = state.job_id
    deadline = time.monotonic() + timeout
    ready_processes: set[int] = set()
    progress = ProgressLine()
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info is None or info.finished:
            ended = "gone from Slurm" if info is None else f"{info.state} ({info.reason})"
            progress.finish()
            print(f"disagg up: job {job_id} ended before it was healthy: {ended}", file=sys.stderr)
            _print_failing_logs(run_dir, state)
            clean(run_dir, SlurmRunState)
            return 1
        url = read_orchestrator_url(run_dir)
        if url is None and _step_ended(run_dir, job_id, "orchestrator"):
            progress.finish()
            print(f"disagg up: the orchestrator step ended before it answered; cancelling job {job_id}",
                  file=sys.stderr)
            return _fail(run_dir, state)
        if info.state != "RUNNING":
            line = f"job {job_id} {info.state} ({info.reason})"
        elif url is None:
            line = f"job {job_id} RUNNING on {info.node_list}; waiting for the orchestrator"
        else:
            line = f"job {job_id} RUNNING; {health_progress(url, ready_processes, api_headers(run_dir))}"
        progress.update(f"disagg up: {line}")
        if url is not None and line.endswith("ready"):
            progress.finish()
            print(f"disagg up: ready on {url} (job {job_id}, run dir {run_dir}; `{stop}` stops it)")
            return 0
        time.sleep(0.5)
    progress.finish()
    print(f"disagg up: not healthy after {timeout:g} s; cancelling job {job_id}", file=sys.stderr)
    return _fail(run_dir, state)


def _fail(run_dir: Path, state: SlurmRunState) -> int:
    _print_failing_logs(run_dir, state)
    _cancel(state.job_id)
    clean(run_dir, SlurmRunState)
    return 1


def _step_ended(run_dir: Path, job_id: int, name: str) -> bool:
    """srun creates a step's log once Slurm has the step; a log without a step in squeue: it ended."""
    from slurm.rendezvous import LOGS_DIR

    return (run_dir / LOGS_DIR / f"{name}.log").exists() and name not in running_steps(job_id)


def _print_failing_logs(run_dir: Path, state: SlurmRunState, lines: int = 20) -> None:
    """The steps that ended; none ended: the orchestrator's if it never published its URL, else all."""
    from slurm.rendezvous import LOGS_DIR, read_orchestrator_url

    names = [s.name for s in state.steps]
    running = running_steps(state.job_id)
    failing = [n for n in names if n not in running] if running else []
    if not failing:
        failing = names[:1] if read_orchestrator_url(run_dir) is None else names
    for name in failing:
        path = run_dir / LOGS_DIR / f"{name}.log"
        print(f"==> {path} (last {lines} lines) <==\n{tail(path, lines) if path.exists() else '(no log)'}",
              file=sys.stderr)


# -- status / down -----------------------------------------------------------------------------

def running_steps(job_id: int) -> dict[str, str]:
    """Step name -> step id (JOB.STEP) of the job's steps Slurm still runs."""
    return {name: step_id for name, (step_id, _) in _running_step_nodes(job_id).items()}


def _running_step_nodes(job_id: int) -> dict[str, tuple[str, str]]:
    """Step name -> (step id, the step's node list as Slurm writes it, e.g. n[11-14])."""
    result = subprocess.run(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i %N %j"], capture_output=True,
                            text=True, timeout=30)
    steps = (line.split(None, 2) for line in result.stdout.splitlines() if line.strip())
    return {name.strip(): (step_id, nodes) for step_id, nodes, name in steps}


def slurm_status(run_dir: Path, state: SlurmRunState, as_json: bool = False) -> int:
    from disagg.deploy_status import cluster_workers
    from slurm.jobs import job_info
    from slurm.rendezvous import read_orchestrator_url

    job_id = state.job_id
    info = job_info(job_id)
    if as_json:
        return _print_json_status(run_dir, state, info)
    if info is None:
        print(f"deployment {run_dir} ({state.config}): job {job_id} is no longer known to Slurm (it ended)")
        return 1
    print(f"deployment {run_dir} ({state.config}): job {job_id} {info.state} ({info.reason}) on "
          f"{info.node_list or '-'}, exit code {info.exit_code}")
    if info.state in ("CANCELLED", "PREEMPTED", "TIMEOUT", "NODE_FAIL", "FAILED"):
        print(f"  the job was {info.state.lower().replace('_', ' ')}; `disagg down` cleans up, `disagg up` restarts")
    if info.state != "RUNNING":
        return 1
    running = _running_step_nodes(job_id)
    url = read_orchestrator_url(run_dir)
    view = cluster_workers(url, run_dir) if url else None
    by_port = {int(w.url.rstrip("/").rsplit(":", 1)[-1]): w for w in (view or [])}
    for step in state.steps:
        where = f"step {running[step.name][0]} running" if step.name in running else "step ENDED"
        worker = by_port.get(step.port)
        if step.name == "orchestrator":
            seen = f"on {url}" if url else "not answering yet"
        elif worker is None:
            seen = "not in the orchestrator's rotation (unregistered or dropped)"
        else:
            seen = (f"{worker.worker_id} {worker.rotation}; "
                    f"in flight {worker.in_flight_requests}")
        print(f"  {step.name:<14} {where:<22} {seen}")
        if step.name != "orchestrator":
            print(f"  {'':<14} {_ranks_line(run_dir, step, running.get(step.name))}")
    from orchestrator.prometheus_sd import prometheus_command

    print(f"  metrics: {prometheus_command(run_dir)}  (then import dashboards/disagg.json into Grafana)")
    if view is None:
        print("  the orchestrator does not answer /cluster_info")
        return 1
    return 0


def _ranks_line(run_dir: Path, step: SlurmStep, running: tuple[str, str] | None) -> str:
    """Where a TP worker's ranks run: Slurm's node list for the step, and rank 0's table of every
    rank's node (slurm.ranks) once it has written one."""
    from slurm.ranks import read_rank_table

    line = f"{step.ranks} {'rank' if step.ranks == 1 else 'ranks'} on {running[1] if running else '-'}"
    table = read_rank_table(run_dir, step.name) if step.ranks > 1 else None
    if table is None or len(table["nodes"]) != step.ranks:
        return line
    spans: list[tuple[str, int, int]] = []  # (node, first rank, last rank), ranks consecutive on a node
    for rank, node in enumerate(table["nodes"]):
        if spans and spans[-1][0] == node and spans[-1][2] == rank - 1:
            spans[-1] = (node, spans[-1][1], rank)
        else:
            spans.append((node, rank, rank))
    ranks = ", ".join(f"{node} {a}" if a == b else f"{node} {a}-{b}" for node, a, b in spans)
    return f"{line}: {ranks}; rank 0 at {table['master']}"


def _print_json_status(run_dir: Path, state: SlurmRunState, info: Any) -> int:
    """``status --json`` of a Slurm deployment: the same ``DeploymentStatus`` as a local one's."""
    from disagg.deploy_status import DeploymentStatus, ProcessStatus, cluster_workers, print_status, prometheus_fields
    from slurm.rendezvous import read_orchestrator_url

    running_job = info is not None and info.state == "RUNNING"
    steps = _running_step_nodes(state.job_id) if running_job else {}
    url = read_orchestrator_url(run_dir) if running_job else None
    message = None if running_job else (f"job {state.job_id} "
                                        f"{'ended' if info is None else f'{info.state} ({info.reason})'}")
    status = DeploymentStatus(
        running=running_job, run_dir=str(run_dir), message=message, launcher="slurm", job_id=state.job_id,
        config=state.config, url=url, workers=cluster_workers(url, run_dir) if url else None,
        processes=[ProcessStatus(name=s.name, state="running" if s.name in steps else "ended",
                                 step=steps.get(s.name, (None, None))[0], ranks=s.ranks,
                                 nodes=steps.get(s.name, (None, None))[1],
                                 log=str(run_dir / "logs" / f"{s.name}.log"))
                   for s in state.steps], **prometheus_fields(run_dir))
    return print_status(status, as_json=True)


def slurm_down(run_dir: Path, state: SlurmRunState) -> int:
    _cancel(state.job_id)
    clean(run_dir, SlurmRunState)
    print(f"disagg down: job {state.job_id} is gone; cleaned {run_dir} (logs kept)")
    return 0


def _cancel(job_id: int) -> None:
    from slurm.jobs import cancel_job, job_in_queue, wait_until_gone

    if job_in_queue(job_id):
        cancel_job(job_id)
    wait_until_gone(job_id, CANCEL_WAIT_SECONDS)
