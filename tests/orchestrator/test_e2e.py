"""The orchestrator in front of real workers (synthetic engine, role both), over real HTTP.

K_o = 2 orchestrator processes on one port, an API key, two workers, gen routing kv_cache_aware
(only one orchestrator may poll a worker: its KV-event drain is destructive).
"""

from __future__ import annotations

import subprocess
import sys

import anthropic
import httpx
import openai
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator, wait_until
from worker_process import start_worker, stop_worker

KEY = "sk-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    workers = [start_worker(tiny_model_dir, 1) for _ in range(2)]
    url, proc = start_orchestrator(tmp_path_factory.mktemp("orch"), tiny_model_dir,
                                   [("both", w_url) for w_url, _ in workers], processes=2, api_key=KEY,
                                   gen_router={"policy": "kv_cache_aware"},
                                   health={"interval_seconds": 0.2, "registration_ttl_seconds": 1.5})
    yield url, [w for w, _ in workers]
    assert stop_orchestrator(proc) == 0
    for _, worker in workers:
        stop_worker(worker)


def seen_by_every_process(url: str, check) -> bool:
    """True when ``check(cluster_info)`` holds in both orchestrator processes (fresh connections)."""
    seen: set[int] = set()
    for _ in range(200):
        info = httpx.get(f"{url}/cluster_info", headers=AUTH).json()
        if not check(info):
            return False
        seen.add(info["process_index"])
        if seen == {0, 1}:
            return True
    raise AssertionError(f"only processes {seen} answered")


def test_health_models_and_cluster_info(cluster):
    url, worker_urls = cluster
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["processes"] == 2 and health["process_index"] in (0, 1)
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny-test"]
    assert seen_by_every_process(url, lambda info: sorted(w["url"] for w in info["workers"] if w["healthy"])
                                 == sorted(worker_urls))


def test_api_key_required_in_each_api_shape(cluster):
    url, _ = cluster
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "hi"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.post(f"{url}/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert response.status_code == 401
    assert response.json() == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": response.json()["error"]["message"]}}
    assert httpx.post(f"{url}/v1/messages", json={}, headers={"x-api-key": KEY}).status_code == 400


def test_openai_client_streaming_and_not(cluster):
    url, worker_urls = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    direct = openai.OpenAI(base_url=f"{worker_urls[0]}/v1", api_key="unused")
    kwargs = dict(model="tiny-test", prompt="the quick brown fox", max_tokens=8, temperature=0)
    expected = direct.completions.create(**kwargs).choices[0].text
    completion = client.completions.create(**kwargs)
    assert completion.choices[0].text == expected and completion.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == expected
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=6, temperature=0)
    chat_direct = direct.chat.completions.create(model="tiny-test", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == chat_direct.choices[0].message.content
    chunks = list(client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=6,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_anthropic_client_streaming_and_not(cluster):
    url, worker_urls = cluster
    client = anthropic.Anthropic(base_url=url, api_key=KEY)
    direct = anthropic.Anthropic(base_url=worker_urls[1], api_key="unused")
    kwargs = dict(model="tiny-test", max_tokens=7, messages=[{"role": "user", "content": "hi"}],
                  extra_body={"temperature": 0}, metadata={"user_id": "session-42"})
    message = client.messages.create(**kwargs)
    assert message.content[0].text == direct.messages.create(**kwargs).content[0].text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 7
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text and final.stop_reason == "max_tokens"


def test_request_id_round_trip_and_ties_rotate_over_workers(cluster):
    url, _ = cluster
    workers = set()
    for i in range(6):
        response = httpx.post(f"{url}/v1/completions", headers={**AUTH, "x-request-id": f"rid-{i}"},
                              json={"model": "tiny-test", "prompt": "abc", "max_tokens": 2})
        assert response.status_code == 200 and response.headers["x-request-id"] == f"rid-{i}"
        workers.add(response.headers["x-disagg-gen-worker"])
    assert workers == {"static-0", "static-1"}


def test_client_errors_pass_through_in_api_shape(cluster):
    url, _ = cluster
    response = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    response = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, content=b"{not json")
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{url}/v1/completions", headers=AUTH,
                          json={"model": "tiny-test", "prompt": "x", "disaggregated_params": {}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "disaggregated_params"


def test_registration_is_shared_by_all_processes_and_expires(cluster):
    url, _ = cluster
    body = {"role": "gen", "url": "http://127.0.0.1:9/", "kv_endpoint": "tcp://127.0.0.1:10"}
    assert httpx.post(f"{url}/workers/register", json=body).status_code == 401
    answer = httpx.post(f"{url}/workers/register", json=body, headers=AUTH).json()
    assert answer["ttl_seconds"] == 1.5
    worker_id = answer["worker_id"]

    def listed(info) -> bool:
        return any(w["worker_id"] == worker_id and w["kv_endpoint"] == "tcp://127.0.0.1:10" and not w["healthy"]
                   for w in info["workers"])

    wait_until(lambda: seen_by_every_process(url, listed))
    assert httpx.post(f"{url}/workers/heartbeat", json={"worker_id": worker_id}, headers=AUTH).json() == {"ok": True}
    # No more heartbeats: it leaves every process's view; a heartbeat then says "register again".
    wait_until(lambda: seen_by_every_process(url, lambda info: not listed(info)), timeout=10)
    assert httpx.post(f"{url}/workers/heartbeat", json={"worker_id": worker_id}, headers=AUTH).status_code == 404
    again = httpx.post(f"{url}/workers/register", json=body, headers=AUTH).json()["worker_id"]
    wait_until(lambda: seen_by_every_process(url, lambda info: any(w["worker_id"] == again for w in info["workers"])))
    assert httpx.post(f"{url}/workers/deregister", json={"worker_id": again}, headers=AUTH).json() == {"ok": True}
    wait_until(lambda: seen_by_every_process(url, lambda info: all(w["worker_id"] != again
                                                                   for w in info["workers"])))


def test_prometheus_sums_over_processes_and_perf_metrics_join(cluster):
    url, _ = cluster
    before = _count(httpx.get(f"{url}/prometheus/metrics", headers=AUTH).text, 'disagg_orchestrator_requests_total{api="completions"')
    ids = [f"perf-{i}" for i in range(8)]
    for request_id in ids:  # fresh connections: spread over both processes
        assert httpx.post(f"{url}/v1/completions", headers={**AUTH, "x-request-id": request_id},
                          json={"model": "tiny-test", "prompt": "abc", "max_tokens": 2}).status_code == 200
    text = httpx.get(f"{url}/prometheus/metrics", headers=AUTH).text
    assert _count(text, 'disagg_orchestrator_requests_total{api="completions"') == before + 8
    assert 'disagg_orchestrator_phase_seconds_count{phase="e2e"}' in text

    def records():  # every request recorded, and joined with its worker's own record
        got = {r["request_id"]: r for r in httpx.get(f"{url}/perf_metrics", headers=AUTH).json()["records"]}
        return got if all(i in got and got[i]["gen_worker"] for i in ids) else None

    got = wait_until(records, timeout=5)
    record = got["perf-3"]
    assert record["mode"] == "aggregated" and record["gen"]["worker_id"] in ("static-0", "static-1")
    assert record["arrival"] <= record["tokenized"] <= record["gen"]["start"] <= record["end"]
    assert record["num_prompt_tokens"] > 0 and record["ctx"] is None
    worker = record["gen_worker"]
    assert worker["worker_id"] == record["gen"]["worker_id"]
    assert worker["record"]["num_prompt_tokens"] == record["num_prompt_tokens"]
    assert worker["record"]["num_output_tokens"] == 2
    assert record["gen"]["start"] - 0.005 <= worker["record"]["frontend_arrival"] <= record["gen"]["end"]


def _count(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_no_torch_in_the_orchestrator():
    code = ("import sys, orchestrator.server, orchestrator.app, orchestrator.health, orchestrator.perf, "
            "orchestrator.state, orchestrator.flow, disagg.deployment, disagg.deploy_config, disagg.cli; "
            "disagg.cli.build_parser(); assert 'torch' not in sys.modules, 'torch imported'")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def test_health_is_503_until_a_ctx_and_a_gen_worker_are_healthy(tiny_model_dir, tmp_path):
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, [("ctx", "http://127.0.0.1:9")], processes=1,
                                   wait_healthy=False)
    try:
        response = httpx.get(f"{url}/health")
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker"
        response = httpx.post(f"{url}/v1/messages", json={"model": "tiny-test", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "x"}]})
        assert response.status_code == 503 and response.json()["error"]["type"] == "overloaded_error"
    finally:
        assert stop_orchestrator(proc) == 0


def test_kv_cache_aware_routing_follows_the_workers_kv_events(cluster):
    url, _ = cluster
    prompt = "the same long system prompt for every turn of this agent " * 4  # several full blocks

    def cached(info) -> dict[str, int]:
        return {w["worker_id"]: w["num_cached_blocks"] for w in info["workers"]}

    before = cached(httpx.get(f"{url}/cluster_info", headers=AUTH).json())
    first = httpx.post(f"{url}/v1/completions", headers=AUTH,
                       json={"model": "tiny-test", "prompt": prompt, "max_tokens": 2})
    holder = first.headers["x-disagg-gen-worker"]

    def holds(info) -> bool:  # the prompt's 3 full blocks arrived through the holder's KV events
        return cached(info)[holder] >= before[holder] + 3

    wait_until(lambda: seen_by_every_process(url, holds), timeout=10)
    for turn in range(6):  # from either process, the prefix match beats the tie rotation every time
        response = httpx.post(f"{url}/v1/completions", headers=AUTH, json={
            "model": "tiny-test", "max_tokens": 2, "prompt": prompt + f" turn {turn}"})
        assert response.headers["x-disagg-gen-worker"] == holder, httpx.get(f"{url}/cluster_info", headers=AUTH).text


def test_starts_empty_and_serves_workers_as_they_register(cluster, tiny_model_dir, tmp_path):
    _, worker_urls = cluster  # last in the module: this second orchestrator also drains the KV events
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, [], processes=2, wait_healthy=False)
    try:
        assert httpx.get(f"{url}/health").status_code == 503
        body = {"role": "both", "url": worker_urls[0]}
        worker_id = httpx.post(f"{url}/workers/register", json=body).json()["worker_id"]
        wait_until(lambda: seen_by_every_process(url, lambda info: [w["healthy"] for w in info["workers"]] == [True]))
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "x", "max_tokens": 2})
        assert response.status_code == 200 and response.headers["x-disagg-gen-worker"] == worker_id
        assert httpx.post(f"{url}/workers/deregister", json={"worker_id": worker_id}).json() == {"ok": True}
        wait_until(lambda: seen_by_every_process(url, lambda info: info["workers"] == []))
        assert httpx.get(f"{url}/health").status_code == 503
    finally:
        assert stop_orchestrator(proc) == 0
