"""A worker whose attached frontend is left down by its restart budget is `degraded` everywhere an
operator looks (issue 27, item 7): the worker's /health, the orchestrator's /cluster_info and
/metrics, and `disagg status` (text and JSON); it keeps serving meanwhile."""

from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import pytest
from test_up import disagg, write_deployment
from worker_process import free_port
from worker_procs import frontend_slots, wait_until

from workers.launcher import MAX_CRASHES_IN_WINDOW


def _gen_worker(run) -> tuple[int, str]:
    (gen,) = [p for p in json.loads((run / "state.json").read_text())["processes"] if p["name"] == "gen-0"]
    return gen["pid"], gen["url"]


def _answered_by(worker_url: str) -> set[str]:
    with httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        return {http.get(f"{worker_url}/health").headers["x-disagg-frontend"] for _ in range(8)}


def _degraded_gauge(url: str) -> dict[str, float]:
    return {line.split('worker_role="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("disagg_orchestrator_worker_degraded{")}


@pytest.mark.slow
def test_a_frontend_left_down_makes_its_worker_degraded_everywhere(tmp_path):
    port = free_port()
    config = write_deployment(tmp_path, "degraded", port=port, gen_frontends=2)
    run, url = tmp_path / "run", f"http://127.0.0.1:{port}"
    up = disagg("up", config, cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
        launcher, worker_url = _gen_worker(run)
        assert httpx.get(f"{worker_url}/health").json() == {"status": "ok"}
        assert _degraded_gauge(url) == {"ctx": 0.0, "gen": 0.0}
        # Kill frontend 1 until the launcher's budget (workers.launcher) gives up on it.
        # Each time once it serves: a frontend killed while starting fails the worker's start instead.
        for crash in range(MAX_CRASHES_IN_WINDOW):
            wait_until(lambda: "1" in _answered_by(worker_url), 30)
            pid = frontend_slots(launcher)[1]
            os.kill(pid, signal.SIGKILL)
            if crash < MAX_CRASHES_IN_WINDOW - 1:
                wait_until(lambda killed=pid: frontend_slots(launcher).get(1, killed) != killed, 20)
        wait_until(lambda: httpx.get(f"{worker_url}/health").json()["status"] == "degraded", 10)
        assert httpx.get(f"{worker_url}/health").json() == {"status": "degraded", "frontends_left_down": [1],
                                                            "num_frontends": 2}

        def gen_record() -> dict:
            (gen,) = [w for w in httpx.get(f"{url}/cluster_info").json()["workers"] if w["role"] == "gen"]
            return gen

        wait_until(lambda: gen_record()["degraded"], 10)
        assert gen_record()["healthy"] is True  # still routed to: it serves on frontend 0
        assert _degraded_gauge(url) == {"ctx": 0.0, "gen": 1.0}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=str(tmp_path / "model"), prompt="still serving", max_tokens=3)
        assert answer.usage.completion_tokens == 3

        status = disagg("status", "--run-dir", str(run), cwd=tmp_path)
        assert status.returncode == 0, status.stdout + status.stderr
        (line,) = [line for line in status.stdout.splitlines() if " gen " in line and worker_url in line]
        assert "DEGRADED" in line, status.stdout
        view = json.loads(disagg("status", "--json", "--run-dir", str(run), cwd=tmp_path).stdout)
        assert {w["role"]: w["degraded"] for w in view["workers"]} == {"ctx": False, "gen": True}
    finally:
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
