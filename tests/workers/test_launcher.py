"""``disagg serve`` as real processes: a launcher, its engine, K frontends, one port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from worker_process import port_is_free, spawn_worker, start_worker, stop_worker, worker_log


def complete(url: str, max_tokens: int = 4, timeout: float = 30.0) -> httpx.Response:
    # A fresh connection per request: SO_REUSEPORT spreads connections, not requests.
    with httpx.Client(timeout=timeout) as client:
        return client.post(f"{url}/v1/completions",
                           json={"model": "tiny-test", "prompt": "hello", "max_tokens": max_tokens})


def assert_nothing_left(proc: subprocess.Popen) -> None:
    assert port_is_free(proc.port)
    assert os.listdir(proc.ipc_root) == []  # the IPC directory, with its sockets and attach files


def engine_pid_of(launcher_pid: int) -> int:
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if "workers.engine_proc" in Path(f"/proc/{pid}/cmdline").read_text():
                return int(pid)
    raise AssertionError("no engine process under the launcher")


def test_requests_spread_over_all_four_frontends(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=4)
    try:
        served_by = Counter()
        for _ in range(48):
            response = complete(url)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
            served_by[response.headers["x-disagg-frontend"]] += 1
        assert set(served_by) == {"0", "1", "2", "3"}
        # A second worker group can never join this one's port.
        second = subprocess.run(
            [sys.executable, "-m", "disagg.cli", "serve", str(tiny_model_dir), "--engine", "synthetic",
             "--port", str(proc.port)], capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert f"port {proc.port} on 127.0.0.1 is already in use" in second.stderr
        assert complete(url).status_code == 200
    finally:
        assert stop_worker(proc) == 0
    assert_nothing_left(proc)


def test_port_in_use_fails_fast_with_a_clear_error_and_leaves_nothing(tiny_model_dir):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        proc = spawn_worker(tiny_model_dir, num_frontends=2, port=port)
        assert proc.wait(timeout=60) == 1
        assert f"port {port} on 127.0.0.1 is already in use" in worker_log(proc)
        assert os.listdir(proc.ipc_root) == []


def test_sigterm_lets_in_flight_requests_finish_then_frees_everything(tiny_model_dir):
    # 50 ms per decode step: a 30-token request is in flight for ~1.5 s.
    url, proc = start_worker(tiny_model_dir, num_frontends=2,
                             extra_args=["--synthetic-decode-step-seconds", "0.05", "--grace-seconds", "20"])
    responses: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: responses.append(complete(url, max_tokens=30))) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    assert stop_worker(proc) == 0
    for thread in threads:
        thread.join(timeout=30)
    assert time.monotonic() - started < 15.0
    assert [r.status_code for r in responses] == [200] * 4
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [30] * 4
    assert_nothing_left(proc)


def test_a_request_cut_at_the_end_of_the_grace_period_gets_a_json_503(tiny_model_dir):
    # 50 ms per decode step: 300 tokens run ~15 s, far past a 0.5 s grace period.
    url, proc = start_worker(tiny_model_dir, num_frontends=1,
                             extra_args=["--synthetic-decode-step-seconds", "0.05", "--grace-seconds", "0.5"])
    responses: list = []
    thread = threading.Thread(target=lambda: responses.append(complete(url, max_tokens=300)))
    thread.start()
    time.sleep(0.5)
    assert stop_worker(proc) == 0
    thread.join(timeout=30)
    response = responses[0]  # uvicorn's own answer was a plain-text "Internal Server Error"
    assert response.status_code == 503 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "shutting_down"
    assert_nothing_left(proc)


def test_an_attached_frontend_that_fails_to_start_tears_the_group_down(tiny_model_dir):
    broken = f"{sys.executable} -c 'import sys; print(\"boom: no frontend today\"); sys.exit(3)'"
    proc = spawn_worker(tiny_model_dir, num_frontends=3, extra_args=["--frontend-command", broken])
    assert proc.wait(timeout=60) == 1
    log = worker_log(proc)
    assert "frontend 1 failed to start: frontend 1" in log or "frontend 2 failed to start: frontend 2" in log
    assert "exited with code 3" in log
    assert "boom: no frontend today" in log
    assert not proc.ready.is_set()
    assert_nothing_left(proc)


def test_a_killed_engine_takes_the_worker_down_cleanly(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2)
    assert complete(url).status_code == 200
    os.kill(engine_pid_of(proc.pid), signal.SIGKILL)
    assert proc.wait(timeout=20) == 1
    assert_nothing_left(proc)


def test_children_exit_when_the_launcher_is_killed(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2)
    engine_pid = engine_pid_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup path runs: the children must notice on their own
    proc.wait()
    deadline = time.monotonic() + 10.0
    while (not port_is_free(proc.port) or Path(f"/proc/{engine_pid}").exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert port_is_free(proc.port)
    assert not Path(f"/proc/{engine_pid}").exists() or "Z" in Path(f"/proc/{engine_pid}/stat").read_text()
    assert os.listdir(proc.ipc_root) == []  # the orphaned engine removed the IPC directory


def test_the_frontend_side_never_imports_torch():
    code = ("import sys, disagg.cli, disagg.serve, api.server, frontends.engine_client, workers.launcher, "
            "workers.engine_proc; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
