"""Launcher-owned routes through a real worker: launcher + synthetic engine + 3 attached frontends.

Every request goes to the shared port on a fresh connection, so the kernel
spreads them over the 4 frontends; ``x-disagg-frontend`` says who answered.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import httpx
import pytest
from http_harness import worker_apps
from worker_process import start_worker, stop_worker

from api.route_table import unclassified_routes
from frontends.perf_records import FLUSH_SECONDS

K = 4
USER = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=K, engine="synthetic",
                             extra_args=["--served-model-name", "tiny", "--admin-timeout", "1.0"])
    yield url, proc
    assert stop_worker(proc) == 0
    assert os.listdir(proc.ipc_root) == []  # the IPC directory, attach files and sockets are gone


def fresh(url: str, timeout: float = 10) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))


def forwarded_count(http: httpx.Client) -> float:
    text = http.get("/prometheus/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("disagg_admin_forwarded_requests_total{"))


def complete(http: httpx.Client, max_tokens: int) -> httpx.Response:
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens,
                                                  "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response


# --- classification -------------------------------------------------------------


def test_every_route_of_both_apps_is_classified(tiny_model_dir, tokenizer, tmp_path):
    apps = worker_apps(tiny_model_dir, tokenizer, tmp_path)
    attached, launcher = apps["attached"], apps["launcher"]
    for app in (attached, launcher):
        assert unclassified_routes(app.routes) == []
        paths = [r.path for r in app.routes]
        assert "/metrics" in paths and "/v1/completions" in paths and "/prometheus/metrics" in paths
        assert paths.index("/metrics") < paths.index("/v1/completions")  # launcher-owned first
    assert "/v1/messages/batches/{rest:path}" in [r.path for r in attached.routes]
    assert "/v1/messages/batches/{batch_id}/results" in [r.path for r in launcher.routes]

    from starlette.routing import Route

    assert unclassified_routes([Route("/v1/new_thing", lambda r: None)]) == ["/v1/new_thing"]


# --- through the shared port ----------------------------------------------------------


def test_metrics_is_one_complete_drain_per_poll(worker):
    url, _ = worker
    with fresh(url) as http:
        http.get("/metrics")  # whatever happened before this test
        for _ in range(8):  # sequential: each request is 5 engine steps (a prefill with a token, 4 decodes)
            complete(http, 5)
        polls = [http.get("/metrics") for _ in range(16)]
    assert all(p.status_code == 200 for p in polls)
    sizes = [len(p.json()) for p in polls]
    assert sorted(sizes) == [0] * 15 + [40], sizes
    assert len({p.headers["x-disagg-frontend"] for p in polls}) >= 2
    (stats,) = [p.json() for p in polls if p.json()]
    assert sum(s["num_finished"] for s in stats) == 8
    assert sum(s["num_decode_tokens"] + (s["num_prefill_tokens"] > 0) for s in stats) == 40
    assert stats[-1]["num_running"] == 0 and stats[-1]["kv_blocks_used"] == 0


def test_kv_cache_events_drain_through_any_frontend(worker):
    url, _ = worker
    with fresh(url) as http:
        http.get("/kv_cache_events")
        # 40 identical tokens fill two full blocks of 16: they become cached.
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 40, "max_tokens": 1})
        assert response.status_code == 200
        polls = [http.request("GET" if i % 2 else "POST", "/kv_cache_events") for i in range(8)]
    assert all(p.status_code == 200 for p in polls)
    events = [e for p in polls for e in p.json()]
    stored = [e for e in events if e["event"]["type"] == "BlockStored"]
    assert sum(len(e["event"]["block_hashes"]) for e in stored) == 2
    ids = [e["event_id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert sum(1 for p in polls if p.json()) == 1


def test_perf_metrics_come_from_every_frontend_once(worker):
    url, _ = worker
    with fresh(url) as http:
        time.sleep(4 * FLUSH_SECONDS)  # earlier tests' records may still wait in an attached frontend's batch
        http.get("/perf_metrics")
        responses = [complete(http, 3) for _ in range(24)]
        answered = Counter(r.headers["x-disagg-frontend"] for r in responses)
        num_prompt_tokens = responses[0].json()["usage"]["prompt_tokens"]
        records: list[dict] = []
        deadline = time.monotonic() + 5
        while len(records) < 24 and time.monotonic() < deadline:  # attached frontends batch theirs
            records += http.get("/perf_metrics").json()
            time.sleep(0.05)
    assert len(answered) >= 2
    assert Counter(str(r["frontend_id"]) for r in records) == answered
    for r in records:
        assert r["frontend_arrival"] <= r["tokenized"] <= r["engine_arrival"] <= r["first_scheduled"]
        assert r["first_scheduled"] <= r["first_token"] <= r["last_token"] <= r["finished"]
        assert (r["num_prompt_tokens"], r["num_output_tokens"], r["finish_reason"]) == (num_prompt_tokens, 3, "length")
    assert len({(r["frontend_id"], r["request_id"]) for r in records}) == 24


def test_the_synthetic_engine_has_nothing_to_profile(worker):
    url, _ = worker
    with fresh(url) as http:
        answers = [http.post(path) for path in ("/start_profile", "/stop_profile") * 4]
    for answer in answers:
        assert answer.status_code == 501
        assert "nothing to profile" in answer.json()["error"]["message"]
    assert len({a.headers["x-disagg-frontend"] for a in answers}) >= 2


def test_inference_never_passes_through_the_launcher(worker):
    url, _ = worker
    with fresh(url) as http:
        before = forwarded_count(http)
        answered = set()
        for i in range(30):
            path, body = [("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": USER}),
                          ("/v1/messages", {"messages": USER})][i % 3]
            response = http.post(path, json={"model": "tiny", "max_tokens": 2, **body})
            assert response.status_code == 200, response.text
            answered.add(response.headers["x-disagg-frontend"])
        assert answered == {"0", "1", "2", "3"}
        assert forwarded_count(http) == before
        polls = [http.get("/metrics", params={"verbose": "1"}) for _ in range(12)]
        by_attached = sum(1 for p in polls if p.headers["x-disagg-frontend"] != "0")
        assert by_attached > 0
        assert forwarded_count(http) == before + by_attached


def test_a_stopped_launcher_is_a_503_not_a_hang(worker):
    url, proc = worker
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        results = []
        started = time.monotonic()
        for _ in range(6):
            with fresh(url, timeout=2.5) as http:
                try:
                    results.append(http.get("/metrics"))
                except httpx.TimeoutException:
                    pass  # the connection landed on the stopped launcher itself
        elapsed = time.monotonic() - started
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert results, "every connection went to the stopped launcher"
    for response in results:
        assert response.status_code == 503
        assert response.headers["x-disagg-frontend"] != "0"
        error = response.json()["error"]
        assert error["code"] == "launcher_unavailable" and "launcher" in error["message"]
    assert elapsed < 6 * 2.5
    with fresh(url) as http:  # and it serves again
        assert http.get("/metrics").status_code == 200


@pytest.mark.asyncio
async def test_no_launcher_socket_is_a_503_at_once(tiny_model_dir, tokenizer, tmp_path):
    app = worker_apps(tiny_model_dir, tokenizer, tmp_path)["attached"]  # no launcher listens on its socket
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://f") as http:
        started = time.monotonic()
        response = await http.get("/metrics")
        batches = await http.post("/v1/messages/batches", json={"requests": []})
    assert time.monotonic() - started < 2
    assert response.status_code == 503 and response.json()["error"]["code"] == "launcher_unavailable"
    assert batches.status_code == 503 and batches.json()["type"] == "error"
    await app.state.forwarder.aclose()
