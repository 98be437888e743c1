"""Tool calling at the API edge (in-process app): validation 400s naming the field, history with
tool calls / tool results / thinking through the chat template, Anthropic prefill, the developer role."""

from __future__ import annotations

import msgspec
import pytest

from api.anthropic_api import message_prompt_ids
from api.schemas_anthropic import MessagesRequest
from api.tool_prompt import PromptContext

pytestmark = pytest.mark.asyncio

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


async def chat(harness, **fields):
    body = {"model": harness.model, "messages": USER, "max_tokens": 4, **fields}
    return await harness.http.post("/v1/chat/completions", json=body)


async def messages(harness, **fields):
    body = {"model": harness.model, "messages": USER, "max_tokens": 4, **fields}
    return await harness.http.post("/v1/messages", json=body)


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": OPENAI_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": OPENAI_TOOLS + [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[1].function.parameters"),
    ({"tools": OPENAI_TOOLS * 2}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": 'say "hi"', "parameters": WEATHER}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools[0].function"),
])
async def test_openai_tool_errors_name_the_field(harness, fields, param):
    response = await chat(harness, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize("fields, words", [
    ({"tool_choice": {"type": "any"}}, "requires tools"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}}, "needs a name"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}},
     "disable_parallel_tool_use"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "required": "a"}}]}, "required"),
    ({"tools": [{"name": "f", "type": "bash_20250124", "input_schema": {}}]}, "not supported"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 2000}, "budget_tokens must be >= 1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 2000}, "less than max_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000, "tools": ANTHROPIC_TOOLS,
      "tool_choice": {"type": "any"}}, "thinking may not be enabled"),
])
async def test_anthropic_tool_errors(harness, fields, words):
    response = await messages(harness, **fields)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"], body


async def test_thinking_is_accepted_and_produces_no_thinking_blocks(harness):
    # (enabled needs max_tokens > 1024, beyond the harness's model: its checks are in test_anthropic_tool_errors)
    for thinking in ({"type": "adaptive"}, {"type": "disabled"}):
        response = await messages(harness, thinking=thinking)
        assert response.status_code == 200, response.text
        assert [block["type"] for block in response.json()["content"]] == ["text"]


ANTHROPIC_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C and sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "timeout"}],
         "is_error": True},
        {"type": "text", "text": "Thanks!"},
    ]},
]


async def test_anthropic_history_renders_as_the_templates_tool_calls_and_results(harness):
    # No tools in the request (the harness's model is 256 tokens long): history blocks need none.
    response = await messages(harness, messages=ANTHROPIC_HISTORY)
    assert response.status_code == 200, response.text
    openai_style = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C and sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "Thanks!"},
    ]
    expected = harness.tokenizer.encode_chat(openai_style)
    text = harness.tokenizer.decode(expected, skip_special_tokens=False)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text and "Error: timeout" in text
    count = await harness.http.post("/v1/messages/count_tokens", json={
        "model": harness.model, "messages": ANTHROPIC_HISTORY})
    assert count.json() == {"input_tokens": len(expected)}
    assert response.json()["usage"]["input_tokens"] == len(expected)


async def test_openai_history_with_tool_calls_and_tool_results(harness):
    history = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    response = await chat(harness, messages=history, max_tokens=4)  # no tools: the harness's model is short
    assert response.status_code == 200, response.text
    as_system = [{"role": "system", "content": "Be brief."}, *history[1:]]
    as_system[2] = {**as_system[2], "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    expected = harness.tokenizer.encode_chat(as_system)
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    text = harness.tokenizer.decode(expected, skip_special_tokens=False)
    assert "system<|end_header_id|>" in text and "developer" not in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text and "ipython" in text


async def test_anthropic_prefill_continues_the_assistant_turn(harness):
    prefilled = USER + [{"role": "assistant", "content": "The weather in Paris is"}]
    body = msgspec.convert({"model": harness.model, "messages": prefilled, "max_tokens": 4}, MessagesRequest)
    ids = message_prompt_ids(PromptContext.for_tokenizer(harness.tokenizer), body)
    text = harness.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nThe weather in Paris is")
    response = await messages(harness, messages=prefilled)
    assert response.status_code == 200 and response.json()["usage"]["input_tokens"] == len(ids)
    # An empty prefill opens the turn as if it were absent; a trailing tool_use cannot be continued.
    empty = await messages(harness, messages=USER + [{"role": "assistant", "content": ""}])
    assert empty.json()["usage"]["input_tokens"] == (await messages(harness)).json()["usage"]["input_tokens"]
    dangling = USER + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}]
    response = await messages(harness, messages=dangling, tools=ANTHROPIC_TOOLS)
    assert response.status_code == 400 and "tool_result" in response.json()["error"]["message"]


async def test_tool_choice_none_and_auto_answer_text(harness):
    for choice in ("none", "auto"):
        response = await chat(harness, tools=OPENAI_TOOLS, tool_choice=choice)
        assert response.status_code == 200, response.text
        choice_body = response.json()["choices"][0]
        assert choice_body["finish_reason"] == "length" and "tool_calls" not in choice_body["message"]
    response = await messages(harness, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
    assert response.status_code == 200 and response.json()["stop_reason"] == "max_tokens"
