"""The orchestrator's processes under faults and shutdown (issue 16 items 8, 9): real processes, real SIGKILL/SIGTERM.

- a SIGKILLed process is respawned by the keeper, the others keep serving, and the
  in-flight counts it held at the state owner are released;
- SIGTERM drains: every stream in flight finishes normally, then the orchestrator exits 0;
- past the grace period a cut stream ends with the API's error event (and [DONE] for OpenAI),
  and a cut non-streaming request gets a JSON 503, never uvicorn's plain-text 500.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from orchestrator_process import orchestrator_log, start_orchestrator, stop_orchestrator, wait_until
from worker_process import start_worker, stop_worker

STEP = ["--synthetic-decode-step-seconds", "0.015"]  # ~60 tokens in ~1 s


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, 2, extra_args=STEP)
    yield url
    stop_worker(proc)


def _children(pid: int) -> dict[int, int]:
    """process index -> pid of the orchestrator processes that ``pid`` spawned."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"--process-index" in argv:
            found[int(argv[argv.index(b"--process-index") + 1])] = int(entry.name)
    return found


def _in_flight(url: str) -> int:
    with httpx.Client(timeout=5) as client:  # a fresh connection: any of the processes may answer
        return sum(w["in_flight_requests"] for w in client.get(f"{url}/cluster_info").json()["workers"])


def _stream(url: str, max_tokens: int, results: list, started: threading.Event | None = None,
            path: str = "/v1/completions") -> None:
    body = ({"model": "tiny-test", "max_tokens": max_tokens, "stream": True,
             "messages": [{"role": "user", "content": "tell me"}]} if path == "/v1/messages" else
            {"model": "tiny-test", "prompt": "once upon a time", "max_tokens": max_tokens, "stream": True,
             "ignore_eos": True})
    try:
        with httpx.Client(timeout=60) as client, client.stream("POST", url + path, json=body) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if started is not None and line:
                    started.set()
            results.append((response.status_code, response.headers.get("content-type"), lines))
    except httpx.HTTPError as exc:
        results.append(("cut", type(exc).__name__, []))


def _completed(lines: list[str]) -> bool:
    data = [line[6:] for line in lines if line.startswith("data: ")]
    return data[-1] == "[DONE]" and not any('"error"' in d for d in data)


def test_a_killed_process_is_respawned_and_its_in_flight_counts_released(tmp_path, tiny_model_dir, worker):
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, [("both", worker)], processes=3,
                                   conditional={"enabled": False})
    try:
        children = wait_until(lambda: (c := _children(proc.pid)) and len(c) == 3 and c)
        results: list = []
        threads = [threading.Thread(target=_stream, args=(url, 120, results)) for _ in range(16)]
        for thread in threads:
            thread.start()
        wait_until(lambda: _in_flight(url) >= 12, timeout=10)  # the owner holds every process's load
        os.kill(children[2], signal.SIGKILL)
        respawned = wait_until(lambda: (c := _children(proc.pid)).get(2) not in (None, children[2]) and c, 10)
        for thread in threads:
            thread.join(60)
        # The streams of the killed process lost their connection; every other one completed.
        assert all(status == "cut" or _completed(lines) for status, _, lines in results), results
        assert sum(status == 200 and _completed(lines) for status, _, lines in results) >= 8
        # The others kept serving, and the respawned process serves (fresh connections reach all three).
        for _ in range(12):
            answer = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": "tiny-test", "prompt": "hi", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
        # Nobody would ever release the killed process's counts: its slot at the owner was cleared.
        wait_until(lambda: _in_flight(url) == 0, timeout=10)
        assert respawned[0] == children[0] and respawned[1] == children[1]
        assert "orchestrator process 2" in orchestrator_log(proc) and "respawning" in orchestrator_log(proc)
    finally:
        assert stop_orchestrator(proc, 60) == 0


def test_sigterm_drains_every_stream_in_flight(tmp_path, tiny_model_dir, worker):
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, [("both", worker)], processes=2,
                                   conditional={"enabled": False})
    results: list = []
    started = [threading.Event() for _ in range(16)]
    # ~500 decode steps of 15 ms: past uvicorn's 5 s default, which used to cut them.
    threads = [threading.Thread(target=_stream, args=(url, 500, results, s)) for s in started]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(30)
    begin = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert proc.wait(60) == 0
    assert time.monotonic() - begin < 30  # drained (grace_seconds is 30), no SIGKILL
    assert len(results) == 16 and all(status == 200 and _completed(lines) for status, _, lines in results), \
        [r[:2] for r in results if not (r[0] == 200 and _completed(r[2]))]
    with pytest.raises(httpx.ConnectError):  # stopped accepting, and gone
        httpx.get(f"{url}/health", timeout=5)


def test_past_the_grace_period_cut_requests_end_in_the_api_shape(tmp_path, tiny_model_dir, worker):
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, [("both", worker)], processes=1,
                                   conditional={"enabled": False}, grace_seconds=0.5)
    openai_results: list = []
    anthropic_results: list = []
    plain: list = []
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(url, 400, openai_results, started[0])),
               threading.Thread(target=_stream, args=(url, 400, anthropic_results, started[1], "/v1/messages"))]

    def whole() -> None:
        try:
            plain.append(httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny-test", "prompt": "once", "max_tokens": 400, "ignore_eos": True}))
        except httpx.HTTPError as exc:
            plain.append(exc)

    threads.append(threading.Thread(target=whole))
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(30)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert proc.wait(30) == 0
    status, _, lines = openai_results[0]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert status == 200 and data[-1] == "[DONE]", data[-3:]
    assert msgspec.json.decode(data[-2])["error"]["code"] == "shutting_down"
    status, _, lines = anthropic_results[0]
    lines = [line for line in lines if line]
    assert lines[-2:] == ["event: error", lines[-1]] and lines[-1].startswith("data: "), lines[-3:]
    assert msgspec.json.decode(lines[-1][6:])["error"]["type"] == "overloaded_error"
    response = plain[0]
    assert isinstance(response, httpx.Response), response
    assert response.status_code == 503 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "shutting_down"
