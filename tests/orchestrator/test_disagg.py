"""Disaggregated serving through the orchestrator: a ctx worker, a gen worker (torch engine).

Invariant (docs/architecture.md, "A request's path"): greedy tokens of a disaggregated request equal those
of the same request on one aggregated worker. Skipped while this checkout's
``disagg serve`` does not accept ``--role ctx|gen``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator, wait_until
from worker_process import disagg_worker_args, start_worker, stop_worker

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16  # disagg serve's default



@pytest.fixture(scope="module")
def disagg_cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    common = disagg_worker_args(tmp)
    ctx = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "ctx", *common])
    gen = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "gen", *common])
    both = start_worker(tiny_model_dir, 1, engine="torch")
    url, proc = start_orchestrator(tmp, tiny_model_dir, [("ctx", ctx[0]), ("gen", gen[0])], processes=2,
                                   conditional={"enabled": False})
    yield url, both[0]
    assert stop_orchestrator(proc) == 0
    for _, worker in (ctx, gen, both):
        stop_worker(worker)


def test_greedy_tokens_equal_an_aggregated_worker(disagg_cluster):
    url, aggregated = disagg_cluster
    prompt = "a long prompt about disaggregated serving " * 4
    kwargs = dict(model="tiny-test", prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True)
    expected = httpx.post(f"{aggregated}/v1/completions", json=kwargs).json()["choices"][0]["text"]
    response = httpx.post(f"{url}/v1/completions", json=kwargs, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-disagg-mode"] == "disagg" and response.headers["x-disagg-ctx-worker"] == "static-0"
    assert response.headers["x-disagg-gen-worker"] == "static-1"
    body = response.json()
    assert body["choices"][0]["text"] == expected and "disaggregated_params" not in body
    assert body["usage"]["completion_tokens"] == 12
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    streamed = client.completions.create(stream=True, **{k: v for k, v in kwargs.items() if k != "ignore_eos"},
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_chat_through_both_legs_matches(disagg_cluster):
    url, aggregated = disagg_cluster
    body = {"model": "tiny-test", "messages": [{"role": "user", "content": "tell me a story " * 5}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    expected = httpx.post(f"{aggregated}/v1/chat/completions", json=body).json()["choices"][0]["message"]
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.headers["x-disagg-mode"] == "disagg"
    assert response.json()["choices"][0]["message"]["content"] == expected["content"]


def test_perf_metrics_join_both_legs(disagg_cluster):
    url, _ = disagg_cluster
    httpx.post(f"{url}/v1/completions", headers={"x-request-id": "joined-1"}, timeout=60,
               json={"model": "tiny-test", "prompt": "join me " * 10, "max_tokens": 4, "ignore_eos": True})

    def joined():  # the orchestrator process that served it pushes its records every 0.2 s
        records = {r["request_id"]: r for r in httpx.get(f"{url}/perf_metrics").json()["records"]}
        record = records.get("joined-1")
        return record if record and record["ctx_worker"] and record["gen_worker"] else None

    record = wait_until(joined, timeout=10)
    assert record["mode"] == "disagg"
    assert record["ctx"]["start"] <= record["ctx"]["end"] <= record["gen"]["start"] <= record["end"]
    ctx_worker, gen_worker = record["ctx_worker"], record["gen_worker"]
    assert ctx_worker["worker_id"] == "static-0" and gen_worker["worker_id"] == "static-1"
    assert ctx_worker["record"]["request_id"] == int(record["ctx"]["engine_request_id"])
    # Joined exactly, on the x-request-id each leg carried; the workers' clocks were measured.
    assert ctx_worker["record"]["x_request_id"] == "joined-1-ctx"
    assert gen_worker["record"]["x_request_id"] == "joined-1-gen"
    assert abs(ctx_worker["clock_offset"]) < 0.5 and abs(gen_worker["clock_offset"]) < 0.5  # one host
    assert ctx_worker["record"]["num_prompt_tokens"] == gen_worker["record"]["num_prompt_tokens"] == \
        record["num_prompt_tokens"]
    assert gen_worker["record"]["kv_transfer_blocks"] >= 1  # the gen worker pulled the prompt's KV


def test_structured_outputs_through_both_legs(disagg_cluster):
    """Each of the 20 test schemas: the gen leg continues the ctx leg's grammar, the answer
    validates and equals the aggregated worker's (greedy)."""
    import json
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    sys.path.insert(0, str(REPO / "tests"))
    from json_schemas import SCHEMAS

    url, aggregated = disagg_cluster
    clients = [openai.OpenAI(base_url=f"{u}/v1", api_key="unused") for u in (url, aggregated)]

    def ask(item):
        (i, schema), client = item
        response = client.chat.completions.create(
            model="tiny-test", max_tokens=200, temperature=0, messages=[{"role": "user", "content": f"JSON {i}"}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        return response.choices[0].message.content, response.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        disagg = list(pool.map(ask, [(item, clients[0]) for item in enumerate(SCHEMAS)]))
        reference = list(pool.map(ask, [(item, clients[1]) for item in enumerate(SCHEMAS)]))
    assert disagg == reference
    for (text, finish_reason), schema in zip(disagg, SCHEMAS):
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_a_multi_turn_session_pulls_only_what_the_gen_worker_lacks(disagg_cluster):
    """Ten turns of one conversation (greedy, each answer fed back): the gen worker keeps the earlier
    turns in its prefix cache, so each turn's KV pull moves at most the blocks of the tokens the turn
    added plus the partial block before them; every answer equals the aggregated worker's, which
    computed the whole prompt itself."""
    url, aggregated = disagg_cluster
    messages = [{"role": "system", "content": "You answer questions about serving systems. " * 6}]
    previous_prompt = 0
    for turn in range(10):
        messages.append({"role": "user", "content": f"question {turn}: what is step {turn} of the path? " * 3})
        body = {"model": "tiny-test", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        expected = httpx.post(f"{aggregated}/v1/chat/completions", json=body, timeout=60).json()
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                              headers={"x-request-id": f"session-turn-{turn}"})
        assert response.status_code == 200 and response.headers["x-disagg-mode"] == "disagg", response.text
        answer = response.json()
        assert answer["choices"][0]["message"] == expected["choices"][0]["message"]
        prompt_tokens = answer["usage"]["prompt_tokens"]

        def gen_record(request_id=f"session-turn-{turn}"):
            records = {r["request_id"]: r for r in httpx.get(f"{url}/perf_metrics").json()["records"]}
            record = records.get(request_id)
            return record["gen_worker"]["record"] if record and record["gen_worker"] else None

        pulled = wait_until(gen_record, timeout=10)["kv_transfer_blocks"]
        new_blocks = -(-(prompt_tokens - previous_prompt) // BLOCK_SIZE)
        assert 1 <= pulled <= new_blocks + 1, (turn, pulled, prompt_tokens, previous_prompt)
        if turn:
            assert pulled < prompt_tokens // BLOCK_SIZE  # not the whole prompt again
        previous_prompt = prompt_tokens
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
