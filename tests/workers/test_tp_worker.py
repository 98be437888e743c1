"""A tensor-parallel worker end to end: ``disagg serve --tensor-parallel-size N``.

Real processes: the launcher spawns N engine ranks (rank 0 the engine
process, ranks 1..N-1 ``workers.rank_follower``); requests go through the
official ``openai`` client. A SIGKILLed follower takes the whole worker down
within 10 s, leaving no process behind.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from common.processes import pid_alive
from tests.worker_process import start_worker, stop_worker, worker_log
from tests.worker_procs import _cmdline, children_of
from workers.engine.model.tiny import make_tiny_model

PROMPTS = ["hello there", "what is two and two", "tell me a story about a cat", "ok"]
DOWN_SECONDS = 10.0


def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    found, frontier = [], [pid]
    while frontier:
        kids = children_of(frontier.pop())
        found += kids
        frontier += kids
    return found


def _kill_a_follower(descendants: list[int]) -> float:
    """SIGKILL the first rank follower among ``descendants``; when."""
    os.kill(next(p for p in descendants if "workers.rank_follower" in _cmdline(p)), signal.SIGKILL)
    return time.monotonic()


def _assert_down_in_time(proc, took: float, descendants: list[int]) -> None:
    """The worker went down within DOWN_SECONDS of the kill, and every process it had is gone."""
    assert took < DOWN_SECONDS, f"the worker took {took:.1f} s to go down:\n{worker_log(proc)}"
    deadline = time.monotonic() + 5
    while [p for p in descendants if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in descendants if pid_alive(p)], [_cmdline(p) for p in descendants if pid_alive(p)]
    assert not os.listdir(proc.ipc_root)  # the IPC directory is gone too


def _chat(url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=10, temperature=0)
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp-worker"))


def _serve(model_dir: Path, engine: str, tp: int) -> tuple[str, object]:
    return start_worker(model_dir, 1, engine, extra_args=["--tensor-parallel-size", str(tp), "--device", "cpu",
                                                          "--log-level", "info"], timeout=120)


@pytest.mark.slow
def test_torch_tp2_answers_like_tp1(model_dir):
    answers = {}
    for tp in (1, 2):
        url, proc = _serve(model_dir, "torch", tp)
        try:
            answers[tp] = [_chat(url, prompt) for prompt in PROMPTS]
        finally:
            assert stop_worker(proc) == 0, worker_log(proc)
    assert answers[2] == answers[1]
    assert len(set(answers[1])) > 1  # the prompts do not all collapse to one answer


def test_synthetic_tp4_serves_and_stops_every_rank(model_dir):
    url, proc = _serve(model_dir, "synthetic", 4)
    try:
        followers = [p for p in _children(proc.pid) if "workers.rank_follower" in _cmdline(p)]
        assert len(followers) == 3
        assert all(_chat(url, prompt) for prompt in PROMPTS)
    finally:
        assert stop_worker(proc) == 0, worker_log(proc)
    assert not [p for p in followers if pid_alive(p)]


@pytest.mark.parametrize("engine", ["synthetic", pytest.param("torch", marks=pytest.mark.slow)])
def test_killed_follower_takes_the_worker_down(model_dir, engine):
    url, proc = _serve(model_dir, engine, 2)
    descendants = _children(proc.pid)
    try:
        assert _chat(url, "hello")
        killed = _kill_a_follower(descendants)
        proc.wait(timeout=DOWN_SECONDS + 5)
        took = time.monotonic() - killed
    finally:
        stop_worker(proc)
    log = worker_log(proc)
    print(f"{engine}: worker down {took:.2f} s after its follower was SIGKILLed")
    assert "stopping the engine: a tensor-parallel follower rank disconnected" in log, log
    _assert_down_in_time(proc, took, descendants)


@pytest.mark.parametrize("engine", ["synthetic", pytest.param("torch", marks=pytest.mark.slow)])
def test_follower_killed_mid_stream_ends_the_stream_and_the_worker(model_dir, engine):
    """Killed while steps run (the synthetic rank 0 waits for its acknowledgement, the torch one
    sits in an all-reduce): the client's stream ends (never hangs) and the worker goes down."""
    extra = ["--synthetic-decode-step-seconds", "0.05"] if engine == "synthetic" else []
    url, proc = start_worker(model_dir, 1, engine, timeout=120, extra_args=[
        "--tensor-parallel-size", "2", "--device", "cpu", "--log-level", "info", *extra])
    descendants = _children(proc.pid)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt="once upon a time",
                                       max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    chunks = 0
    try:
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:
                chunks += 1
                if chunks == 20:
                    killed = _kill_a_follower(descendants)
        proc.wait(timeout=DOWN_SECONDS + 5)
        took = time.monotonic() - killed
    finally:
        stop_worker(proc)
    assert chunks < 1500
    _assert_down_in_time(proc, took, descendants)


@pytest.mark.parametrize("engine", ["synthetic", pytest.param("torch", marks=pytest.mark.slow)])
def test_externally_started_ranks_serve_and_rank1_leaves_with_rank0(model_dir, engine, tmp_path):
    """As under ``srun --ntasks=2``: the same ``disagg serve`` command twice, DISAGG_TP_* naming
    each rank. Rank 0 serves (and spawns no follower); rank 1 runs only its follower and exits
    when rank 0 stops."""
    import subprocess
    import sys

    from tests.worker_process import disagg_worker_args, free_port, spawn_worker
    from workers.launcher import RANK_ENV_VARS
    from workers.rank_group import free_port as free_master_port

    master = free_master_port("127.0.0.1")
    ranks = {"DISAGG_TP_SIZE": "2", "DISAGG_TP_MASTER_ADDR": "127.0.0.1", "DISAGG_TP_MASTER_PORT": str(master)}
    args = ["--tensor-parallel-size", "2", "--device", "cpu", "--log-level", "info", *disagg_worker_args(tmp_path)]
    port = free_port()
    follower_log = open(tmp_path / "rank1.log", "w")
    follower = subprocess.Popen(
        [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--engine", engine, "--port", str(port), *args],
        env={**os.environ, **ranks, "DISAGG_TP_RANK": "1", "DISAGG_TP_LOCAL_RANK": "1"}, stdout=follower_log,
        stderr=subprocess.STDOUT)
    saved = {k: os.environ.get(k) for k in (*ranks, "DISAGG_TP_RANK", "DISAGG_TP_LOCAL_RANK")}
    os.environ.update({**ranks, "DISAGG_TP_RANK": "0", "DISAGG_TP_LOCAL_RANK": "0"})
    try:
        proc = spawn_worker(model_dir, 2, engine, port, args)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        assert proc.ready.wait(120), worker_log(proc)
        url = f"http://127.0.0.1:{port}"
        assert not [p for p in _children(proc.pid) if "workers.rank_follower" in _cmdline(p)]
        assert all(_chat(url, prompt) for prompt in PROMPTS)
        assert follower.poll() is None
    finally:
        assert stop_worker(proc) == 0, worker_log(proc)
        try:
            assert follower.wait(timeout=10) == 0
        finally:
            follower.kill()
            follower_log.close()
    assert "rank 0 stopped: rank 1 exits" in (tmp_path / "rank1.log").read_text()
    assert "DISAGG_TP_RANK" in RANK_ENV_VARS  # attached frontends of rank 0 never see them
