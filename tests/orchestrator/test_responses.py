"""/v1/responses through the orchestrator in disaggregated mode (ctx + gen torch workers),
with the official ``openai`` client: the same answers as one aggregated worker's /v1/responses,
the event stream, stored conversations continued by the orchestrator, errors in Responses terms."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import disagg_worker_args, start_worker, stop_worker


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    common = disagg_worker_args(tmp)
    ctx = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "ctx", *common])
    gen = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "gen", *common])
    url, proc = start_orchestrator(tmp, tiny_model_dir, [("ctx", ctx[0]), ("gen", gen[0])], processes=2,
                                   conditional={"enabled": False})
    # The gen worker serves plain requests too: asked directly, it is one aggregated worker.
    yield url, gen[0]
    assert stop_orchestrator(proc) == 0
    for _, worker in (ctx, gen):
        stop_worker(worker)


def client_of(url: str) -> openai.OpenAI:
    # Fresh connections: requests spread over the orchestrator's two processes, which share the store.
    http = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http, max_retries=0)


KWARGS = dict(model="tiny-test", instructions="Answer briefly.", max_output_tokens=8, temperature=0)


def test_disaggregated_answers_equal_an_aggregated_worker(cluster):
    url, aggregated = cluster
    client, alone = client_of(url), client_of(aggregated)
    raw = client.responses.with_raw_response.create(input="Tell me about prefill.", **KWARGS)
    assert raw.headers["x-disagg-mode"] == "disagg"
    response = raw.parse()
    expected = alone.responses.create(input="Tell me about prefill.", **KWARGS)
    assert response.output_text == expected.output_text and response.status == expected.status
    assert response.usage.input_tokens == expected.usage.input_tokens
    assert response.usage.output_tokens == expected.usage.output_tokens

    events = list(client.responses.create(input="Tell me about prefill.", stream=True, **KWARGS))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{response.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.output_text


def test_the_orchestrator_continues_stored_conversations(cluster):
    url, aggregated = cluster
    client = client_of(url)
    first = client.responses.create(input="My name is Ada.", **KWARGS)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, **KWARGS)
    # The orchestrator rendered the whole conversation: the same prompt, sent as explicit items,
    # costs an aggregated worker exactly as many input tokens and gives the same answer.
    history = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    explicit = client_of(aggregated).responses.create(input=history, **KWARGS)
    assert second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == explicit.output_text

    with client.responses.stream(input="And again?", previous_response_id=second.id, **KWARGS) as stream:
        events = list(stream)
    third = events[-1].response
    assert third.previous_response_id == second.id
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    # Its prompt starts with the second's, which is in the workers' prefix caches by now.
    assert third.usage.input_tokens_details.cached_tokens >= 16
    for _ in range(4):  # either orchestrator process: one store
        assert client.responses.retrieve(third.id).output_text == third.output_text
        assert len(client.responses.input_items.list(third.id).data) == 5  # 3 inputs, 2 outputs
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # Deleting an earlier response does not break the conversations that continue it.
    assert client.responses.create(input="Still there?", previous_response_id=second.id, **KWARGS).output_text


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    ({"input": "x", "max_output_tokens": 100000}, 400, "max_output_tokens"),  # the worker's 400, renamed
    ({"input": "x", "temperature": -1}, 400, "temperature"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": "x", "model": "nope"}, 404, "model"),
])
def test_invalid_requests(cluster, body, status, param):
    url, _ = cluster
    response = httpx.post(f"{url}/v1/responses", json={"model": "tiny-test", **body}, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert "max_completion_tokens" not in response.json()["error"]["message"]


# --- an agent loop: forced function calls, their outputs back, the next turn ----------------

# Function calls are the chat path's parsed tool calls, forced by its grammars (the engine's masks).

# Bounded arguments: a random-weight model fills free strings until max_output_tokens.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "name": name, "description": f"{name} tool", "parameters": schema}
         for name, schema in SCHEMAS.items()]
TOOL_KWARGS = dict(model="tiny-test", tools=TOOLS, max_output_tokens=96, temperature=0)


def forced_turn(client: openai.OpenAI, stream: bool, **kwargs):
    if not stream:
        return client.responses.create(**TOOL_KWARGS, **kwargs)
    with client.responses.stream(**TOOL_KWARGS, **kwargs) as events:
        seen = [event.type for event in events]
        response = events.get_final_response()
    assert "response.function_call_arguments.delta" in seen and seen[-1] == "response.completed"
    return response


def checked_calls(response, name: str | None = None) -> list:
    assert response.status == "completed", response
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.call_id and call.id
        if name is not None:
            assert call.name == name
    return calls


@pytest.mark.parametrize("target", ["orchestrator", "worker"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}],
                         ids=["required", "named"])
def test_agent_loop_with_previous_response_id(cluster, target, stream, tool_choice):
    url, worker = cluster
    client = client_of(url if target == "orchestrator" else worker)
    name = tool_choice["name"] if isinstance(tool_choice, dict) else None
    first = forced_turn(client, stream, input="What is the weather in Paris for 3 days?", tool_choice=tool_choice,
                        parallel_tool_calls=False)
    calls = checked_calls(first, name)
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"result": "sunny"})}
               for call in calls]
    second = forced_turn(client, stream, input=outputs, previous_response_id=first.id, tool_choice="required")
    checked_calls(second)
    # The second prompt holds the first turn: its question, the call and the call's output.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


# text.format is the chat path's response_format, enforced by the engine's grammar masks.
@pytest.mark.parametrize("target", ["orchestrator", "worker"])
def test_text_format_json_schema(cluster, target):
    url, worker = cluster
    client = client_of(url if target == "orchestrator" else worker)
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    response = client.responses.create(model="tiny-test", input="Weather as JSON", text={"format": fmt},
                                       max_output_tokens=64, temperature=0)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    events = list(client.responses.create(model="tiny-test", input="Weather as JSON", text={"format": fmt},
                                          max_output_tokens=64, temperature=0, stream=True))
    assert events[-1].response.output_text == response.output_text
    response = client.responses.create(model="tiny-test", input="Any JSON", text={"format": {"type": "json_object"}},
                                       max_output_tokens=64, temperature=0)
    if response.status == "completed":  # an object with free keys may not close within the budget
        assert isinstance(json.loads(response.output_text), dict)
