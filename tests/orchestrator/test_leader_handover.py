"""The shared state outlives its owner (issue 27 item 3): real processes, a real SIGKILL of the leader.

Before the kill: a registered worker beside the static one, a drained worker, a changed live
setting, a stored response and a Message Batch. After it, through the surviving processes: another
process leads, and every one of those is as it was; the batch completes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator, wait_until
from worker_process import start_worker, stop_worker

from common.processes import pid_alive
from orchestrator.leadership import read_leader

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, 1)
    yield url
    stop_worker(proc)


def _get(url: str, path: str) -> httpx.Response:
    with httpx.Client(timeout=30) as client:  # a fresh connection: any surviving process answers
        return client.get(url + path)


def test_the_state_survives_the_leaders_death(tmp_path, tiny_model_dir, worker):
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, [("both", worker), ("both", "http://127.0.0.1:9")],
                                   processes=3, conditional={"enabled": False})
    state_dir = Path(tmp_path) / f"orch-{url.rsplit(':', 1)[1]}"
    try:
        registered = httpx.post(f"{url}/workers/register", timeout=30,
                                json={"role": "gen", "url": "http://127.0.0.1:10"}).json()["worker_id"]
        drained = httpx.post(f"{url}/workers/drain", timeout=30, json={"worker": "http://127.0.0.1:9"})
        assert drained.status_code == 200 and drained.json()["worker"]["draining"], drained.text
        settings = httpx.post(f"{url}/settings", timeout=30, json={"timeouts": {"idle_seconds": 42}})
        assert settings.status_code == 200, settings.text
        response = httpx.post(f"{url}/v1/responses", timeout=30, json={
            "model": "tiny-test", "input": "hello", "max_output_tokens": 4}).json()
        batch = httpx.post(f"{url}/v1/messages/batches", timeout=30, json={"requests": [
            {"custom_id": f"r{i}", "params": {"model": "tiny-test", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hi"}]}} for i in range(8)]})
        assert batch.status_code == 200, batch.text
        before = {w["worker_id"]: w for w in _get(url, "/workers").json()["workers"]}

        leader = read_leader(state_dir)
        assert leader is not None and pid_alive(leader[1])
        os.kill(leader[1], signal.SIGKILL)
        wait_until(lambda: (now := read_leader(state_dir)) is not None and now[1] != leader[1], 10)

        after = {w["worker_id"]: w for w in _get(url, "/workers").json()["workers"]}
        assert after.keys() == before.keys() and registered in after
        assert after["static-1"]["draining"] and not after["static-0"]["draining"]
        assert after["static-0"]["healthy"], "the healthy worker stays in the rotation"
        assert _get(url, "/settings").json()["settings"]["timeouts"]["idle_seconds"] == 42
        assert _get(url, f"/v1/responses/{response['id']}").json()["id"] == response["id"]
        done = wait_until(lambda: (b := _get(url, f"/v1/messages/batches/{batch.json()['id']}").json())
                          ["processing_status"] == "ended" and b, 60)
        assert done["request_counts"]["succeeded"] == 8, done
        assert "took over the shared state" in Path(proc.log_path).read_text()
    finally:
        assert stop_orchestrator(proc, 60) == 0
