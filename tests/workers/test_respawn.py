"""A crashed attached frontend is respawned in its slot; one that keeps crashing is left down."""

from __future__ import annotations

import os
import signal
import time

import httpx
from worker_process import start_worker, stop_worker, worker_log
from worker_procs import frontend_slots, wait_until

from common.processes import pid_alive


def complete(url: str, n: int) -> set[str]:
    with httpx.Client(base_url=url, timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        responses = [http.post("/v1/completions", json={"model": "tiny-test", "prompt": "Hi", "max_tokens": 2})
                     for _ in range(n)]
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return {r.headers["x-disagg-frontend"] for r in responses}


def until_answered_by(url: str, frontend: str) -> int:
    """Send completions in rounds of 8 until ``frontend`` answered one; how many were sent."""
    sent = 0
    while sent < 80:
        sent += 8
        if frontend in complete(url, 8):
            return sent
    raise AssertionError(f"frontend {frontend} answered none of {sent} requests")


def successes(url: str) -> float:
    text = httpx.get(url + "/prometheus/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("disagg_request_success_total{"))


def answered_by(url: str, n: int) -> set[str]:
    with httpx.Client(base_url=url, timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        responses = [http.get("/health") for _ in range(n)]
    assert all(r.status_code == 200 for r in responses)
    return {r.headers["x-disagg-frontend"] for r in responses}


def test_a_killed_frontend_comes_back_in_its_slot(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=4)
    try:
        slots = frontend_slots(proc.pid)
        assert sorted(slots) == [1, 2, 3]
        sent = until_answered_by(url, "2")
        os.kill(slots[2], signal.SIGKILL)
        wait_until(lambda: not pid_alive(slots[2]), 2)
        assert answered_by(url, 12) <= {"0", "1", "3", "2"}  # the others keep serving meanwhile
        took = wait_until(lambda: frontend_slots(proc.pid).get(2, slots[2]) != slots[2], 5)
        assert took < 5
        wait_until(lambda: "2" in answered_by(url, 16), 5)
        assert {k: v for k, v in frontend_slots(proc.pid).items() if k != 2} == {1: slots[1], 3: slots[3]}
        # The respawned process serves inference too (its client ids start past its predecessor's),
        # and the dead process's counts still add up in every scrape.
        sent += until_answered_by(url, "2")
        assert {successes(url) for _ in range(8)} == {float(sent)}
    finally:
        assert stop_worker(proc) == 0
    assert os.listdir(proc.ipc_root) == []
    assert "respawning frontend 2" in worker_log(proc)


def test_three_crashes_in_a_minute_stop_the_respawning(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2)
    try:
        for crash in range(3):
            pid = frontend_slots(proc.pid)[1]
            os.kill(pid, signal.SIGKILL)
            if crash < 2:
                wait_until(lambda killed=pid: frontend_slots(proc.pid).get(1, killed) != killed, 5)
                wait_until(lambda: "1" in answered_by(url, 8), 5)
        wait_until(lambda: "NOT respawning" in worker_log(proc), 5)
        time.sleep(1.0)  # a watch round or two: still nothing in slot 1
        assert 1 not in frontend_slots(proc.pid)
        assert answered_by(url, 8) == {"0"}  # the launcher alone keeps the port served
    finally:
        assert stop_worker(proc) == 0
    assert os.listdir(proc.ipc_root) == []
    assert "frontend 1 crashed 3 times within 60 s" in worker_log(proc)
