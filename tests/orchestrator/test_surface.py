"""One API surface at the orchestrator: a ctx worker, a gen worker (torch engine) and the orchestrator
in disaggregated mode (no conditional skip), one deployment for the whole module.

- count_tokens, /tokenize, /detokenize, /v1/models/{id}, /version answer as a worker does, 4xx included;
- a Message Batch created at the orchestrator runs through ctx + gen workers, waits out a gen worker
  restart and an orchestrator restart (its store is on disk), and its results are retrievable;
- a 10-turn conversation reports growing cached prompt tokens on both APIs, streamed and not, and
  the gen worker's ``disagg_prompt_cached_tokens_total`` moves.
"""

from __future__ import annotations

import re
import time

import anthropic
import httpx
import openai
import pytest
from disagg_cluster import DisaggCluster
from orchestrator_process import stop_orchestrator, wait_until
from worker_process import stop_worker

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    cluster = DisaggCluster(tmp_path_factory.mktemp("surface"), tiny_model_dir)
    yield cluster
    cluster.close()


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count the stars tonight."}]


def test_tokenizer_routes_answer_as_a_worker_does(cluster):
    for path, body in [("/tokenize", {"model": MODEL, "prompt": "Hello there"}),
                       ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}),
                       ("/detokenize", {"model": MODEL, "tokens": [5, 6, 7, 8]})]:
        here, there = httpx.post(cluster.url + path, json=body), httpx.post(cluster.gen_url + path, json=body)
        assert here.status_code == there.status_code == 200, here.text
        assert here.json() == there.json()
    assert httpx.post(cluster.url + "/tokenize", json={"prompt": "x"}).json()["max_model_len"] > 0
    for path, body, param in [("/tokenize", {"model": MODEL}, "prompt"),
                              ("/detokenize", {"tokens": [-3]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens")]:
        response = httpx.post(cluster.url + path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    unknown = httpx.post(cluster.url + "/tokenize", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert httpx.post(cluster.url + "/detokenize", content=b"[").status_code == 400


def test_models_version_and_count_tokens(cluster):
    client = cluster.openai()
    model = client.models.retrieve(MODEL)
    worker_card = httpx.get(f"{cluster.gen_url}/v1/models/{MODEL}").json()
    assert model.id == MODEL and model.model_extra["max_model_len"] == worker_card["max_model_len"] > 0
    assert client.models.list().data[0].model_extra["max_model_len"] == worker_card["max_model_len"]
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.models.retrieve("someone/else")
    assert excinfo.value.code == "model_not_found"
    assert httpx.get(f"{cluster.url}/version").json() == httpx.get(f"{cluster.gen_url}/version").json()

    claude = cluster.anthropic()
    kwargs = dict(model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Count the stars."}])
    count = claude.messages.count_tokens(**kwargs)
    assert count.input_tokens == httpx.post(f"{cluster.gen_url}/v1/messages/count_tokens", json=kwargs).json()[
        "input_tokens"] > 0
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.count_tokens(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert bad.value.body["type"] == "error" and "messages[0].role" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "x"}])


def _batch_requests(n: int) -> list[dict]:
    return [{"custom_id": f"q-{i}", "params": {"model": MODEL, "max_tokens": 6, "temperature": 0,
                                              "messages": [{"role": "user", "content": f"Batch question {i}"}]}}
            for i in range(n)] + [{"custom_id": "bad", "params": {"model": MODEL, "max_tokens": 0,
                                                                  "messages": [{"role": "user", "content": "x"}]}}]


def _wait_ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 60.0):
    return wait_until(lambda: (b := client.messages.batches.retrieve(batch_id)).processing_status == "ended" and b,
                      timeout, interval=0.2)


def test_batch_runs_through_both_legs(cluster):
    client = cluster.anthropic()
    batch = client.messages.batches.create(requests=_batch_requests(3))
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 4
    ended = _wait_ended(client, batch.id)
    assert ended.request_counts.succeeded == 3 and ended.request_counts.errored == 1
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert results["bad"].type == "errored" and "max_tokens" in results["bad"].error.error.message
    params = _batch_requests(1)[0]["params"]
    direct = client.messages.create(extra_body={"temperature": params.pop("temperature")}, **params)
    assert results["q-0"].type == "succeeded" and results["q-0"].message.content[0].text == direct.content[0].text
    assert [b.id for b in client.messages.batches.list(limit=5)][0] == batch.id  # any process: one store

    def joined():  # each batch request ran as a disaggregated request, under its own id
        records = {r["request_id"]: r for r in httpx.get(f"{cluster.url}/perf_metrics").json()["records"]}
        record = records.get(f"{batch.id}[1]")
        return record if record and record["ctx_worker"] and record["gen_worker"] else None

    record = wait_until(joined, timeout=10)
    assert record["mode"] == "disagg" and record["gen_worker"]["record"]["kv_transfer_blocks"] >= 1
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(requests=[{"custom_id": "no spaces", "params": {}}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_nope")
    unknown = httpx.get(f"{cluster.url}/v1/messages/batches/{batch.id}/elsewhere")
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"
    pending = httpx.get(f"{cluster.url}/v1/messages/batches?limit=0")
    assert pending.status_code == 400 and pending.json()["error"]["type"] == "invalid_request_error"


def test_batch_survives_a_worker_and_an_orchestrator_restart(cluster):
    gen_port = cluster.gen.port
    stop_worker(cluster.gen)
    wait_until(lambda: not httpx.get(f"{cluster.url}/cluster_info").json()["workers"][1]["healthy"], 10)
    client = cluster.anthropic()
    batch = client.messages.batches.create(requests=_batch_requests(4)[:4])
    time.sleep(1.0)
    waiting = client.messages.batches.retrieve(batch.id)
    assert waiting.processing_status == "in_progress" and waiting.request_counts.processing == 4
    assert waiting.request_counts.errored == 0  # nothing failed for want of a worker

    stop_orchestrator(cluster.orch)  # the store is on disk: the next orchestrator continues the batch
    cluster.url, cluster.orch = cluster.start_orchestrator(wait_healthy=False)  # the gen worker is down
    _, cluster.gen = cluster.start_worker("gen", port=gen_port)
    ended = _wait_ended(cluster.anthropic(), batch.id)
    assert ended.request_counts.succeeded == 4, ended
    results = list(cluster.anthropic().messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == [f"q-{i}" for i in range(4)]
    assert all(r.result.type == "succeeded" and r.result.message.usage.output_tokens == 6 for r in results)


def _gen_cached_counter(cluster) -> float:
    text = httpx.get(f"{cluster.gen_url}/prometheus/metrics").text
    match = re.search(r"^disagg_prompt_cached_tokens_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _turn_text(conversation: str, turn: int) -> str:
    return f"{conversation} turn {turn}: tell me one more thing about the sea, the sky and the stars."


def test_growing_conversation_reports_growing_cached_tokens(cluster):
    before = _gen_cached_counter(cluster)
    client = cluster.openai()
    messages: list[dict] = [{"role": "system", "content": "You are a patient narrator."}]
    cached = []
    for turn in range(10):
        messages.append({"role": "user", "content": _turn_text("openai", turn)})
        kwargs = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        if turn % 2:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            answer = client.chat.completions.create(**kwargs)
            text, usage = answer.choices[0].message.content, answer.usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < usage.prompt_tokens
        messages.append({"role": "assistant", "content": text})
    assert cached[0] == 0 and all(a < b for a, b in zip(cached, cached[1:])), cached

    claude = cluster.anthropic()
    history: list[dict] = []
    read = []
    for turn in range(10):
        history.append({"role": "user", "content": _turn_text("anthropic", turn)})
        kwargs = dict(model=MODEL, system="You are a patient narrator.", messages=history, max_tokens=6,
                      extra_body={"temperature": 0})
        if turn % 2:
            with claude.messages.stream(**kwargs) as stream:
                message = stream.get_final_message()
        else:
            message = claude.messages.create(**kwargs)
        usage = message.usage
        assert usage.cache_creation_input_tokens == 0
        assert usage.input_tokens + usage.cache_read_input_tokens == claude.messages.count_tokens(
            model=MODEL, system="You are a patient narrator.", messages=history).input_tokens
        read.append(usage.cache_read_input_tokens)
        history.append({"role": "assistant", "content": message.content[0].text})
    assert all(a < b for a, b in zip(read, read[1:])), read
    # The gen engine's own hits (KV it did not pull) count on its worker's counter.
    wait_until(lambda: _gen_cached_counter(cluster) > before, timeout=5)
