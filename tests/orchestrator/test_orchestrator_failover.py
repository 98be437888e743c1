"""No single point in the orchestrator (issue 27 item 3): real processes under `disagg up`, real SIGKILL.

Under c=32 streaming load, each orchestrator process in turn, the keeper
included, is SIGKILLed, for 5 rounds: the leader's death hands the shared
state over, the keeper respawns a serving process, `disagg up` restarts the
keeper (which adopts the running processes). No stream served by a surviving
process is cut, the cluster keeps its workers through every hand-over, and
after `disagg down` no process of the deployment is left.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from failover_load import StreamLoad
from test_up import disagg
from worker_process import free_port

from common.processes import pid_alive
from orchestrator.process_records import read_keeper, read_records
from workers.engine.model.tiny import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # 20 kills, each respawn a process start

PROCESSES = 3
ROUNDS = 5


def _deployment(tmp_path: Path, port: int) -> str:
    make_tiny_model(tmp_path / "model", size="test")
    config = tmp_path / "failover.yaml"
    config.write_text(textwrap.dedent(f"""\
        model: {tmp_path / "model"}
        run_dir: {tmp_path / "run"}
        engine: {{kind: synthetic, synthetic_decode_step_seconds: 0.015}}
        orchestrator: {{port: {port}, processes: {PROCESSES}, health: {{interval_seconds: 0.2}},
                        conditional: {{enabled: false}}, max_process_restarts: 50}}
        pools: {{ctx: {{instances: 1, frontends: 1}}, gen: {{instances: 1, frontends: 2}}}}
        restarts: {{max_restarts: 50}}
        startup_timeout_seconds: 90
    """))
    return str(config)


def _deployment_pids(run: Path) -> list[int]:
    """Every live process whose command line names the run directory (the supervisor, the workers,
    the keeper and its serving processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                argv = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(run).encode() in argv and pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.05)


def _serving(state_dir: Path) -> dict[int, int]:
    """index -> pid of the serving processes running now."""
    return {i: r.pid for i, r in read_records(state_dir).items() if r.running()}


def _wait_replaced(state_dir: Path, target: int | str, victim: int, serving: dict[int, int]) -> None:
    if target == "keeper":  # `disagg up` restarts it; it adopts the running processes
        _wait(lambda: (k := read_keeper(state_dir)) is not None and k.pid != victim and k.running(), 30,
              "a new keeper")
        assert _serving(state_dir) == serving, "the new keeper adopts, it does not respawn"
    else:
        _wait(lambda: _serving(state_dir).get(target, victim) != victim  # type: ignore[call-overload]
              and (state_dir / f"ready-{target}").exists(), 30, f"process {target} respawned")


def _workers_healthy(url: str) -> bool:
    try:
        with httpx.Client(timeout=5) as client:
            return sum(w["healthy"] for w in client.get(f"{url}/cluster_info").json()["workers"]) == 2
    except httpx.HTTPError:
        return False


def test_killing_each_process_in_turn_cuts_no_stream_of_the_others(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = _deployment(tmp_path, port)
    run = tmp_path / "run"
    state_dir = run / "orchestrator"
    up = disagg("up", config, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    load = StreamLoad(url, str(tmp_path / "model"), concurrency=32)
    killed: set[int] = set()
    seen: set[int] = set()
    try:
        load.start()
        _wait(lambda: len(load.in_flight()) >= 32, 60, "32 streams in flight")
        for _ in range(ROUNDS):
            for target in [*range(PROCESSES), "keeper"]:
                serving = _serving(state_dir)
                assert len(serving) == PROCESSES, serving
                seen.update(serving.values())
                keeper = read_keeper(state_dir)
                assert keeper is not None and keeper.running()
                seen.add(keeper.pid)
                victim = keeper.pid if target == "keeper" else serving[target]
                load.pause()
                load.owners(port, list(serving.values()))
                os.kill(victim, signal.SIGKILL)
                killed.add(victim)
                load.resume()
                _wait_replaced(state_dir, target, victim, serving)
                assert _workers_healthy(url), "the workers stay in the rotation through a hand-over"
                time.sleep(0.5)
    finally:
        load.stop()
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    streams = load.streams
    cut = [s for s in streams if not s.complete]
    on_killed = [s for s in cut if s.server_pid in killed]
    on_survivors = [s for s in cut if s.server_pid is not None and s.server_pid not in killed]
    # Not tied to a process: connections the kernel had queued on a killed process's socket (reset
    # before any answer). A stream that got an answer from a survivor must not be among them.
    unknown = [s for s in cut if s.server_pid is None]
    print(f"{len(streams)} streams, {len(killed)} kills: {len(on_killed)} cut on the killed processes, "
          f"{len(unknown)} refused before any answer, {len(on_survivors)} cut on survivors")
    assert not on_survivors, [(s.status, s.events[-2:]) for s in on_survivors]
    assert all(s.status != 200 for s in unknown), [(s.status, s.events[-2:]) for s in unknown]
    assert len(streams) > 32 * ROUNDS
    time.sleep(0.5)
    assert not _deployment_pids(run), "processes left after down"
    assert not [pid for pid in seen if pid_alive(pid)]
    log = (run / "logs" / "orchestrator.log").read_text()
    assert "took over the shared state" in log
    assert "did not exit within" not in log  # every process stopped by itself, none by its deadline


def test_down_stops_serving_processes_that_outlived_their_keeper_and_supervisor(tmp_path):
    port = free_port()
    config = _deployment(tmp_path, port)
    run = tmp_path / "run"
    state_dir = run / "orchestrator"
    up = disagg("up", config, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    serving = _serving(state_dir)
    keeper = read_keeper(state_dir)
    assert len(serving) == PROCESSES and keeper is not None
    supervisor = json.loads((run / "state.json").read_text())["supervisor_pid"]
    os.kill(supervisor, signal.SIGKILL)  # nobody restarts the keeper now
    os.kill(keeper.pid, signal.SIGKILL)
    _wait(lambda: not pid_alive(keeper.pid), 10, "the keeper gone")
    time.sleep(1.0)
    assert all(pid_alive(pid) for pid in serving.values()), "they serve on without a keeper"
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"stopped {PROCESSES} orchestrator processes left running" in down.stdout, down.stdout
    assert not [pid for pid in serving.values() if pid_alive(pid)]
    assert not _deployment_pids(run), "processes left after down"
