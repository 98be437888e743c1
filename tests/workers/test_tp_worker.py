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

from tests.worker_process import start_worker, stop_worker, worker_log
from workers.engine.model.tiny import make_tiny_model

PROMPTS = ["hello there", "what is two and two", "tell me a story about a cat", "ok"]
DOWN_SECONDS = 10.0


def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
    assert not [p for p in followers if _alive(p)]


@pytest.mark.parametrize("engine", ["synthetic", pytest.param("torch", marks=pytest.mark.slow)])
def test_killed_follower_takes_the_worker_down(model_dir, engine):
    url, proc = _serve(model_dir, engine, 2)
    descendants = _children(proc.pid)
    try:
        assert _chat(url, "hello")
        follower = next(p for p in descendants if "workers.rank_follower" in _cmdline(p))
        os.kill(follower, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=DOWN_SECONDS + 5)
        took = time.monotonic() - killed
    finally:
        stop_worker(proc)
    log = worker_log(proc)
    print(f"{engine}: worker down {took:.2f} s after its follower was SIGKILLed")
    assert took < DOWN_SECONDS, f"the worker took {took:.1f} s to go down:\n{log}"
    assert "stopping the engine: a tensor-parallel follower rank disconnected" in log, log
    deadline = time.monotonic() + 5
    while [p for p in descendants if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in descendants if _alive(p)], [_cmdline(p) for p in descendants if _alive(p)]
    assert not os.listdir(proc.ipc_root)  # the IPC directory is gone too


@pytest.mark.parametrize("engine", ["synthetic", pytest.param("torch", marks=pytest.mark.slow)])
def test_follower_killed_mid_stream_ends_the_stream_and_the_worker(model_dir, engine):
    """Killed while steps run (the synthetic rank 0 waits for its acknowledgement, the torch one
    sits in an all-reduce): the client's stream ends (never hangs) and the worker goes down."""
    extra = ["--synthetic-decode-step-seconds", "0.05"] if engine == "synthetic" else []
    url, proc = start_worker(model_dir, 1, engine, timeout=120, extra_args=[
        "--tensor-parallel-size", "2", "--device", "cpu", "--log-level", "info", *extra])
    descendants = _children(proc.pid)
    follower = next(p for p in descendants if "workers.rank_follower" in _cmdline(p))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt="once upon a time",
                                       max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    chunks = 0
    try:
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:
                chunks += 1
                if chunks == 20:
                    os.kill(follower, signal.SIGKILL)
                    killed = time.monotonic()
        proc.wait(timeout=DOWN_SECONDS + 5)
        took = time.monotonic() - killed
    finally:
        stop_worker(proc)
    assert chunks < 1500
    assert took < DOWN_SECONDS, worker_log(proc)
    deadline = time.monotonic() + 5
    while [p for p in descendants if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in descendants if _alive(p)]
