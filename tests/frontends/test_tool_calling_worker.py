"""Agent loops through a real worker (launcher + torch engine + 2 frontends, the random-weight tiny
model) with the official SDKs: forced tool calls come back parsed and valid, their results go back
in the history, and the next turn runs.

The tiny model's template writes Llama-3 JSON calls; the grammar that forces them is built by
``api.tool_calls`` and enforced by the engine, so even random weights produce a call whose
arguments validate against the tool's schema.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from tool_loops import USER, anthropic_client, anthropic_loop, openai_client, openai_loop
from worker_process import start_worker, stop_worker


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2, engine="torch", extra_args=["--served-model-name", "tiny"])
    yield url
    assert stop_worker(proc) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_openai_required_loop(worker, stream):
    openai_loop(openai_client(worker), "tiny", "required", stream, parallel_tool_calls=False, temperature=0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_openai_named_function_loop(worker, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    openai_loop(openai_client(worker), "tiny", choice, stream, temperature=0)


def test_openai_required_sampled_with_parallel_calls(worker):
    client = openai_client(worker)
    for seed in range(3):
        openai_loop(client, "tiny", "required", False, temperature=1.0, seed=seed)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_anthropic_any_loop(worker, stream):
    anthropic_loop(anthropic_client(worker), {"type": "any", "disable_parallel_tool_use": True}, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_anthropic_named_tool_loop(worker, stream):
    anthropic_loop(anthropic_client(worker), {"type": "tool", "name": "get_weather"}, stream)


def test_a_forced_call_wins_over_response_format(worker):
    # The answer is the call: response_format would constrain a text answer, and there is none.
    openai_loop(openai_client(worker), "tiny", "required", False, parallel_tool_calls=False, temperature=0,
                response_format={"type": "json_object"})


UNSUPPORTED = [  # (schema, where, words): what no grammar enforces; a free-form (auto) call takes them
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"not": {"type": "string"}}}}},
     "properties.a.items.not", ['keyword "not" is not supported', "remove it"]),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "bogus"}}},
     "properties.when.format", ['"format": "bogus" is not a known format', '"pattern"']),
]
LLGUIDANCE_WORDS = ("%json", "fn_0", "<tool_call>", "x-guidance", "failed to compile", "Unimplemented keys",
                    "regex parse error", "^^^")


def tool_error(worker, schema: dict, **fields) -> dict:
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(worker).chat.completions.create(model="tiny", messages=USER, max_tokens=4, tools=tools,
                                                      **fields)
    for internal in LLGUIDANCE_WORDS:
        assert internal not in info.value.body["message"], info.value.body
    return info.value.body


@pytest.mark.parametrize("schema, path, words", UNSUPPORTED)
def test_a_schema_a_forced_call_cannot_enforce_is_a_400_in_the_users_terms(worker, schema, path, words):
    error = tool_error(worker, schema, tool_choice="required")
    assert error["param"] == f"tools[0].function.parameters.{path}", error
    assert all(word in error["message"] for word in words), error
    assert "cannot be enforced for a forced call" in error["message"] and "tool_choice auto" in error["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    answer = openai_client(worker).chat.completions.create(model="tiny", messages=USER, max_tokens=4, tools=tools)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_pattern_no_regex_engine_reads_is_a_400_in_the_users_terms(worker):
    error = tool_error(worker, {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?=x)y"}}})
    assert error["param"] == "tools[0].function.parameters.properties.code.pattern", error
    assert '"pattern" is not supported as written (look-around' in error["message"], error


def test_an_anthropic_server_tool_is_refused_as_one(worker):
    client = anthropic_client(worker)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=USER,
                               tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}])
    message = info.value.body["error"]["message"]
    assert "server tools are not supported" in message and "'web_search_20250305'" in message, message
    assert "custom tool" in message and "input_schema" in message and "missing required field" not in message
    with pytest.raises(anthropic.BadRequestError, match=r"tools\[0\] \('f'\) needs an input_schema"):
        client.messages.create(model="tiny", max_tokens=4, messages=USER, tools=[{"name": "f"}])
