"""The rendered script on a real Slurm (slurm/dev_cluster.sh): every step runs, pinned and
concurrent; TP steps form one PMIx world; scancel reaches every step as SIGTERM."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_plans import local_plan

from slurm.config import SlurmConfig
from slurm.jobs import TERMINAL_STATES, cancel_job, job_in_queue, job_info, wait_for_state, wait_until_gone
from slurm.placement import WorkerPlacement
from slurm.rendezvous import create_cluster_key, read_nodes, wait_for_orchestrator_url
from slurm.submit import submit_script, submit_with_submitit, write_script

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(60)]

# Each step prints who it is and its MPI world, then sleeps (0: exits at once) until SIGTERM.
STEP_PROGRAM = """
import os, signal, sys, time
name, seconds = sys.argv[1], float(sys.argv[2])
signal.signal(signal.SIGTERM, lambda *_: (print(name, "got TERM", flush=True), sys.exit(0)))
print(name, "rank", os.environ.get("PMIX_RANK"), "of", os.environ["SLURM_NTASKS"],
      "in", os.environ["DISAGG_RUN_DIR"], flush=True)
time.sleep(seconds)
"""


def _plan(tmp_path: Path, seconds: float, job_name: str):
    slurm = SlurmConfig(nodes=1, cpus_per_node=4, job_name=job_name, time_limit="5",
                        run_root=str(tmp_path / "runs"))

    def step(name: str) -> list[str]:
        return [sys.executable, "-c", STEP_PROGRAM, name, str(seconds)]

    def worker(w: WorkerPlacement) -> list[str]:
        return step(w.name)

    return local_plan(slurm, gen_tp=2, orchestrator_argv=step("orchestrator"), worker_argv=worker)


def _logs(tmp_path: Path, job_name: str, job_id: int) -> dict[str, list[str]]:
    log_dir = tmp_path / "runs" / f"{job_name}-{job_id}" / "logs"
    return {p.stem: sorted(p.read_text().splitlines()) for p in log_dir.glob("*.log")}


@pytest.fixture
def jobs() -> Iterator[list[int]]:
    """Job ids a test submitted; cancelled afterwards whatever happened."""
    ids: list[int] = []
    yield ids
    for job_id in ids:
        if job_in_queue(job_id):
            cancel_job(job_id)
            wait_until_gone(job_id, timeout=20)


def test_rendered_script_runs_every_step(slurm_cluster: str, tmp_path: Path, jobs: list[int]) -> None:
    script = write_script(_plan(tmp_path, 0, "rt-steps"), tmp_path)
    jobs.append(job_id := submit_script(script, tmp_path))
    info = wait_for_state(job_id, TERMINAL_STATES, timeout=30)
    assert (info.state, info.exit_code, info.node_list) == ("COMPLETED", "0:0", slurm_cluster)
    run_dir = tmp_path / "runs" / f"rt-steps-{job_id}"
    assert (run_dir / "nodes").read_text() == f"{slurm_cluster}\n"
    key = run_dir / "cluster.key"  # made by the script: submitted by hand, nobody else made one
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(bytes.fromhex(key.read_text())) == 32
    assert _logs(tmp_path, "rt-steps", job_id) == {
        "orchestrator": [f"orchestrator rank 0 of 1 in {run_dir}"],
        "ctx-0": [f"ctx-0 rank 0 of 1 in {run_dir}"],
        # One PMIx world of two ranks (--label prefixes the rank), not two worlds of one.
        "gen-0": [f"0: gen-0 rank 0 of 2 in {run_dir}", f"1: gen-0 rank 1 of 2 in {run_dir}"],
    }
    assert (tmp_path / f"rt-steps-{job_id}.out").read_text() == \
        f"disagg: 3 steps started; run directory {run_dir}\n"


def test_scancel_reaches_every_step_as_sigterm(slurm_cluster: str, tmp_path: Path, jobs: list[int]) -> None:
    script = write_script(_plan(tmp_path, 60, "rt-term"), tmp_path)
    jobs.append(job_id := submit_script(script, tmp_path))
    assert wait_for_state(job_id, {"RUNNING"}, timeout=30).state == "RUNNING"
    deadline = time.monotonic() + 20
    while sum(len(lines) for lines in _logs(tmp_path, "rt-term", job_id).values()) < 4:  # all 4 tasks up
        assert time.monotonic() < deadline, _logs(tmp_path, "rt-term", job_id)
        time.sleep(0.1)
    cancel_job(job_id)
    wait_until_gone(job_id, timeout=20)
    assert job_info(job_id).state == "CANCELLED"
    logs = _logs(tmp_path, "rt-term", job_id)
    for name in ("orchestrator", "ctx-0"):
        assert f"{name} got TERM" in logs[name], logs[name]
    assert {"0: gen-0 got TERM", "1: gen-0 got TERM"} <= set(logs["gen-0"]), logs["gen-0"]


PUBLISH_PROGRAM = """
import os, signal, socket, sys, time
from pathlib import Path
from slurm.rendezvous import publish_orchestrator_url
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
publish_orchestrator_url(Path(os.environ["DISAGG_RUN_DIR"]), f"http://{socket.gethostname()}:8000")
time.sleep(60)
"""


def test_up_like_rendezvous_through_a_premade_run_dir(slurm_cluster: str, tmp_path: Path,
                                                      jobs: list[int]) -> None:
    """What `disagg up` does: make the run dir and key, submit with DISAGG_RUN_DIR, wait for the URL."""
    run_dir = tmp_path / "deployment"
    key = create_cluster_key(run_dir).read_text()
    plan = local_plan(SlurmConfig(nodes=1, cpus_per_node=4, job_name="rt-up", time_limit="5"),
                      orchestrator_argv=[sys.executable, "-c", PUBLISH_PROGRAM],
                      worker_argv=lambda w: [sys.executable, "-c", STEP_PROGRAM, w.name, "60"])
    script = write_script(plan, tmp_path)
    jobs.append(job_id := submit_script(script, tmp_path, env={"DISAGG_RUN_DIR": str(run_dir)}))
    url = wait_for_orchestrator_url(run_dir, timeout=30, still_waiting=lambda: job_in_queue(job_id))
    assert url == f"http://{slurm_cluster}:8000"
    assert read_nodes(run_dir) == [slurm_cluster] and (run_dir / "cluster.key").read_text() == key
    cancel_job(job_id)
    wait_until_gone(job_id, timeout=20)
    assert not (tmp_path / "disagg-runs").exists()  # everything went to the premade run dir


def test_submitit_runs_the_same_script(slurm_cluster: str, tmp_path: Path, jobs: list[int]) -> None:
    plan = _plan(tmp_path, 0, "rt-submitit")
    run_dir = tmp_path / "premade"
    jobs.append(job_id := submit_with_submitit(plan, tmp_path / "submitit", tmp_path,
                                               env={"DISAGG_RUN_DIR": str(run_dir)}))
    info = wait_for_state(job_id, TERMINAL_STATES, timeout=30)
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0")
    assert {p.stem: p.read_text() for p in (run_dir / "logs").glob("*.log")}["ctx-0"] == \
        f"ctx-0 rank 0 of 1 in {run_dir}\n"
    assert sorted(p.stem for p in (run_dir / "logs").glob("*.log")) == ["ctx-0", "gen-0", "orchestrator"]
    submission = (tmp_path / "submitit" / f"{job_id}_submission.sh").read_text()
    for line in ("#SBATCH --job-name=rt-submitit", "#SBATCH --time=5", "#SBATCH --signal=TERM@120",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --nodes=1"):
        assert line in submission.splitlines()
    assert (tmp_path / "submitit" / "rt-submitit.sbatch").read_text().startswith("#!/bin/bash\n")


def test_unknown_job_is_none(slurm_cluster: str) -> None:
    assert job_info(2**31 - 2) is None
    assert not job_in_queue(2**31 - 2)


DEV_CLUSTER = Path(__file__).parents[2] / "slurm" / "dev_cluster.sh"


def test_dev_cluster_status(slurm_cluster: str) -> None:
    if not Path("/tmp/disagg-slurm/slurm.conf").exists():
        pytest.skip("the Slurm here is not slurm/dev_cluster.sh's (no /tmp/disagg-slurm)")
    result = subprocess.run([str(DEV_CLUSTER), "status"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("slurmctld: running (pid ") and lines[1].startswith("slurmd: running (pid ")
    assert lines[2] == "SLURM_CONF=/tmp/disagg-slurm/slurm.conf"
    assert lines[4].split()[0] == slurm_cluster and lines[4].split()[2] == "16"  # advertised CPUs
