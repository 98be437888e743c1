"""`disagg up` with `pools.*.tensor_parallel_size: 2` (launcher: local), torch engine: every worker
runs 2 ranks, requests through the orchestrator (a ctx leg on a TP-2 worker, a gen leg on another)
give the tokens of a plain request, and `disagg down` leaves no rank behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest

from common.processes import pid_alive
from tests.worker_process import free_port
from tests.workers.test_tp_worker import _children, _cmdline


def disagg(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_up_with_tp2_pools_serves_and_down_leaves_no_rank(tmp_path):
    port = free_port()
    config = tmp_path / "tp.yaml"
    config.write_text(textwrap.dedent(f"""
        model: tiny
        tiny_model_size: test
        run_dir: {tmp_path / "run"}
        engine: {{kind: torch, device: cpu, block_size: 4, num_blocks: 512}}
        orchestrator: {{port: {port}, processes: 1, conditional: {{enabled: false}}}}
        pools:
          ctx: {{instances: 1, frontends: 1, tensor_parallel_size: 2}}
          gen: {{instances: 1, frontends: 1, tensor_parallel_size: 2}}
        startup_timeout_seconds: 300
    """))
    run = tmp_path / "run"
    up = disagg("up", str(config), cwd=tmp_path)
    ranks: list[int] = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
        state = json.loads((run / "state.json").read_text())
        workers = {p["name"]: p for p in state["processes"]}
        for name in ("ctx-0", "gen-0"):
            followers = [p for p in _children(workers[name]["pid"]) if "workers.rank_follower" in _cmdline(p)]
            assert len(followers) == 1, name
            ranks += followers
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        ctx_url = next(w["url"] for w in state["processes"] if w["name"] == "ctx-0")
        for prompt in ("hello there, how are you doing today my friend", "the quick brown fox jumps over it"):
            body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            raw = client.completions.with_raw_response.create(**body, extra_body={"ignore_eos": True})
            assert raw.headers["x-disagg-mode"] == "disagg"
            worker_key = {"Authorization": f"Bearer {(run / 'worker.key').read_text()}"}  # a worker's every caller
            plain = httpx.post(f"{ctx_url}/v1/completions", json={**body, "ignore_eos": True}, headers=worker_key,
                               timeout=60).json()
            assert raw.parse().choices[0].text == plain["choices"][0]["text"]
    finally:
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 10
    while [p for p in ranks if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in ranks if pid_alive(p)] == []
