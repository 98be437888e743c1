"""Nothing of a worker is left behind, on every exit path; a dead engine or launcher ends the group.

Each worker runs with TMPDIR = ``proc.ipc_root`` (a per-test directory): the
IPC directory, its sockets, the attach files (they hold the HMAC key) and the
Prometheus files all live in it, so "nothing left" is ``listdir == []``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from worker_process import port_is_free, spawn_worker, start_worker, stop_worker, worker_log
from worker_procs import children_of, engine_pid, frontend_slots, group_pids_alive, wait_until

# Frontends detect a dead engine independently (process gone: ~0.5 s; a hung one: silence past the
# wedged limit), so their /health answers may disagree for a moment.
DETECTION_SPREAD_S = 1.5


def group_pids(proc) -> list[int]:
    return [proc.pid, *children_of(proc.pid)]


def test_normal_shutdown_leaves_nothing(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=4)
    pids = group_pids(proc)
    assert len(pids) == 5  # launcher, engine, 3 attached frontends
    assert stop_worker(proc) == 0
    assert group_pids_alive(pids) == [] and port_is_free(proc.port)
    assert os.listdir(proc.ipc_root) == []


def test_a_failed_start_leaves_nothing(tiny_model_dir, tmp_path):
    # The engine cannot start (the model directory has no weights): the launcher cleans up and says why.
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((tiny_model_dir / name).read_text())
    proc = spawn_worker(tmp_path, num_frontends=4, engine="torch")
    assert proc.wait(timeout=60) == 1
    assert "the engine failed to start" in worker_log(proc)
    # (torch keeps its compile cache in TMPDIR too: only the worker's own directory must be gone)
    assert [n for n in os.listdir(proc.ipc_root) if n.startswith("disagg-")] == [] and port_is_free(proc.port)


def test_sigkill_of_an_attached_frontend_leaves_nothing(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=4)
    os.kill(frontend_slots(proc.pid)[3], signal.SIGKILL)
    wait_until(lambda: 3 in frontend_slots(proc.pid), 5)  # respawned, with a fresh attach file (read, deleted)
    (ipc_dir,) = os.listdir(proc.ipc_root)
    wait_until(lambda: not any(n.startswith("attach-") for n in os.listdir(os.path.join(proc.ipc_root, ipc_dir))),
               5)
    assert stop_worker(proc) == 0
    assert os.listdir(proc.ipc_root) == []


def test_sigkill_of_the_launcher_ends_the_group_within_5_s(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=4)
    pids = group_pids(proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_until(lambda: port_is_free(proc.port) and group_pids_alive(pids) == [], 5)
    wait_until(lambda: os.listdir(proc.ipc_root) == [], 2)  # the last process to leave removed it


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_hung_engine_fails_requests_and_ends_the_group(tiny_model_dir, sig):
    # A hung engine (SIGSTOP) is first only unresponsive; past the wedged limit (7 s here) it is dead.
    url, proc = start_worker(tiny_model_dir, num_frontends=4,
                             extra_args=["--synthetic-decode-step-seconds", "0.01", "--engine-wedged-seconds", "7"])
    pids = group_pids(proc)
    engine = engine_pid(proc.pid)

    async def scenario() -> tuple[list[str], list[tuple[float, int]]]:
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
            async def stream() -> str:
                body = {"model": "tiny-test", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    return "".join([line async for line in response.aiter_lines()])

            streams = [asyncio.create_task(stream()) for _ in range(8)]
            await asyncio.sleep(0.5)
            os.kill(engine, sig)
            started = time.monotonic()
            ends = await asyncio.wait_for(asyncio.gather(*streams), 20)
            health: list[tuple[float, int]] = []  # (seconds since the kill, status)
            while time.monotonic() - started < 15:
                try:
                    health.append((time.monotonic() - started, (await http.get("/health")).status_code))
                except httpx.TransportError:
                    break  # the group has shut down: nobody listens any more
                await asyncio.sleep(0.05)
            return ends, health

    try:
        ends, health = asyncio.run(scenario())
    finally:
        if sig == signal.SIGSTOP:
            os.kill(engine, signal.SIGCONT) if group_pids_alive([engine]) else None
    for text in ends:  # every in-flight stream ended with an error event, never a hang
        assert "engine" in text and '"error"' in text, text[-300:]
    # Each frontend notices on its own (within ~0.5 s of each other): once one says 503, every
    # answer a moment later is 503 too, and the last one before the group left is 503.
    first_503 = next(t for t, status in health if status == 503)
    late = [status for t, status in health if t > first_503 + DETECTION_SPREAD_S]
    assert set(late) <= {503} and health[-1][1] == 503, health
    assert proc.wait(timeout=20) == 1
    wait_until(lambda: port_is_free(proc.port) and group_pids_alive(pids) == [], 5)
    assert os.listdir(proc.ipc_root) == []


def test_a_worker_killed_whole_leaves_an_ipc_dir_that_down_sweeps(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    url, proc = start_worker(tiny_model_dir, num_frontends=2)
    pids = group_pids(proc)
    for pid in pids:  # every process at once: none is left to clean up
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    wait_until(lambda: group_pids_alive(pids) == [], 5)
    (left,) = os.listdir(proc.ipc_root)
    assert left.startswith("disagg-")
    down = subprocess.run([sys.executable, "-m", "disagg.cli", "down", "--run-dir", str(tmp_path / "none")],
                          env={**os.environ, "TMPDIR": proc.ipc_root}, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert "nothing running" in down.stdout and f"removed {proc.ipc_root}/{left}" in down.stdout
    assert os.listdir(proc.ipc_root) == []
