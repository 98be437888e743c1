"""Validate once, before any work: the orchestrator refuses what a worker would refuse, with no leg sent.

A real ctx and gen worker (synthetic engine, max_model_len 256) behind a real
orchestrator; legs are counted in the orchestrator's Prometheus metrics
(``disagg_orchestrator_legs_total``) and in the workers' own request logs of
their perf records. A valid request in the same module sends both legs, so a
count of zero means the request was refused, not that legs are never counted.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from orchestrator_process import orchestrator_log, start_orchestrator, stop_orchestrator
from worker_process import disagg_worker_args, start_worker, stop_worker

MAX_MODEL_LEN = 256
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation")
    common = disagg_worker_args(tmp) + ["--max-model-len", str(MAX_MODEL_LEN)]
    ctx = start_worker(tiny_model_dir, 1, extra_args=["--role", "ctx", *common])
    gen = start_worker(tiny_model_dir, 1, extra_args=["--role", "gen", *common])
    url, proc = start_orchestrator(tmp, tiny_model_dir, [("ctx", ctx[0]), ("gen", gen[0])], processes=1,
                                   conditional={"enabled": False})
    yield url, gen[0]
    assert stop_orchestrator(proc) == 0
    assert "never retrieved" not in orchestrator_log(proc)
    for _, worker in (ctx, gen):
        stop_worker(worker)


def legs_sent(url: str) -> dict[str, float]:
    counts = {"ctx": 0.0, "gen": 0.0}
    for line in httpx.get(f"{url}/prometheus/metrics").text.splitlines():
        if line.startswith("disagg_orchestrator_legs_total{"):
            counts[line.split('phase="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return counts


def test_a_valid_request_sends_both_legs(cluster):
    url, _ = cluster
    before = legs_sent(url)
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "hello world " * 4,
                                                         "max_tokens": 4}, timeout=30)
    assert response.status_code == 200 and response.headers["x-disagg-mode"] == "disagg", response.text
    after = legs_sent(url)
    assert after["ctx"] - before["ctx"] == 1 and after["gen"] - before["gen"] == 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "tiny-test", "prompt": "word " * 400, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"model": "tiny-test", "prompt": "word " * 20, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": "word " * 400}]},
     "messages"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": USER, "max_completion_tokens": 10_000},
     "max_completion_tokens"),
])
def test_over_long_requests_are_400_with_no_leg(cluster, path, body, param):
    url, _ = cluster
    before = legs_sent(url)
    for stream in (False, True):
        response = httpx.post(f"{url}{path}", json={**body, "stream": stream}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert str(MAX_MODEL_LEN) in error["message"]
    assert legs_sent(url) == before


def test_over_long_anthropic_request_is_400_with_no_leg(cluster):
    url, _ = cluster
    before = legs_sent(url)
    client = anthropic.Anthropic(base_url=url, api_key="unused")
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="tiny-test", max_tokens=4, messages=[{"role": "user", "content": "w " * 400}])
    assert "maximum context length is 256" in raised.value.body["error"]["message"]
    assert legs_sent(url) == before


def test_a_wrong_model_is_404_model_not_found_with_no_leg(cluster):
    url, _ = cluster
    before = legs_sent(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    for create in (lambda: client.chat.completions.create(model="gpt-4", messages=USER, max_tokens=4),
                   lambda: client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)):
        with pytest.raises(openai.NotFoundError) as raised:
            create()
        assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"
    response = httpx.post(f"{url}/v1/messages", json={"model": "claude", "max_tokens": 4, "messages": USER})
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert legs_sent(url) == before


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant"}]}, "messages[1].content"),
    ("/v1/chat/completions", {"messages": USER, "stop": [""]}, "stop[0]"),
    ("/v1/chat/completions", {"messages": USER, "stop": [""] * 1000}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop"),
    ("/v1/chat/completions", {"messages": USER * 5000}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 7}, "top_p"),
])
def test_bad_input_corpus_is_400_naming_the_field_with_no_leg(cluster, path, body, param):
    url, _ = cluster
    before = legs_sent(url)
    response = httpx.post(f"{url}{path}", json={"model": "tiny-test", "max_tokens": 4, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert legs_sent(url) == before


def test_anthropic_bad_input_is_400_with_no_leg(cluster):
    url, _ = cluster
    before = legs_sent(url)
    for body, what in ((({"stop_sequences": [""]}), "empty"), ({"stop_sequences": ["x"] * 17}, "at most 16"),
                       ({"messages": [{"role": "user"}]}, "content")):
        response = httpx.post(f"{url}/v1/messages", json={"model": "tiny-test", "max_tokens": 4, "messages": USER,
                                                          **body})
        assert response.status_code == 400 and response.json()["type"] == "error", response.text
        assert what in response.json()["error"]["message"]
    assert legs_sent(url) == before


@pytest.mark.parametrize("method, path, allow", [
    ("GET", "/v1/completions", "POST"),
    ("GET", "/v1/chat/completions", "POST"),
    ("DELETE", "/v1/models", "GET"),
    ("PUT", "/v1/messages", "POST"),
])
@pytest.mark.parametrize("server", ["orchestrator", "worker"])
def test_wrong_method_is_405_with_allow(cluster, method, path, allow, server):
    """The same answer at the orchestrator as at a worker (it used to be a 400 at the orchestrator)."""
    url = cluster[0] if server == "orchestrator" else cluster[1]
    response = httpx.request(method, f"{url}{path}")
    assert response.status_code == 405 and allow in response.headers["allow"].split(", ")  # GET comes with HEAD
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["code"] == "method_not_allowed" and allow in body["error"]["message"]


@pytest.mark.parametrize("server", ["orchestrator", "worker"])
def test_unknown_route_is_404_in_the_api_shape(cluster, server):
    url = cluster[0] if server == "orchestrator" else cluster[1]
    response = httpx.post(f"{url}/v1/embeddings", json={})
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = httpx.get(f"{url}/v1/messages/nope/deeper/still")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    response = httpx.get(f"{url}/nope")
    assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"


def test_token_ids_are_checked_against_the_workers_vocabulary(cluster):
    url, _ = cluster
    vocab_size = httpx.get(f"{url}/cluster_info").json()["workers"][0]["vocab_size"]
    assert vocab_size > 0
    before = legs_sent(url)
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": [1, vocab_size],
                                                         "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert f"[0, {vocab_size})" in response.json()["error"]["message"]
    assert legs_sent(url) == before
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": [1, vocab_size - 1],
                                                         "max_tokens": 4}, timeout=30)
    assert response.status_code == 200, response.text
