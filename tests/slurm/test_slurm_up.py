"""`disagg up --launcher slurm` of configs/dsv4-scaled.yaml on a real Slurm, then status, a killed
worker step, down; and an `up` that cannot become healthy. Real sbatch (through submitit), real
srun steps, real HTTP through the official openai client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from slurm_processes import processes_mentioning

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SCALED = REPO / "configs" / "dsv4-scaled.yaml"
ORCHESTRATOR_PORT = 18000  # configs/dsv4-scaled.yaml


def _disagg(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    # The job inherits this environment (sbatch --export=ALL): the venv's python first on PATH.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _job_ids(name: str) -> list[str]:
    result = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, timeout=30)
    return result.stdout.split()


@pytest.fixture(scope="module")
def deployment(slurm_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    run_dir = tmp_path_factory.mktemp("dsv4-scaled")
    up = _disagg("up", str(SCALED), "--launcher", "slurm", "--run-dir", str(run_dir))
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"ready on http://{socket.gethostname()}:{ORCHESTRATOR_PORT} (job " in up.stdout
    yield run_dir
    _disagg("down", "--run-dir", str(run_dir))


def _client() -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{socket.gethostname()}:{ORCHESTRATOR_PORT}/v1", api_key="unused",
                         max_retries=0, timeout=30)


def test_up_serves_through_the_orchestrator_and_status_shows_every_step(deployment: Path) -> None:
    client = _client()
    model = client.models.list().data[0].id
    for i in range(3):
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"hi {i}"}],
                                              max_tokens=5)
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    assert (deployment / "cluster.key").stat().st_mode & 0o777 == 0o600
    # The in-flight counts reach status through the orchestrator's state snapshots and health
    # rounds: settled within a round or two, not at once on a loaded machine.
    deadline = time.monotonic() + 15
    while True:
        status = _disagg("status", "--run-dir", str(deployment))
        assert status.returncode == 0, status.stdout + status.stderr
        *lines, metrics = status.stdout.splitlines()
        lines = [line for line in lines if not line.startswith(" " * 17)]  # each worker's nodes and ranks
        settled = all(line.endswith("healthy; in flight 0") and "UNHEALTHY" not in line for line in lines[2:])
        if settled or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert " RUNNING (None) on " in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["orchestrator", "ctx-0", "ctx-1", "gen-0"]
    assert all(" running " in line for line in lines[1:])
    assert settled, status.stdout
    node = status.stdout.split(" RUNNING (None) on ")[1].split(",")[0]
    assert status.stdout.count(f"\n{' ' * 17}1 rank on {node}\n") == 3  # every worker's nodes and ranks
    assert f"prometheus --config.file={deployment.resolve() / 'prometheus.yml'}" in metrics
    # The orchestrator writes every registered worker into the Prometheus target file.
    targets = json.loads((deployment / "prometheus" / "targets" / "workers.json").read_text())
    assert sorted(group["labels"]["role"] for group in targets) == ["ctx", "ctx", "gen"]
    view = json.loads(_disagg("status", "--json", "--run-dir", str(deployment)).stdout)
    assert view["launcher"] == "slurm" and view["running"] and len(view["workers"]) == 3
    assert [p["state"] for p in view["processes"]] == ["running"] * 4
    assert [(p["nodes"], p["ranks"]) for p in view["processes"]] == [(node, 1)] * 4
    logs = _disagg("logs", "ctx-0", "--run-dir", str(deployment))
    assert logs.returncode == 0 and "registered with http://" in logs.stdout


def test_every_worker_step_requires_the_deployments_worker_key(deployment: Path) -> None:
    key_file = deployment / "worker.key"
    assert key_file.stat().st_mode & 0o777 == 0o600  # made with the cluster key, before the job
    worker_key = key_file.read_text()
    workers = _workers_by_port()
    assert len(workers) == 3 and all(w["healthy"] and w["block_size"] for w in workers.values())
    for worker in workers.values():  # each a srun step on the node, reached over the network
        url = worker["url"]
        for path in ("/metrics", "/kv_cache_events", "/worker_info", "/prometheus/metrics", "/v1/models"):
            refused = httpx.get(url + path, timeout=10)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", (url, path)
            assert httpx.get(url + path, headers={"Authorization": f"Bearer {worker_key}"},
                             timeout=10).status_code == 200, (url, path)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    # The steps were given the file, never the key: no command line holds it, no log line either.
    steps = processes_mentioning(str(deployment))
    assert steps and not [line for line in steps if worker_key in line]
    assert not [log for log in (deployment / "logs").glob("*.log") if worker_key in log.read_text(errors="replace")]
    # status (above), and the requests through the orchestrator: the orchestrator presents the key.
    client = _client()
    done = client.completions.create(model=client.models.list().data[0].id, prompt="keyed", max_tokens=3)
    assert done.choices[0].finish_reason == "length"


def test_killed_worker_step_is_reported_and_routed_around(deployment: Path) -> None:
    from disagg.slurm_deployment import running_steps

    job_id = int((deployment / "slurm.json").read_text().split('"job_id": ')[1].split(",")[0])
    step_id = running_steps(job_id)["ctx-1"]
    subprocess.run(["scancel", "--signal=KILL", step_id], check=True, timeout=30)
    deadline = time.monotonic() + 15
    while True:
        status = _disagg("status", "--run-dir", str(deployment))
        ctx1 = next(line for line in status.stdout.splitlines() if line.split()[:1] == ["ctx-1"])
        if "step ENDED" in ctx1 and "not in the orchestrator's rotation" in ctx1:
            break
        assert time.monotonic() < deadline, status.stdout
        time.sleep(0.5)
    assert "ctx-0          step " in status.stdout and status.stdout.count(" healthy; ") == 2
    client = _client()
    for i in range(4):  # every request lands on ctx-0 now
        done = client.completions.create(model=client.models.list().data[0].id, prompt=f"after {i}", max_tokens=3)
        assert done.choices[0].finish_reason == "length"


def _workers_by_port() -> dict[int, dict]:
    url = f"http://{socket.gethostname()}:{ORCHESTRATOR_PORT}"
    workers = httpx.get(f"{url}/cluster_info", timeout=10).json()["workers"]
    return {int(w["url"].rsplit(":", 1)[1]): w for w in workers}


def test_drain_keep_then_undrain_a_worker_step(deployment: Path) -> None:
    drain = _disagg("drain", "ctx-0", "--keep", "--run-dir", str(deployment))  # ctx-1 was killed above
    assert drain.returncode == 1 and "no ctx worker in the rotation" in drain.stderr, drain.stdout + drain.stderr
    drain = _disagg("drain", "gen-0", "--keep", "--force", "--run-dir", str(deployment))
    assert drain.returncode == 0 and "gen-0: draining" in drain.stdout, drain.stdout + drain.stderr
    assert _workers_by_port()[18200]["draining"]
    status = _disagg("status", "--run-dir", str(deployment))
    assert "drained; in flight 0" in status.stdout, status.stdout
    undrain = _disagg("undrain", "gen-0", "--run-dir", str(deployment))
    assert undrain.returncode == 0, undrain.stdout + undrain.stderr
    assert not _workers_by_port()[18200]["draining"]
    refused = _disagg("reload", "--run-dir", str(deployment))
    assert refused.returncode == 1 and "local deployments only" in refused.stderr


def test_scale_out_as_a_new_step_then_back_in(deployment: Path) -> None:
    from disagg.slurm_deployment import running_steps

    job_id = int((deployment / "slurm.json").read_text().split('"job_id": ')[1].split(",")[0])
    full = _disagg("scale", "ctx", "150", "--run-dir", str(deployment))  # its ports would run into gen's
    assert full.returncode == 1 and "the allocation has no room for 150 ctx workers" in full.stderr, full.stderr
    out = _disagg("scale", "gen", "2", "--run-dir", str(deployment))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gen-1" in running_steps(job_id) and _workers_by_port()[18201]["healthy"]
    client = _client()
    served = set()
    for i in range(8):  # least_load spreads sequential requests over both gen workers
        raw = client.completions.with_raw_response.create(model=client.models.list().data[0].id,
                                                          prompt=f"scaled {i}", max_tokens=3)
        served.add(raw.headers["x-disagg-gen-worker"])
    assert _workers_by_port()[18201]["worker_id"] in served
    status = _disagg("status", "--run-dir", str(deployment))
    assert "\n  gen-1 " in status.stdout, status.stdout
    back = _disagg("scale", "gen", "1", "--run-dir", str(deployment))
    assert back.returncode == 0 and "gen-1: stopped (its step ended)" in back.stdout, back.stdout + back.stderr
    assert "gen-1" not in running_steps(job_id) and 18201 not in _workers_by_port()
    assert "gen-1" not in (deployment / "slurm.json").read_text()


def test_drain_stops_a_worker_step(deployment: Path) -> None:
    from disagg.slurm_deployment import running_steps

    job_id = int((deployment / "slurm.json").read_text().split('"job_id": ')[1].split(",")[0])
    drain = _disagg("drain", "ctx-0", "--force", "--run-dir", str(deployment))
    assert drain.returncode == 0 and "ctx-0: stopped (its step ended)" in drain.stdout, drain.stdout + drain.stderr
    assert "ctx-0" not in running_steps(job_id)
    assert 18100 not in _workers_by_port()  # it deregistered as it stopped


def test_down_cancels_the_job_and_leaves_nothing_running(deployment: Path) -> None:
    down = _disagg("down", "--run-dir", str(deployment))
    assert down.returncode == 0, down.stderr
    assert _job_ids("dsv4-scaled") == []
    assert processes_mentioning(str(deployment)) == []
    assert sorted(p.name for p in deployment.iterdir()) == ["logs", "model"]
    status = _disagg("status", "--run-dir", str(deployment))
    assert status.returncode == 1


def test_cancelled_job_is_reported_as_cancelled(slurm_cluster: str, tmp_path: Path) -> None:
    # After test_down (which frees the ports) when the module runs in order; alone it is fine too.
    run_dir = tmp_path / "run"
    up = _disagg("up", str(SCALED), "--run-dir", str(run_dir))
    assert up.returncode == 0, up.stdout + up.stderr
    job_id = _job_ids("dsv4-scaled")[0]
    subprocess.run(["scancel", job_id], check=True, timeout=30)  # an operator's scancel, not `disagg down`
    deadline = time.monotonic() + 30
    while f"job {job_id} CANCELLED " not in (status := _disagg("status", "--run-dir", str(run_dir))).stdout:
        assert time.monotonic() < deadline, status.stdout
        time.sleep(0.3)
    assert status.returncode == 1
    assert status.stdout.splitlines()[1] == "  the job was cancelled; `disagg down` cleans up, `disagg up` restarts"
    assert _disagg("down", "--run-dir", str(run_dir)).returncode == 0
    assert _job_ids("dsv4-scaled") == [] and processes_mentioning(str(run_dir)) == []


def _failing_config(tmp_path: Path, name: str, **replace: str) -> Path:
    text = SCALED.read_text().replace("job_name: dsv4-scaled", f"job_name: {name}")
    for old, new in replace.items():
        text = text.replace(old, new)
    config = tmp_path / f"{name}.yaml"
    config.write_text(text)
    return config


def test_up_whose_orchestrator_dies_cancels_its_job_and_shows_its_log(slurm_cluster: str, tmp_path: Path) -> None:
    config = _failing_config(tmp_path, "dsv4-fail")
    run_dir = tmp_path / "run"
    with socket.socket() as taken:  # the orchestrator's port is taken: it cannot start
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("0.0.0.0", ORCHESTRATOR_PORT))
        taken.listen()
        up = _disagg("up", str(config), "--run-dir", str(run_dir))
    assert up.returncode == 1
    assert "disagg up: the orchestrator step ended before it answered; cancelling job " in up.stderr
    assert f"==> {run_dir / 'logs' / 'orchestrator.log'} (last 20 lines) <==" in up.stderr
    assert "Address already in use" in up.stderr
    assert _job_ids("dsv4-fail") == []
    assert processes_mentioning(str(run_dir)) == []


def test_up_that_times_out_cancels_its_job(slurm_cluster: str, tmp_path: Path) -> None:
    # The batch shell hangs in its environment setup: RUNNING, but no step ever starts.
    config = _failing_config(tmp_path, "dsv4-hang", **{"startup_timeout_seconds: 120": "startup_timeout_seconds: 3",
                                                        "  env_setup: |\n": "  env_setup: |\n    sleep 300\n"})
    run_dir = tmp_path / "run"
    up = _disagg("up", str(config), "--run-dir", str(run_dir))
    assert up.returncode == 1
    assert "disagg up: not healthy after 3 s; cancelling job " in up.stderr
    assert f"==> {run_dir / 'logs' / 'orchestrator.log'} (last 20 lines) <==\n(no log)" in up.stderr
    assert _job_ids("dsv4-hang") == []
    assert sorted(p.name for p in run_dir.iterdir()) == ["logs"]
