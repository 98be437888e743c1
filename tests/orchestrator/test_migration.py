"""Token-exact mid-stream migration (orchestrator.migration), with real processes.

One ctx worker and two gen workers (tiny torch engine: real tokens), one orchestrator. Twenty
streams (greedy, seeded sampling, json_schema) are each cut at a random event by a SIGKILL of
the gen worker serving them (its engine alone, or the whole worker); every stream must end
exactly as the same request's uninterrupted run, with no error event, and the orchestrator
must count the moves. The killed worker is restarted on its port while the other serves.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import httpx
import pytest
from orchestrator_process import orchestrator_log, start_orchestrator, stop_orchestrator, wait_until
from worker_process import disagg_worker_args, spawn_worker, start_worker, stop_worker
from worker_procs import children_of, engine_pid

# Each round restarts a killed torch worker: minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
ROUNDS = int(os.environ.get("DISAGG_MIGRATION_ROUNDS", "20"))  # fewer for a quick look; the drill is 20

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 6},
                                           "count": {"type": "integer"}},
          "required": ["name", "tags", "count"], "additionalProperties": False}


def body(kind: str, index: int) -> dict:
    prompt = f"request {index}: write about disaggregated serving and migration " * 3
    common = {"model": "tiny-test", "max_tokens": 64, "stream": True,
              "messages": [{"role": "user", "content": prompt}], "stream_options": {"include_usage": True}}
    if kind == "greedy":
        return {**common, "temperature": 0, "ignore_eos": True}
    if kind == "seeded":
        return {**common, "temperature": 1.0, "top_p": 0.9, "seed": 1000 + index, "ignore_eos": True}
    return {**common, "temperature": 0, "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}}


def read_stream(url: str, payload: dict, on_event=None, request_id: str | None = None) -> tuple[str, list[dict], str]:
    """(content, every data event decoded, the gen worker's id)."""
    events: list[dict] = []
    headers = {} if request_id is None else {"x-request-id": request_id}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        worker = response.headers["x-disagg-gen-worker"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if on_event is not None:
                on_event(len(events), worker)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    return content, events, worker


def migrations(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/prometheus/metrics").text
    found = {}
    for line in text.splitlines():
        if line.startswith("disagg_orchestrator_migrations_total{"):
            found[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migration")
    common = disagg_worker_args(tmp)
    gen_args = ["--role", "gen", *common]
    ctx = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "ctx", *common])
    gens = [start_worker(tiny_model_dir, 1, engine="torch", extra_args=gen_args) for _ in range(2)]
    url, proc = start_orchestrator(
        tmp, tiny_model_dir, [("ctx", ctx[0]), ("gen", gens[0][0]), ("gen", gens[1][0])], processes=1,
        conditional={"enabled": False}, gen_router={"policy": "round_robin"},
        health={"interval_seconds": 0.2, "timeout_seconds": 1.0, "unhealthy_threshold": 2},
        migration={"limit": 3})
    state = {"url": url, "orchestrator": proc, "model_dir": tiny_model_dir, "gen_args": gen_args,
             "gens": {"static-1": gens[0][1], "static-2": gens[1][1]}}
    yield state
    code = stop_orchestrator(proc)
    stop_worker(ctx[1])
    for worker in state["gens"].values():
        stop_worker(worker)
    assert code == 0, orchestrator_log(proc)


def kill(proc, whole: bool) -> None:
    """SIGKILL a gen worker's engine, or every process of the worker."""
    if not whole:
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        return
    for pid in children_of(proc.pid):
        os.kill(pid, signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)


def healthy(url: str, worker_id: str) -> bool:
    workers = {w["worker_id"]: w for w in httpx.get(f"{url}/cluster_info").json()["workers"]}
    return workers[worker_id]["healthy"]


def test_twenty_streams_cut_at_random_points_end_as_uninterrupted_runs(cluster):
    url, gens = cluster["url"], cluster["gens"]
    rng = random.Random(27)
    kinds = ["greedy", "seeded", "json_schema"]
    before = migrations(url)
    results = []
    for index in range(ROUNDS):
        kind = kinds[index % 3]
        payload = body(kind, index)
        # Both gen workers up: the reference run is uninterrupted.
        wait_until(lambda: healthy(url, "static-1") and healthy(url, "static-2"), timeout=300)
        reference, reference_events, _ = read_stream(url, payload)
        cut_at = rng.randint(1, 12)
        whole = index % 2 == 1
        cut: dict = {}

        def on_event(count: int, worker: str, cut_at=cut_at, whole=whole, cut=cut) -> None:
            if count == cut_at and not cut:
                cut["worker"] = worker
                kill(gens[worker], whole)

        content, events, _ = read_stream(url, payload, on_event, request_id=f"drill-{index}")
        assert cut, f"stream {index} ended before event {cut_at}"
        assert not any("error" in e for e in events), events[-3:]
        assert content == reference, (index, kind, cut_at, content, reference)
        usage = [e["usage"] for e in events if e.get("usage")]
        reference_usage = [e["usage"] for e in reference_events if e.get("usage")]
        assert usage[-1]["completion_tokens"] == reference_usage[-1]["completion_tokens"]
        assert usage[-1]["prompt_tokens"] == reference_usage[-1]["prompt_tokens"]
        if kind == "json_schema" and events[-2]["choices"] and events[-2]["choices"][0]["finish_reason"] == "stop":
            json.loads(content)
        results.append((kind, cut_at, whole))
        print(f"round {index}: {kind}, cut at event {cut_at} by a SIGKILL of the "
              f"{'whole worker' if whole else 'engine'}: identical", flush=True)
        # Restart the killed worker on its port (the other serves meanwhile).
        old = gens[cut["worker"]]
        old.wait(30)
        for pid in children_of(old.pid):
            os.kill(pid, signal.SIGKILL)
        gens[cut["worker"]] = spawn_worker(cluster["model_dir"], 1, engine="torch", port=old.port,
                                           extra_args=cluster["gen_args"])
        assert gens[cut["worker"]].ready.wait(300), "the gen worker did not restart"
    after = migrations(url)
    moved = after.get("moved", 0) - before.get("moved", 0)
    # A kill that lands after the worker wrote its last event (a quick machine, a short JSON answer)
    # leaves nothing to move: the stream was whole. Every other round moved, once, and says so on
    # its own request's record; most rounds must have been cut mid-answer, or the drill drilled nothing.
    records = {r["request_id"]: r for r in httpx.get(f"{url}/perf_metrics").json()["records"]}
    cut_mid_answer = [index for index in range(ROUNDS)
                      if any(leg["phase"] == "gen" for leg in records[f"drill-{index}"]["legs"])]
    assert moved == len(cut_mid_answer) >= ROUNDS * 3 // 4, (after, results, cut_mid_answer)
    log = orchestrator_log(cluster["orchestrator"])
    assert log.count("migrated to") == moved, log[-2000:]


def test_a_stalled_engine_fails_its_requests_with_a_retryable_503_quickly(cluster):
    """SIGSTOP one gen worker's engine: a stream on it moves (the frontend fails it with a 503
    error event within the silence limit); the engine is resumed after and serves again."""
    url, gens = cluster["url"], cluster["gens"]
    wait_until(lambda: healthy(url, "static-1") and healthy(url, "static-2"), timeout=120)
    payload = body("greedy", 99)
    payload["max_tokens"] = 200
    started = time.monotonic()
    reference, _, _ = read_stream(url, payload)
    uninterrupted = time.monotonic() - started
    moves = migrations(url).get("moved", 0)
    stopped: dict = {}

    def on_event(count: int, worker: str) -> None:
        if count == 3 and not stopped:
            stopped["pid"] = engine_pid(gens[worker].pid)
            stopped["at"] = time.monotonic()
            os.kill(stopped["pid"], signal.SIGSTOP)

    try:
        content, events, _ = read_stream(url, payload, on_event)
        took = time.monotonic() - stopped["at"]
    finally:
        os.kill(stopped["pid"], signal.SIGCONT)
    assert not any("error" in e for e in events)
    assert content == reference
    # The stall lasted until the stream ended (SIGCONT comes after): it moved instead of waiting,
    # after the 5 s silence limit, on the frontend's 503 error event.
    assert migrations(url)["moved"] == moves + 1
    assert "failed mid-stream (its error event, status 503); migrated" in orchestrator_log(cluster["orchestrator"])
    assert took < uninterrupted + 30, (took, uninterrupted)
