"""``disagg drain | undrain`` of a Slurm deployment: the orchestrator drains, ``scancel`` stops the step.

A Slurm deployment has no supervisor process to ask: its workers are ``srun``
steps of one job (``disagg.slurm_deployment``). Draining goes through the
orchestrator exactly as for a local deployment (``disagg.live_change.Live``);
a worker is found by its step's port among the orchestrator's workers (as
``disagg status`` does), and stopping it is ``scancel --signal=TERM`` of its
step: the worker finishes what it holds, deregisters, and the step ends
(Slurm does not restart it).

``scale POOL N`` places the pool's N workers in the allocation as ``up``
would (``slurm.placement``: a pool that no longer fits the job's nodes and GPUs
is refused with the arithmetic), and starts each new one as an ``srun
--jobid JOB --overlap`` step from this machine, on its planned nodes, with
the command the batch script would have run (it registers with the
orchestrator); ``slurm.json`` records it, so ``status``, ``logs`` and ``down``
see it. That ``srun`` runs as long as the step does: the machine that ran
``scale`` must stay up (a login node). Fewer workers: the highest-numbered are
drained and their steps stopped. ``reload`` is not available on Slurm yet.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path

from disagg.live_change import POLL_SECONDS, Live, LiveChangeError
from disagg.run_state import STOP_SECONDS, ProcessRecord, SlurmRunState, SlurmStep, write_state

__all__ = ["slurm_live"]


def slurm_live(run_dir: Path, state: SlurmRunState, action: str) -> Live:
    """What ``action`` acts through; LiveChangeError for what Slurm deployments cannot do yet."""
    from disagg.deploy_status import cluster_workers
    from slurm.rendezvous import read_orchestrator_url

    if action not in ("drain", "undrain", "scale"):
        raise LiveChangeError(f"`disagg {action}` changes local deployments only; on Slurm apply settings with "
                              "POST /settings (docs/operations.md, Changing a running deployment)")
    url = read_orchestrator_url(run_dir)
    if url is None:
        raise LiveChangeError(f"job {state.job_id}'s orchestrator has not published its URL in {run_dir}")
    by_port = {int(w.url.rstrip("/").rsplit(":", 1)[-1]): w.url for w in cluster_workers(url, run_dir) or []}
    steps = [ProcessRecord(name=s.name, url=by_port.get(s.port, ""), pool=s.name.rsplit("-", 1)[0])
             for s in state.steps if s.name != "orchestrator"]
    return _SlurmLive(run_dir, url, steps, state)


class _SlurmLive(Live):
    def __init__(self, run_dir: Path, url: str, processes: list[ProcessRecord], state: SlurmRunState) -> None:
        super().__init__(run_dir, url, processes)
        self.state = state
        self.job_id = state.job_id

    def start_workers(self, pool: str, count: int) -> dict[str, str]:
        """``count`` more workers of ``pool`` as new steps of the job; their names and URLs."""
        from disagg.deploy_config import load_deploy_config
        from disagg.slurm_deployment import build_slurm_plan
        from orchestrator.typed import ConfigError
        from slurm.rendezvous import read_nodes

        config = load_deploy_config(self.state.config, str(self.run_dir))
        if config.slurm.container is not None:
            raise LiveChangeError("scaling a Slurm deployment that runs in a container is not supported yet")
        current = sum(1 for s in self.state.steps if s.name.startswith(f"{pool}-"))
        pools = config.pools
        grown = dataclasses.replace(getattr(pools, pool), instances=current + count)
        config = dataclasses.replace(config, pools=dataclasses.replace(pools, **{pool: grown}))
        try:
            plan = build_slurm_plan(config, str(Path(self.state.config).resolve()))
        except ConfigError as exc:
            raise LiveChangeError(f"the allocation has no room for {current + count} {pool} workers: {exc}") from None
        known = {s.name for s in self.state.steps}
        nodes = read_nodes(self.run_dir)
        ports = {w.name: w.port for w in config.placement()}
        started: dict[str, str] = {}
        for step in (s for s in plan.steps if s.name.startswith(f"{pool}-") and s.name not in known):
            argv = [_real_run_dir(arg, self.run_dir) for arg in step.argv]
            srun = ["srun", f"--jobid={self.job_id}", "--overlap", f"--job-name={step.name}",
                    f"--nodes={len(step.nodes)}", f"--ntasks={step.num_tasks}",
                    f"--ntasks-per-node={step.tasks_per_node}", "-w", ",".join(nodes[n] for n in step.nodes),
                    f"--output={self.run_dir / 'logs' / f'{step.name}.log'}"]
            if step.num_tasks > 1:
                srun += ["--mpi=pmix", "--kill-on-bad-exit=1", "--label"]
            if step.gpus_per_node:
                srun.append(f"--gres=gpu:{step.gpus_per_node}")
                if step.gpu_bind:
                    srun.append(f"--gpu-bind={step.gpu_bind}")
            env = {**os.environ, **dict(step.env)}
            subprocess.Popen([*srun, *argv], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
            self.state.steps.append(SlurmStep(name=step.name, port=ports[step.name], ranks=step.num_tasks))
            started[step.name] = f":{ports[step.name]}"
        write_state(self.run_dir, self.state)
        print(f"{pool}: started {', '.join(started)} as steps of job {self.job_id}", flush=True)
        return started

    def retire(self, names: list[str]) -> None:
        from disagg.slurm_deployment import running_steps

        running = running_steps(self.job_id)
        steps = [running[name] for name in names if name in running]
        if steps:
            subprocess.run(["scancel", "--signal=TERM", *steps], check=True, timeout=30)
        deadline = time.monotonic() + STOP_SECONDS + 10
        while any(name in running_steps(self.job_id) for name in names):
            if time.monotonic() > deadline:
                raise LiveChangeError(f"the steps of {', '.join(names)} still run {STOP_SECONDS + 10:g} s after "
                                      "SIGTERM; `scancel` them")
            time.sleep(POLL_SECONDS)
        self.state.steps = [s for s in self.state.steps if s.name not in names]
        write_state(self.run_dir, self.state)
        print(f"{', '.join(names)}: stopped (its step ended)", flush=True)


def _real_run_dir(arg: str, run_dir: Path) -> str:
    """The plan's argv names the job's run dir as the batch script's variable: this one."""
    from slurm.plan import RUN_DIR

    return arg.replace(RUN_DIR, str(run_dir.resolve()))
