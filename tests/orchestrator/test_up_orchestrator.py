"""The orchestrator under `disagg up` (issue 16 items 8, 9).

- `disagg down` while 16 streams are in flight cuts none of them: the orchestrator is
  stopped first and drains (its grace_seconds, 30 s, as long as the workers') while the
  workers, still up, finish the streams; then the workers stop.
- A SIGKILLed keeper (the orchestrator's own process, which serves nothing) is restarted by the
  supervisor and adopts the serving processes, which served on meanwhile (issue 27 item 3).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from test_up import disagg, write_deployment
from worker_process import free_port

from common.processes import pid_alive
from orchestrator.process_records import read_records


def _stream(url: str, model: str, results: list, started: threading.Event) -> None:
    body = {"model": model, "prompt": "once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            data = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                    started.set()
            results.append((response.status_code, data))
    except httpx.HTTPError as exc:
        results.append((type(exc).__name__, []))
        started.set()


def _up(tmp_path) -> tuple[str, dict]:
    port = free_port()
    # 400 decode steps of 15 ms: ~6 s per stream, past the 5 s the orchestrator used to drain for.
    config = write_deployment(tmp_path, "drain", port=port, processes=2, gen_frontends=2,
                              engine=", synthetic_decode_step_seconds: 0.015")
    up = disagg("up", config, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    return f"http://127.0.0.1:{port}", json.loads((tmp_path / "run" / "state.json").read_text())


def test_down_under_load_cuts_no_stream(tmp_path):
    url, state = _up(tmp_path)
    run = tmp_path / "run"
    pids = [state["supervisor_pid"], *(p["pid"] for p in state["processes"])]
    results: list = []
    started = [threading.Event() for _ in range(16)]
    threads = [threading.Thread(target=_stream, args=(url, str(tmp_path / "model"), results, event)) for event in started]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(30)
    begin = time.monotonic()
    down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    took = time.monotonic() - begin
    print(f"disagg down with 16 streams in flight took {took:.1f} s")
    for thread in threads:
        thread.join(30)
    assert down.returncode == 0, down.stdout + down.stderr
    assert took < 45, f"down took {took:.1f} s"  # within the drain window, nothing SIGKILLed
    cut = [(status, data[-2:]) for status, data in results
           if status != 200 or data[-1:] != ["[DONE]"] or any('"error"' in d for d in data)]
    assert len(results) == 16 and not cut, cut
    assert not [pid for pid in pids if pid_alive(pid)]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_a_killed_keeper_is_restarted_by_the_supervisor_and_adopts_the_processes(tmp_path):
    url, state = _up(tmp_path)
    run = tmp_path / "run"
    try:
        serving = {i: r.pid for i, r in read_records(run / "orchestrator").items()}
        assert len(serving) == 2
        orchestrator = next(p for p in state["processes"] if p["name"] == "orchestrator")
        os.kill(orchestrator["pid"], signal.SIGKILL)

        def restarted() -> bool:
            now = json.loads((run / "state.json").read_text())
            return next(p["pid"] for p in now["processes"] if p["name"] == "orchestrator") != orchestrator["pid"]

        def serves() -> bool:  # six answers in a row, on fresh connections: both new processes answer
            try:
                return all(httpx.post(f"{url}/v1/completions", timeout=30, json={
                    "model": str(tmp_path / "model"), "prompt": "hi", "max_tokens": 2}).status_code == 200
                    for _ in range(6))
            except httpx.HTTPError:  # the old processes' sockets, closing
                return False

        deadline = time.monotonic() + 60
        while not (restarted() and serves()):
            assert time.monotonic() < deadline, (run / "up.log").read_text()
            time.sleep(0.2)
        assert time.monotonic() < deadline - 45, "serving again took over 15 s"
        assert "orchestrator exited" in (run / "up.log").read_text()
        assert {i: r.pid for i, r in read_records(run / "orchestrator").items()} == serving  # adopted
        assert all(pid_alive(pid) for pid in serving.values())
    finally:
        assert disagg("down", "--run-dir", str(run), cwd=tmp_path).returncode == 0
