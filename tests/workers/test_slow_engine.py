"""Slow is not dead: a stopped or CPU-starved engine makes a worker answer 503, never restart it.

A worker whose engine stops answering (SIGSTOP, a machine at load 80) must
steer routers away (``/health`` 503) and keep its engine, its KV cache and
its in-flight requests; only the engine process exiting, or silence past the
wedged limit (minutes), ends the worker.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import httpx
import pytest
from worker_process import start_worker, stop_worker
from worker_procs import children_of, engine_pid, wait_until

pytestmark = pytest.mark.slow

# Each frontend hears the heartbeats on its own lane, so they notice a silence within ~1 s of each other.
DETECTION_SPREAD_S = 1.5
PROMPT = "The same long prompt, asked again after the engine stalled. " * 12


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code
    except httpx.TransportError:
        return 0


def _prompt_hits(url: str) -> int:
    """The engine's cumulative prefix-cache hits (tokens), from the steps /metrics drains."""
    steps = httpx.get(f"{url}/metrics", timeout=5.0).json()
    return max((step["prefix_cache_hits"] for step in steps), default=0)


def _complete(url: str, **extra) -> httpx.Response:
    body = {"model": "tiny-test", "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)


def test_a_stopped_engine_is_503_then_healthy_again_without_a_restart(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2, engine="torch")
    try:
        engine = engine_pid(proc.pid)
        pids = sorted([proc.pid, *children_of(proc.pid)])
        assert _complete(url).status_code == 200  # its prompt's blocks are now cached
        hits_before = _prompt_hits(url)
        os.kill(engine, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_until(lambda: _health(url) == 503, 15)
            noticed_after = time.monotonic() - stopped_at
            time.sleep(DETECTION_SPREAD_S)  # each frontend notices on its own: let the other one too
            refused = _complete(url)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unresponsive"
            time.sleep(max(0.0, 30.0 - (time.monotonic() - stopped_at)))  # 30 s stopped in all
            assert _health(url) == 503 and proc.poll() is None
        finally:
            os.kill(engine, signal.SIGCONT)
        # Each frontend hears the next heartbeat on its own: healthy when every fresh connection
        # (spread over both frontends by the kernel) says so, not when the first one does.
        wait_until(lambda: all(_health(url) == 200 for _ in range(8)), 10)
        assert sorted([proc.pid, *children_of(proc.pid)]) == pids  # nothing died, nothing was respawned
        assert engine_pid(proc.pid) == engine
        assert _complete(url).status_code == 200
        assert _prompt_hits(url) > hits_before  # the KV cache survived: the prompt hit its blocks
        print(f"503 after {noticed_after:.1f} s stopped")
    finally:
        assert stop_worker(proc) == 0


def _spin(until: float) -> None:
    while time.monotonic() < until:
        pass


def test_cpu_starvation_for_60_s_restarts_nothing(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2, engine="torch")
    try:
        pids = sorted([proc.pid, *children_of(proc.pid)])
        until = time.monotonic() + 60.0
        hogs = [multiprocessing.Process(target=_spin, args=(until,), daemon=True)
                for _ in range(8 * (os.cpu_count() or 2))]
        for hog in hogs:
            hog.start()
        try:
            answered = 0
            while time.monotonic() < until:
                response = _complete(url, prompt=f"request {answered}")
                assert response.status_code in (200, 503), response.text  # 503: unresponsive for a moment
                answered += response.status_code == 200
        finally:
            for hog in hogs:
                hog.kill()
                hog.join()
        wait_until(lambda: _health(url) == 200, 15)
        assert proc.poll() is None and sorted([proc.pid, *children_of(proc.pid)]) == pids
        assert answered > 0
    finally:
        assert stop_worker(proc) == 0
