"""Faults through the orchestrator (docs/operations.md, "Recover"): timeouts, client disconnects, dead workers.

Two slow synthetic workers (50 ms per decode step). Health checks run once at
start (interval 60 s), so a worker killed during the test stays in the
rotation and the request path itself must cope. The tests run in file order:
the last two kill the workers.
"""

from __future__ import annotations

import signal
import time

import httpx
import msgspec
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import start_worker, stop_worker

SLOW = ["--synthetic-decode-step-seconds", "0.05"]


@pytest.fixture(scope="module")
def faults(tiny_model_dir, tmp_path_factory):
    workers = [start_worker(tiny_model_dir, 1, extra_args=SLOW) for _ in range(2)]
    url, proc = start_orchestrator(tmp_path_factory.mktemp("faults"), tiny_model_dir,
                                   [("both", w_url) for w_url, _ in workers], processes=1,
                                   health={"interval_seconds": 60.0}, timeouts={"request_seconds": 2.0},
                                   max_retries=1)
    yield url, workers
    assert stop_orchestrator(proc) == 0
    for _, worker in workers:
        stop_worker(worker)


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny-test", "prompt": "once upon a time", "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True}


def test_request_timeout_is_504_or_a_final_error_event(faults):
    url, _ = faults
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json=body(200), timeout=30)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    assert 1.9 < time.monotonic() - started < 5
    with httpx.stream("POST", f"{url}/v1/completions", json=body(200, stream=True), timeout=30) as stream:
        frames = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(frames) > 5  # tokens flowed before the deadline
    assert msgspec.json.decode(frames[-2][6:])["error"]["code"] == "timeout" and frames[-1] == "data: [DONE]"
    # The request's own deadline, not the worker's failure: the stream did not move, nobody is suspect
    # (uvloop's timer fires just before the clock reaches the deadline: it once looked like a failure).
    assert _sample(url, MIGRATIONS) == 0.0
    served = {httpx.post(f"{url}/v1/completions", json=body(1), timeout=30).headers["x-disagg-gen-worker"]
              for _ in range(2)}
    assert served == {"static-0", "static-1"}  # round robin: neither worker is suspect


def _running_steps(worker_url: str) -> int:
    """Engine steps with a running request since the last drain of the worker's /metrics."""
    stats = httpx.get(f"{worker_url}/metrics").json()
    return sum(1 for step in stats if step["num_running"] > 0)


def _sample(url: str, series: str) -> float:
    """One series' value on the orchestrator's /metrics (0 when absent)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


MIGRATIONS = 'disagg_orchestrator_migrations_total{outcome="moved"}'
DISCONNECTS = 'disagg_orchestrator_client_disconnects_total{phase="gen"}'
STREAM_ERRORS = 'disagg_orchestrator_errors_total{kind="stream",phase="gen"}'


def test_client_disconnect_aborts_the_worker_request(faults):
    url, workers = faults
    disconnects, errors = _sample(url, DISCONNECTS), _sample(url, STREAM_ERRORS)
    with httpx.stream("POST", f"{url}/v1/completions", json=body(1000, stream=True), timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        worker = stream.headers["x-disagg-gen-worker"]
        assert _sample(url, "disagg_orchestrator_requests_in_flight") == 1.0  # this stream's gen leg
    worker_url = workers[int(worker.split("-")[1])][0]
    time.sleep(0.5)
    _running_steps(worker_url)  # drain what ran until the abort
    time.sleep(0.5)
    assert _running_steps(worker_url) == 0  # 1000 tokens at 50 ms/step would still be running
    info = httpx.get(f"{url}/cluster_info").json()
    assert all(w["in_flight_requests"] == 0 for w in info["workers"])
    # The client's leaving is counted as a disconnect, not as a failed stream.
    assert _sample(url, STREAM_ERRORS) == errors
    assert _sample(url, DISCONNECTS) == disconnects + 1
    assert _sample(url, "disagg_orchestrator_requests_in_flight") == 0.0


def test_dead_worker_is_retried_before_the_first_byte(faults):
    url, workers = faults
    stop_worker(workers[0][1])  # static-0: still "healthy" for the orchestrator (no health check yet)
    for i, stream in enumerate((False, True, False)):
        response = httpx.post(f"{url}/v1/completions", json=body(3, stream=stream), timeout=30,
                              headers={"x-request-id": f"retry-{i}"})
        assert response.status_code == 200 and response.headers["x-disagg-gen-worker"] == "static-1"
    metrics = httpx.get(f"{url}/prometheus/metrics").text
    assert 'disagg_orchestrator_retries_total{phase="gen"} 1.0' in metrics  # then static-0 is suspected
    records = {r["request_id"]: r for r in httpx.get(f"{url}/perf_metrics").json()["records"]}
    retried = [records[f"retry-{i}"] for i in range(3) if records[f"retry-{i}"]["retries"]]
    assert len(retried) == 1 and retried[0]["retries"] == 1  # round robin met static-0 once
    assert retried[0]["legs"][0]["worker_id"] == "static-0" and "cannot connect" in retried[0]["legs"][0]["error"]


def test_worker_death_mid_stream_ends_with_an_error_event(faults):
    url, workers = faults
    with httpx.stream("POST", f"{url}/v1/completions", json=body(1000, stream=True), timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        disconnects, errors = _sample(url, DISCONNECTS), _sample(url, STREAM_ERRORS)
        workers[1][1].send_signal(signal.SIGKILL)
        frames = [line for line in lines if line.startswith("data: ")]
    assert msgspec.json.decode(frames[-2][6:])["error"]["code"] == "upstream_failed"
    assert _sample(url, STREAM_ERRORS) == errors + 1 and _sample(url, DISCONNECTS) == disconnects  # ours, not the client's
    assert frames[-1] == "data: [DONE]"
    workers[1][1].wait()
    # Nobody is left: a clean 502 (both workers fail), never a hang.
    response = httpx.post(f"{url}/v1/completions", json=body(3), timeout=30)
    assert response.status_code in (502, 503), response.text
