"""A deployment whose supervisor was SIGKILLed (an orphan): a second `up` refuses without damaging it,
`status` and `down` find it from its run dir, and only the recorded processes are ever signalled."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import openai
from test_up import disagg, write_deployment
from worker_process import free_port, port_is_free

from common.process_identity import process_start_time
from common.processes import pid_alive
from workers.ipc_dir_owners import OWNERS_FILE, record_owner, sweep_stale_ipc_dirs


def _config(tmp_path, port: int) -> str:
    return write_deployment(tmp_path, "orphan", port=port)


def _complete(port: int, model: str) -> int:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model=model, prompt="still here", max_tokens=3).usage.completion_tokens


def test_up_over_an_orphan_refuses_and_leaves_it_serving_then_down_stops_it(tmp_path):
    port = free_port()
    config, run = _config(tmp_path, port), tmp_path / "run"
    up = disagg("up", config, cwd=tmp_path)
    pids = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
        state = json.loads((run / "state.json").read_text())
        pids = [p["pid"] for p in state["processes"]]
        assert all(p["start_time"] == process_start_time(p["pid"]) for p in state["processes"])
        assert state["supervisor_start_time"] == process_start_time(state["supervisor_pid"])
        os.kill(state["supervisor_pid"], signal.SIGKILL)  # the orphan: its workers and orchestrator serve on
        deadline = time.monotonic() + 10
        while pid_alive(state["supervisor_pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        key = (run / "cluster.key").read_bytes()

        again = disagg("up", config, cwd=tmp_path)
        assert again.returncode == 1
        assert "already runs" in again.stderr and "orphan" in again.stderr and "disagg down" in again.stderr
        assert "ready" not in again.stdout
        # nothing damaged: state, key and orchestrator state as they were; requests still answered
        assert json.loads((run / "state.json").read_text()) == state
        assert (run / "cluster.key").read_bytes() == key and (run / "orchestrator").is_dir()
        assert _complete(port, str(tmp_path / "model")) == 3

        status = disagg("status", "--run-dir", str(run), cwd=tmp_path)
        assert "GONE" in status.stdout and status.stdout.count("running") == 3, status.stdout
    finally:
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped 3 processes" in down.stdout and "unsupervised" in down.stdout
    assert [pid for pid in pids if pid_alive(pid)] == []
    assert port_is_free(port)
    assert not (run / "state.json").exists() and not (run / "cluster.key").exists()
    assert disagg("logs", "orchestrator", "--run-dir", str(run), cwd=tmp_path).returncode == 0
    again = disagg("down", "--run-dir", str(run), cwd=tmp_path)  # idempotent
    # one line (more only if it swept some other worker's stale IPC dir from /tmp meanwhile)
    assert again.returncode == 0 and again.stdout.splitlines()[0] == f"disagg down: nothing running from {run}"


def test_up_refuses_a_port_already_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = disagg("up", _config(tmp_path, port), cwd=tmp_path, timeout=60)
    assert up.returncode == 1
    assert f"port already in use: orchestrator 127.0.0.1:{port}" in up.stderr, up.stderr
    assert not (tmp_path / "run" / "state.json").exists()


def test_down_never_signals_a_recycled_pid(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    bystander = subprocess.Popen(["sleep", "60"])  # holds a pid state.json names, but is not that process
    try:
        wrong = process_start_time(bystander.pid) - 1
        (run / "state.json").write_text(json.dumps({
            "config": "x.yaml", "url": "http://127.0.0.1:1", "supervisor_pid": bystander.pid,
            "supervisor_start_time": wrong, "processes": [
                {"name": "orchestrator", "pid": bystander.pid, "start_time": wrong, "url": "http://127.0.0.1:1"}]}))
        (run / "cluster.key").write_text("k")
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path, timeout=60)
        assert down.returncode == 0, down.stderr
        assert "nothing was running" in down.stdout
        time.sleep(0.2)
        assert bystander.poll() is None  # not signalled
        assert not (run / "state.json").exists() and not (run / "cluster.key").exists()
        again = disagg("down", "--run-dir", str(run), cwd=tmp_path, timeout=60)
        assert again.returncode == 0 and "nothing running" in again.stdout
    finally:
        bystander.kill()
        bystander.wait()


def test_stale_ipc_dirs_are_swept_and_live_ones_kept(tmp_path):
    import tempfile

    base = tempfile.gettempdir()
    prefix = f"disagg-sweeptest-{os.getpid()}-"
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale, live, unowned = (tempfile.mkdtemp(prefix=prefix, dir=base) for _ in range(3))
    try:
        from pathlib import Path

        (Path(stale) / OWNERS_FILE).write_text(json.dumps([[gone.pid, 12345]]))
        record_owner(Path(live), os.getpid())
        (Path(live) / OWNERS_FILE).write_text(  # one owner gone, one alive: kept
            json.dumps([[gone.pid, 12345], *json.loads((Path(live) / OWNERS_FILE).read_text())]))
        assert sweep_stale_ipc_dirs(prefix) == [Path(stale)]
        assert not os.path.exists(stale) and os.path.isdir(live) and os.path.isdir(unowned)
    finally:
        import shutil

        for path in (stale, live, unowned):
            shutil.rmtree(path, ignore_errors=True)
