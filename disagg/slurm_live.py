"""``disagg drain | undrain`` of a Slurm deployment: the orchestrator drains, ``scancel`` stops the step.

A Slurm deployment has no supervisor process to ask: its workers are ``srun``
steps of one job (``disagg.slurm_deployment``). Draining goes through the
orchestrator exactly as for a local deployment (``disagg.live_change.Live``);
a worker is found by its step's port among the orchestrator's workers (as
``disagg status`` does), and stopping it is ``scancel --signal=TERM`` of its
step: the worker finishes what it holds, deregisters, and the step ends
(Slurm does not restart it). ``scale`` and ``reload`` are not available on
Slurm yet and say so.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from disagg.live_change import POLL_SECONDS, Live, LiveChangeError
from disagg.run_state import STOP_SECONDS, ProcessRecord, SlurmRunState

__all__ = ["slurm_live"]


def slurm_live(run_dir: Path, state: SlurmRunState, action: str) -> Live:
    """What ``action`` acts through; LiveChangeError for what Slurm deployments cannot do yet."""
    from disagg.deploy_status import cluster_workers
    from slurm.rendezvous import read_orchestrator_url

    if action not in ("drain", "undrain"):
        raise LiveChangeError(f"`disagg {action}` changes local deployments only; on Slurm, drain or undrain a "
                              "worker, or start one as a step that registers (docs/operations.md, Changing a "
                              "running deployment)")
    url = read_orchestrator_url(run_dir)
    if url is None:
        raise LiveChangeError(f"job {state.job_id}'s orchestrator has not published its URL in {run_dir}")
    by_port = {int(w.url.rstrip("/").rsplit(":", 1)[-1]): w.url for w in cluster_workers(url) or []}
    steps = [ProcessRecord(name=s.name, url=by_port.get(s.port, ""), pool=s.name.rsplit("-", 1)[0])
             for s in state.steps if s.name != "orchestrator"]
    return _SlurmLive(run_dir, url, steps, state.job_id)


class _SlurmLive(Live):
    def __init__(self, run_dir: Path, url: str, processes: list[ProcessRecord], job_id: int) -> None:
        super().__init__(run_dir, url, processes)
        self.job_id = job_id

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
        print(f"{', '.join(names)}: stopped (its step ended)", flush=True)
