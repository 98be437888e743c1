"""The emulated multi-node Slurm (slurm/dev_cluster.sh up --nodes N --gpus-per-node G): steps land on
the nodes asked for with their fake GPUs, and a worker's TP step finds its ranks (slurm.ranks) under
`srun --mpi=pmix` through mpi4py, and without MPI through Slurm's variables; rank 0's broadcast
address is where the other ranks really reach it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from slurm.jobs import TERMINAL_STATES, JobInfo, cancel_job, job_in_queue, wait_for_state, wait_until_gone
from slurm.rendezvous import publish_orchestrator_url
from slurm.submit import submit_script

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(200)]

PLACEMENT_SCRIPT = """#!/bin/bash
#SBATCH --nodes=4
#SBATCH --gpus-per-node=4
#SBATCH --time=2
srun --overlap --nodes=1 --ntasks=1 -w n2 --gres=gpu:2 --exact --output=%x-a.txt \\
    bash -c 'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"' &
srun --overlap --nodes=2 --ntasks=4 --ntasks-per-node=2 -w n0,n3 --output=%x-b.txt --label \\
    bash -c 'echo "$SLURMD_NODENAME $SLURM_LOCALID $CUDA_VISIBLE_DEVICES"' &
wait
"""

# Every rank reports its DISAGG_TP_* view; the followers connect to rank 0's advertised address
# and rank 0 prints who reached it.
RANK_PROGRAM = """
import os, socket, sys
env = {k[len("DISAGG_TP_"):]: v for k, v in os.environ.items() if k.startswith("DISAGG_TP_")}
rank, size = int(env["RANK"]), int(env["SIZE"])
print("rank", rank, "of", size, "local", env["LOCAL_RANK"], "on", os.environ["SLURMD_NODENAME"],
      "gpus", os.environ.get("CUDA_VISIBLE_DEVICES"), "registers" if "--register-url" in sys.argv else "follows",
      flush=True)
addr = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
if rank == 0:
    server = socket.create_server(("0.0.0.0", addr[1]))
    peers = []
    for _ in range(size - 1):
        conn, _ = server.accept()
        peers.append(conn.makefile().readline().strip())
    print("reached by", " ".join(sorted(peers, key=lambda p: int(p.split("@")[0]))), flush=True)
else:
    import time
    for _ in range(200):
        try:
            with socket.create_connection(addr, timeout=5) as conn:
                conn.sendall(f"{rank}@{os.environ['SLURMD_NODENAME']}\\n".encode())
            break
        except OSError:
            time.sleep(0.05)
"""


def _run_job(tmp_path: Path, script_text: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    info = _finished_job(tmp_path, script_text, env, monkeypatch)
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), (info, _outputs(tmp_path))


def _finished_job(tmp_path: Path, script_text: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> JobInfo:
    """Submit the script from ``tmp_path`` and wait until the job has ended (cancelled if it does not)."""
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])  # slurm.jobs' scontrol/squeue use this environment
    script = tmp_path / "job.sbatch"
    script.write_text(script_text)
    job_id = submit_script(script, tmp_path, env=env)  # SLURM_CONF, and e.g. DISAGG_RUN_DIR
    try:
        # Longer than slurm.ranks' MPI watchdog: a stuck rank shows its log line here.
        return wait_for_state(job_id, TERMINAL_STATES, timeout=150)
    finally:
        if job_in_queue(job_id):
            cancel_job(job_id)
            wait_until_gone(job_id, timeout=20)


def _outputs(tmp_path: Path) -> dict[str, list[str]]:
    return {p.name: sorted(p.read_text().splitlines()) for p in tmp_path.glob("*.txt")}


def test_steps_land_on_the_chosen_nodes_with_their_gpus(emulated_cluster: dict[str, str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _run_job(tmp_path, PLACEMENT_SCRIPT, emulated_cluster, monkeypatch)
    assert _outputs(tmp_path) == {
        "job.sbatch-a.txt": ["n2 0,1"],  # --gres=gpu:2 --exact: two of the node's four
        "job.sbatch-b.txt": ["0: n0 0 0,1,2,3", "1: n0 1 0,1,2,3", "2: n3 0 0,1,2,3", "3: n3 1 0,1,2,3"],
    }


def _tp_step_script(run_dir: Path, mpi: str) -> str:
    worker = [sys.executable, "-m", "slurm.step", "worker", "--run-dir", str(run_dir), "--",
              sys.executable, "-c", RANK_PROGRAM, "--port", "18931"]
    command = " ".join(map(shlex.quote, worker))
    return (f"#!/bin/bash\n#SBATCH --nodes=4\n#SBATCH --gpus-per-node=4\n#SBATCH --time=2\n"
            f"srun --overlap --job-name=gen-0 --nodes=2 --ntasks=6 --ntasks-per-node=3 -w n1,n3 --mpi={mpi} "
            f"--kill-on-bad-exit=1 --output=%x-ranks.txt --label {command}\n")


@pytest.mark.parametrize("mpi", ["pmix", "none"])
def test_a_tp_step_finds_its_ranks_and_rank_0(emulated_cluster: dict[str, str], tmp_path: Path, mpi: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # One more try when a rank's MPI_Init hangs in a cross-node PMIx fence of the emulated cluster
    # (every emulated node's slurmstepd on one host; seen in a loaded CI run, as in
    # test_emulated_tp's fixture): the rank watchdog ends that step before every rank was found.
    # Any other failure, or the same hang twice, fails the test.
    for attempt in range(2):
        job_dir = tmp_path / f"attempt-{attempt}"
        run_dir = job_dir / "run"
        run_dir.mkdir(parents=True)
        publish_orchestrator_url(run_dir, "http://orchestrator.invalid:1")  # rank 0 waits for it, then registers
        info = _finished_job(job_dir, _tp_step_script(run_dir, mpi), emulated_cluster, monkeypatch)
        found = sum("(found through" in line for line in _outputs(job_dir).get("job.sbatch-ranks.txt", []))
        if info.state == "COMPLETED" or attempt == 1 or mpi != "pmix" or found == 6:
            break
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), (info, _outputs(job_dir))
    lines = _outputs(job_dir)["job.sbatch-ranks.txt"]
    reports = sorted(line.split(": ", 1)[1] for line in lines if " rank " in line and " of 6 local " in line)
    assert reports == [
        "rank 0 of 6 local 0 on n1 gpus 0,1,2,3 registers",
        *[f"rank {r} of 6 local {r % 3} on {'n1' if r < 3 else 'n3'} gpus 0,1,2,3 follows" for r in range(1, 6)],
    ], lines
    assert "0: reached by 1@n1 2@n1 3@n3 4@n3 5@n3" in lines, lines
    via = "mpi" if mpi == "pmix" else "slurm"
    assert sum(f"(found through {via})" in line for line in lines) == 6, lines
    assert not [line for line in lines if "Sorry!" in line or "not-valid" in line], lines  # no PMIx noise
    table = json.loads((run_dir / "ranks" / "gen-0.json").read_text())
    assert table["world_size"] == 6 and table["via"] == via
    if mpi == "pmix":  # the allgather knows every rank's node; Slurm's variables only this one's
        assert table["nodes"] == ["n1", "n1", "n1", "n3", "n3", "n3"]


def test_status_lists_every_emulated_slurmd(emulated_cluster: dict[str, str]) -> None:
    script = Path(__file__).parents[2] / "slurm" / "dev_cluster.sh"
    result = subprocess.run([str(script), "status", "--emulated"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    nodes = lines.index("SLURM_CONF=/tmp/disagg-slurm-emu/slurm.conf") - 1  # slurmctld, then a slurmd a node
    assert nodes >= 4 and lines[0].startswith("slurmctld: running (pid ")
    assert [line.split(":")[0] for line in lines[1:nodes + 1]] == [f"slurmd-n{i}" for i in range(nodes)]
    assert [line.split() for line in lines[nodes + 3:2 * nodes + 3]] == \
        [[f"n{i}", "idle", "8", "1500"] for i in range(nodes)]  # CPUs=8 RealMemory=1500 per node


# Each task of a rendered worker step says which GPUs it sees (Slurm's CUDA_VISIBLE_DEVICES, or the
# mask slurm.step applied to a one-task step).
GPU_PROGRAM = """
import os
print("sees", os.environ["SLURM_JOB_NAME"], os.environ.get("DISAGG_TP_RANK", "0"), os.environ.get("CUDA_VISIBLE_DEVICES"),
      flush=True)
"""


def test_a_rendered_step_sees_the_gpus_it_asked_slurm_for(emulated_cluster: dict[str, str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_plans import narrow_plan

    from slurm.render import render_script

    def worker_argv(worker) -> list[str]:
        return [sys.executable, "-m", "slurm.step", "worker", "--run-dir", "{run_dir}", "--", sys.executable, "-c",
                GPU_PROGRAM]

    script = render_script(narrow_plan(worker_argv, orchestrator_argv=["true"]))
    assert "CUDA_VISIBLE_DEVICES=" not in script  # no step sets it: Slurm does
    # The same retry as the TP test above: a rank's MPI_Init may hang once in the emulated PMIx fence.
    for attempt in range(2):
        job_dir = tmp_path / f"attempt-{attempt}"
        run_dir = job_dir / "run"
        run_dir.mkdir(parents=True)
        publish_orchestrator_url(run_dir, "http://orchestrator.invalid:1")
        info = _finished_job(job_dir, script, {**emulated_cluster, "DISAGG_RUN_DIR": str(run_dir)}, monkeypatch)
        if info.state == "COMPLETED":
            break
    logs = {p.stem: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), (info, logs)
    seen = sorted(line.split("sees ", 1)[1] for text in logs.values() for line in text.splitlines() if "sees " in line)
    assert seen == [
        "ctx-0 0 0,1", "ctx-0 1 0,1",  # the node's first two: both ranks see them, the local rank picks
        "ctx-1 0 2", "ctx-1 1 3",  # beside ctx-0 on the node: Slurm binds each rank to its own
        "gen-0 0 0",
        "gen-1 0 1",  # one task beside gen-0: slurm.step applies the mask Slurm would not
    ], logs
