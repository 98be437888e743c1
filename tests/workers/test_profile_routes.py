"""POST /start_profile and /stop_profile on a torch worker: a trace file in --profile-dir."""

from __future__ import annotations

import os

import httpx
from worker_process import start_worker, stop_worker


def test_the_profiler_writes_a_trace_through_any_frontend(tiny_model_dir, tmp_path):
    trace_dir = tmp_path / "traces"
    url, proc = start_worker(tiny_model_dir, num_frontends=2, engine="torch",
                             extra_args=["--profile-dir", str(trace_dir)])
    try:
        with httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            started = http.post("/start_profile")
            assert started.status_code == 200, started.text
            again = http.post("/start_profile")
            assert again.status_code == 400 and "already" in again.json()["error"]["message"], again.text
            r = http.post("/v1/completions", json={"model": "tiny-test", "prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200, r.text
            stopped = http.post("/stop_profile")
            assert stopped.status_code == 200, stopped.text
    finally:
        assert stop_worker(proc) == 0
    trace = stopped.json()["trace"]
    assert trace is not None and os.path.dirname(os.path.abspath(trace)).startswith(str(trace_dir))
    assert os.path.getsize(trace) > 0
    assert [n for n in os.listdir(proc.ipc_root) if n.startswith("disagg-")] == []
