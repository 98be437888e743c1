"""Agent loops with the official SDKs, shared by the worker and the orchestrator tests: a forced
tool call, its result back in the history, the next turn; every call checked against its schema."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai

# Bounded arguments: a random-weight model fills free strings until max_tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
OPENAI_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
                for name, schema in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": name, "description": f"{name} tool", "input_schema": schema}
                   for name, schema in SCHEMAS.items()]
USER = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
MAX_TOKENS = 96


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


def check_call(name: str, arguments: dict) -> None:
    jsonschema.validate(arguments, SCHEMAS[name])


def openai_loop(client: openai.OpenAI, model: str, tool_choice, stream: bool, **extra) -> None:
    """One forced turn, its results back as ``role: tool``, one more turn."""
    messages = list(USER)
    kwargs = dict(model=model, tools=OPENAI_TOOLS, max_tokens=MAX_TOKENS, **extra)
    if stream:
        calls, finish_reason = collect_stream(client.chat.completions.create(
            messages=messages, tool_choice=tool_choice, stream=True, **kwargs))
    else:
        answer = client.chat.completions.create(messages=messages, tool_choice=tool_choice, **kwargs)
        choice = answer.choices[0]
        finish_reason = choice.finish_reason
        assert choice.message.tool_calls, choice.message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
    assert finish_reason == "tool_calls"
    for call in calls:
        assert call["id"].startswith("call_")
        check_call(call["name"], json.loads(call["arguments"]))
    if isinstance(tool_choice, dict):
        assert [c["name"] for c in calls] == [tool_choice["function"]["name"]]
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"result": "sunny"})} for c in calls]
    follow_up = client.chat.completions.create(messages=messages, tool_choice="required", **kwargs)
    assert follow_up.choices[0].finish_reason == "tool_calls"  # the loop goes on: the next turn is served


def collect_stream(stream) -> tuple[list[dict], str | None]:
    """Tool calls from ``delta.tool_calls``: id and name first, then argument fragments, per index."""
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        assert not choice.delta.content, "a forced call leaked as content"
        for delta in choice.delta.tool_calls or ():
            if delta.index not in calls:
                assert delta.id and delta.function.name, "a call's first delta carries its id and name"
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    assert sorted(calls) == list(range(len(calls))) and calls
    return [calls[i] for i in sorted(calls)], finish_reason


def anthropic_loop(client: anthropic.Anthropic, tool_choice: dict, stream: bool) -> None:
    kwargs = dict(model="tiny", max_tokens=MAX_TOKENS, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    messages = list(USER)
    if stream:
        with client.messages.stream(messages=messages, tool_choice=tool_choice, **kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(messages=messages, tool_choice=tool_choice, **kwargs)
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and all(block.id.startswith("toolu_") for block in uses)
    for block in uses:
        check_call(block.name, block.input)
    if tool_choice["type"] == "tool":
        assert [block.name for block in uses] == [tool_choice["name"]]
    messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": block.id, "content": "sunny", "is_error": i == 1}
        for i, block in enumerate(uses)]})
    follow_up = client.messages.create(messages=messages, tool_choice={"type": "any"}, **kwargs)
    assert follow_up.stop_reason == "tool_use"
