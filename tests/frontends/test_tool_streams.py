"""The API encodings of parsed tool calls, fed a recorded answer piece by piece: OpenAI chunks
(``delta.tool_calls``: id and name first, then arguments) and Anthropic events (text and tool_use
blocks in order, ``input_json_delta``), and the non-streaming bodies, for text before two calls."""

from __future__ import annotations

import json

import pytest

from api.anthropic_tools import ToolUseMessageStream, message_content
from api.generation import Generation, Piece
from api.openai_api import _ChatStream
from api.openai_tools import ToolCallChatStream, chat_message
from api.schemas_anthropic import MessageEventEncoder
from api.schemas_openai import ChatChunkEncoder
from api.tool_parsers import ToolCallParser, tool_syntax
from workers.sampling_params import SamplingParams

ANSWER = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
TOOLS = ("get_weather", "get_time")


def parser(stream_arguments: bool = False) -> ToolCallParser:
    """An auto request's parser, or with ``stream_arguments`` a streamed forced one's."""
    return ToolCallParser(tool_syntax("hermes"), TOOLS, forced=stream_arguments, streaming=stream_arguments)


def run_stream(encoder, finish_reason: str = "stop", chunk: int = 3) -> list[bytes]:
    generation = Generation(None, None, [1, 2, 3], SamplingParams())
    frames = list(encoder.start(generation))
    pieces = [ANSWER[i:i + chunk] for i in range(0, len(ANSWER), chunk)]
    last = None
    for i, text in enumerate(pieces):
        last = Piece(text, [], None, finish_reason if i == len(pieces) - 1 else None)
        frame = encoder.piece(last)
        if frame:
            frames.append(frame)
    return frames + encoder.finish(generation, last)


def sse_payloads(frames: list[bytes]) -> list[dict]:
    lines = b"".join(frames).decode().split("\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


STREAMING = pytest.mark.parametrize("stream_arguments", [False, True], ids=["whole-calls", "streamed-arguments"])


@STREAMING
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_openai_stream(chunk, stream_arguments):
    chunks = ChatChunkEncoder("chatcmpl-1", 0, "m")
    stream = ToolCallChatStream(_ChatStream(chunks, None, False), chunks,
                                parser(stream_arguments))
    deltas = [p["choices"][0] for p in sse_payloads(run_stream(stream, chunk=chunk))]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == "Checking both."
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    indices = [c["index"] for c in calls]
    assert indices == sorted(indices) and set(indices) == {0, 1}
    if not stream_arguments or chunk == 1000:
        assert indices == [0, 0, 1, 1]  # the name, then the arguments in one fragment
    for index, (name, arguments) in enumerate([("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]):
        first, *rest = [c for c in calls if c["index"] == index]
        assert first["id"].startswith("call_") and first["function"] == {"name": name, "arguments": ""}
        assert rest and all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest)
        assert json.loads("".join(c["function"]["arguments"] for c in rest)) == arguments
    assert [d["finish_reason"] for d in deltas][-1] == "tool_calls"
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    # The text came before the calls, in order.
    kinds = ["text" if d["delta"].get("content") else "call" for d in deltas[1:-1]]
    assert kinds == sorted(kinds, key=lambda k: k != "text")


def test_openai_stream_cut_by_max_tokens_reports_length_and_the_cut_call():
    chunks = ChatChunkEncoder("chatcmpl-1", 0, "m")
    stream = ToolCallChatStream(_ChatStream(chunks, None, False), chunks, parser())
    generation = Generation(None, None, [1], SamplingParams())
    frames = [stream.piece(Piece('<tool_call>{"name": "get_time", "argu', [], None))]
    assert frames == [None]
    frames = stream.finish(generation, Piece("", [], None, "length"))
    deltas = [p["choices"][0] for p in sse_payloads(frames)]
    assert [d["delta"] for d in deltas[:-1]] == [{"tool_calls": [{"index": 0, "id": deltas[0]["delta"]["tool_calls"][0][
        "id"], "type": "function", "function": {"name": "get_time", "arguments": ""}}]}]
    assert deltas[-1]["finish_reason"] == "length"


def test_openai_message():
    message, num_calls = chat_message(ANSWER, parser(), "stop")
    assert num_calls == 2 and message["content"] == "Checking both."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    only_calls, _ = chat_message(ANSWER.split("\n", 1)[1], parser(), "stop")
    assert only_calls["content"] is None


@STREAMING
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_anthropic_stream(chunk, stream_arguments):
    frames = run_stream(ToolUseMessageStream(MessageEventEncoder("msg_1", "m"), parser(stream_arguments)),
                        chunk=chunk)
    events = sse_payloads(frames)
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    blocks: dict[int, dict] = {}
    for event in events[2:-2]:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks) and all(b["stopped"] for b in blocks.values())
            blocks[event["index"]] = {**event["content_block"], "json": "", "stopped": False}
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            assert not block["stopped"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                block["json"] += delta["partial_json"]
        else:
            assert event["type"] == "content_block_stop"
            blocks[event["index"]]["stopped"] = True
    assert [b["type"] for b in blocks.values()] == ["text", "tool_use", "tool_use"]
    assert blocks[0]["text"] == "Checking both."
    assert [(b["name"], json.loads(b["json"])) for b in list(blocks.values())[1:]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert all(b["id"].startswith("toolu_") and b["input"] == {} for b in list(blocks.values())[1:])
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_stream_without_calls_is_one_text_block_ending_the_turn():
    stream = ToolUseMessageStream(MessageEventEncoder("msg_1", "m"), parser())
    generation = Generation(None, None, [1], SamplingParams())
    frames = stream.start(generation) + [stream.piece(Piece("Hello", [], None))]
    events = sse_payloads(frames + stream.finish(generation, Piece("", [], None, "stop")))
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_anthropic_content():
    content = message_content(ANSWER, parser(), "stop")
    assert [b["type"] for b in content] == ["text", "tool_use", "tool_use"]
    assert content[1]["input"] == {"city": "Paris"} and content[2]["name"] == "get_time"
    assert message_content("", parser(), "stop") == [{"type": "text", "text": ""}]


def test_anthropic_streamed_call_cut_short_still_closes_its_block():
    stream = ToolUseMessageStream(MessageEventEncoder("msg_1", "m"), parser(stream_arguments=True))
    generation = Generation(None, None, [1], SamplingParams())
    frames = stream.start(generation) + [stream.piece(Piece('<tool_call>\n{"name": "get_time", "arguments": {"tz',
                                                            [], None))]
    events = sse_payloads(frames + stream.finish(generation, Piece("", [], None, "length")))
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop"]
    assert events[3]["delta"] == {"type": "input_json_delta", "partial_json": '{"tz'}
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
