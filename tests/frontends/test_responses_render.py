"""The Responses API's pure parts: input items to chat messages, chat answers to response
objects and event streams (recorded chat outputs, split anywhere), the store's TTL."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from api.errors import InvalidRequestError
from api.responses import ResponseEventStream, ResponseStore, ResponseTurn
from api.responses.schemas import ResponsesRequest, StoredResponse
from api.responses.translate import chat_body, parse_input, validate_request


def request(**fields) -> ResponsesRequest:
    return msgspec.convert({"model": "m", "input": "hi", **fields}, ResponsesRequest)


TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_input_items_become_chat_messages():
    items = parse_input([
        {"role": "user", "content": "Weather in Paris?"},  # no type: an "easy input message"
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    ])
    body = request(instructions="You are terse.", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                   text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
                   max_output_tokens=7, stream=True)
    validate_request(body, items)
    chat = chat_body(body, items)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]
    assert chat["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},  # text and calls: one turn
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "developer", "content": "Be brief."},
    ]
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}
    assert chat["max_completion_tokens"] == 7 and chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("fields, items, param", [
    ({}, [], "input"),
    ({"max_output_tokens": 0}, None, "max_output_tokens"),
    ({"background": True}, None, "background"),
    ({}, [{"type": "function_call_output", "call_id": "call_9", "output": "x"}], "input[0].call_id"),
])
def test_invalid_requests_name_the_param(fields, items, param):
    body = request(**fields)
    with pytest.raises(InvalidRequestError) as excinfo:
        validate_request(body, parse_input(items if items is not None else "hi"))
    assert excinfo.value.param == param


@pytest.mark.parametrize("item, param", [
    ({"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
     "input[1].content[0].type"),
    ({"type": "web_search_call", "id": "x"}, "input[1].type"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[1]"),
    ({"role": "wizard", "content": "x"}, "input[1].role"),
])
def test_unsupported_items_name_the_field(item, param):
    with pytest.raises(InvalidRequestError) as excinfo:
        parse_input([{"role": "user", "content": "ok"}, item])
    assert excinfo.value.param == param


def test_a_chat_completion_renders_as_a_response():
    turn = ResponseTurn(request(tools=TOOLS), [], parse_input("hi"))
    completion = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39,
                  "prompt_tokens_details": {"cached_tokens": 16}}}
    response, output = turn.from_chat(completion)
    assert response["status"] == "completed" and response["id"].startswith("resp_")
    (call,) = response["output"]
    assert call["type"] == "function_call" and call["call_id"] == "call_a" and call["name"] == "get_weather"
    assert call["arguments"] == '{"city":"Oslo"}' and call["status"] == "completed"
    assert response["usage"] == {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 16},
                                 "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 39}
    # The next turn continues from the call: its output goes back as input.
    assert [type(i).__name__ for i in turn.conversation_after(output)] == ["MessageItem", "FunctionCallItem"]

    response, _ = turn.from_chat({"choices": [{"finish_reason": "length", "message": {"content": "abc"}}]})
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["content"] == [{"type": "output_text", "text": "abc", "annotations": []}]


def sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def delta(**d) -> dict:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}


RECORDED = [  # text, then two calls with arguments in fragments, then usage
    delta(role="assistant", content=""), delta(content="Checking"), delta(content=" now."),
    delta(tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}}]),
    delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city":'}}]),
    delta(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
    delta(tool_calls=[{"index": 1, "id": "call_b", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]),
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}},
]


def run_stream(raw: bytes, split: int) -> tuple[list[dict], list]:
    stored = []

    async def keep(response_json, output):
        stored.append((msgspec.json.decode(response_json), output))

    async def chunks():
        for i in range(0, len(raw), split):
            yield raw[i:i + split]

    async def collect():
        stream = ResponseEventStream(ResponseTurn(request(stream=True), [], parse_input("hi")), keep)
        return b"".join([frame async for frame in stream.run(chunks())])

    out = asyncio.run(collect())
    events = []
    for block in out.split(b"\n\n"):
        if block:
            name, data = block.split(b"\n")
            event = msgspec.json.decode(data[len(b"data: "):])
            assert name == b"event: " + event["type"].encode()
            events.append(event)
    return events, stored


@pytest.mark.parametrize("split", [1, 7, 100000])  # bytes per read: SSE frames re-framed wherever they break
def test_chat_chunks_become_the_reference_event_sequence(split):
    events, stored = run_stream(sse(RECORDED), split)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Checking now."
    assert [(i["call_id"], i["arguments"]) for i in final["output"][1:]] == [
        ("call_a", '{"city":"Oslo"}'), ("call_b", '{"city":"Rome"}')]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert final["usage"]["output_tokens"] == 20
    assert stored[0][0] == final and len(stored[0][1]) == 3


def test_an_error_in_the_chat_stream_fails_the_response():
    raw = sse([delta(content="par"), {"error": {"message": "engine died", "type": "service_unavailable_error",
                                                "code": "engine_dead"}}])
    events, stored = run_stream(raw, 5)
    assert events[-1]["type"] == "response.failed" and not stored
    assert events[-1]["response"]["error"] == {"code": "engine_dead", "message": "engine died"}


def test_a_chat_stream_that_breaks_off_fails_the_response():
    events, stored = run_stream(b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in RECORDED[:3]), 9)
    assert events[-1]["type"] == "response.failed" and not stored
    assert events[-1]["response"]["error"]["code"] == "stream_ended"


def test_an_empty_answer_is_one_empty_message():
    raw = sse([delta(role="assistant", content=""), {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}])
    events, _ = run_stream(raw, 1000)
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_the_store_expires_records(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3", ttl_seconds=10)
    record = StoredResponse("resp_1", 0.0, msgspec.Raw(b'{"id":"resp_1"}'), parse_input("hi"))
    store.put(record, now=100.0)
    assert store.get("resp_1", now=109.0) == record
    assert store.get("resp_1", now=110.0) is None
    other = ResponseStore(tmp_path / "r.sqlite3")  # another process's connection to the same file
    assert other.get("resp_1", now=105.0).conversation == record.conversation
    store.put(StoredResponse("resp_2", 0.0, msgspec.Raw(b"{}"), []), now=200.0)  # drops the expired row
    assert other.delete("resp_1", now=0.0) is False and other.delete("resp_2", now=201.0) is True


def test_every_turn_of_a_conversation_has_one_session_id():
    first = ResponseTurn(request(), [], parse_input("hi"))
    output = first.from_chat({"choices": [{"finish_reason": "stop", "message": {"content": "hello"}}]})[1]
    second = ResponseTurn(request(), first.conversation_after(output), parse_input("again"))
    assert second.session_id == first.session_id and first.session_id.startswith("msg_")
    assert all(item.id for item in second.conversation)
