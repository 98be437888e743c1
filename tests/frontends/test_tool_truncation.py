"""A model output with 1-3 tool calls, cut by ``max_tokens`` at random points: the streamed answer, as
the official SDKs assemble it (openai's ``ChatCompletionStreamState``, anthropic's
``accumulate_event``), equals the non-streamed one on chat, messages and Responses, in both call
formats, forced or not. A cut call is a call with the arguments written so far, never text holding
the format's markup; every Anthropic block started is stopped, one index each."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from api.anthropic_tools import ToolUseMessageStream, message_content
from api.generation import Generation, Piece
from api.openai_api import _ChatStream
from api.openai_tools import ToolCallChatStream, chat_message
from api.responses.render import ResponseEventStream, ResponseTurn
from api.responses.schemas import ResponsesRequest
from api.schemas_anthropic import MessageEventEncoder
from api.schemas_openai import ChatChunkEncoder
from api.tool_parsers import CutCall, ToolCallParser, tool_syntax
from api.tool_parsers.partial_json import partial_object
from workers.sampling_params import SamplingParams

TOOLS = ("get_weather", "get_time")
OPENERS = {"hermes": "<tool_call>", "llama3_json": '{"name"'}
SEPARATORS = {"hermes": "\n", "llama3_json": "; "}  # between parallel calls, as the grammars write them
NUM_OUTPUTS = 60
CUTS_PER_OUTPUT = 6


def random_arguments(rng: random.Random) -> dict:
    words = ["Paris", 'say "hi"', "a\\b", "é ü", "x" * rng.randrange(1, 30)]
    value = {"city": rng.choice(words), "days": rng.randrange(-5, 500), "hot": rng.choice([True, False, None]),
             "temps": [rng.uniform(-10, 40) for _ in range(rng.randrange(3))]}
    return {key: value[key] for key in rng.sample(sorted(value), rng.randrange(len(value) + 1))}


def model_output(fmt: str, rng: random.Random, forced: bool) -> str:
    calls = [(rng.choice(TOOLS), random_arguments(rng)) for _ in range(rng.randrange(1, 4))]
    syntax = tool_syntax(fmt)
    text = SEPARATORS[fmt].join(syntax.render_calls([call]) for call in calls)
    return text if forced else "Let me check.\n" + text


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(encoder, parts: list[str]) -> list[bytes]:
    generation = Generation(None, None, [1, 2, 3], SamplingParams())
    frames = list(encoder.start(generation))
    for part in parts:
        frame = encoder.piece(Piece(part, [], None))
        if frame:
            frames.append(frame)
    return frames + encoder.finish(generation, Piece("", [], None, "length"))


def payloads(frames: list[bytes]) -> list[dict]:
    lines = b"".join(frames).decode().split("\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def parser(fmt: str, forced: bool, streaming: bool) -> ToolCallParser:
    return ToolCallParser(tool_syntax(fmt), TOOLS, forced=forced, streaming=streaming)


def chat_both(fmt: str, forced: bool, text: str, parts: list[str]) -> tuple[dict, dict, list[bytes]]:
    message, num_calls = chat_message(text, parser(fmt, forced, False), "length")
    plain = {"content": message["content"] or "", "finish_reason": "length",
             "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]}
    chunks = ChatChunkEncoder("chatcmpl-1", 0, "m")
    frames = stream(ToolCallChatStream(_ChatStream(chunks, None, False), chunks, parser(fmt, forced, True)), parts)
    state = ChatCompletionStreamState()
    for payload in payloads(frames):
        state.handle_chunk(ChatCompletionChunk.model_validate(payload))
    choice = state.current_completion_snapshot.choices[0]
    streamed = {"content": choice.message.content or "", "finish_reason": choice.finish_reason,
                "calls": [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]}
    return plain, streamed, frames


def messages_both(fmt: str, forced: bool, text: str, parts: list[str]) -> tuple[list, list, list[dict]]:
    plain = message_content(text, parser(fmt, forced, False), "length")
    events = payloads(stream(ToolUseMessageStream(MessageEventEncoder("msg_1", "m"), parser(fmt, forced, True)),
                             parts))
    snapshot, json_bufs = None, {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot.stop_reason == "max_tokens"
    streamed = [block.model_dump(include={"type", "text", "name", "input"}) for block in snapshot.content]
    return [{k: v for k, v in block.items() if k != "id"} for block in plain], streamed, events


def responses_both(chat_frames: list[bytes], text: str, fmt: str, forced: bool) -> tuple[list, list]:
    turn = ResponseTurn(msgspec.convert({"model": "m", "input": "hi"}, ResponsesRequest), [], [])
    message, _ = chat_message(text, parser(fmt, forced, False), "length")
    _, output = turn.from_chat({"choices": [{"message": message, "finish_reason": "length"}]})

    async def frames():
        for frame in chat_frames:
            yield frame

    async def run() -> list[bytes]:
        return [frame async for frame in ResponseEventStream(turn).run(frames())]

    events = payloads(asyncio.run(run()))
    assert events[-1]["type"] == "response.incomplete"
    return [_item(i) for i in msgspec.to_builtins(output)], [_item(i) for i in events[-1]["response"]["output"]]


def _item(item: dict) -> tuple:
    if item["type"] == "message":
        return ("message", "".join(part["text"] for part in item["content"]))
    return ("function_call", item["name"], item["arguments"])


def check_no_markup(fmt: str, texts: list[str]) -> None:
    for text in texts:
        assert OPENERS[fmt] not in text and "</tool_call" not in text, text


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "auto"])
@pytest.mark.parametrize("fmt", sorted(OPENERS))
def test_streamed_and_plain_answers_agree_at_every_cut(fmt, forced):
    rng = random.Random(f"{fmt}-{forced}")
    for _ in range(NUM_OUTPUTS):
        output = model_output(fmt, rng, forced)
        for cut in [len(output)] + [rng.randrange(1, len(output)) for _ in range(CUTS_PER_OUTPUT)]:
            text, parts = output[:cut], pieces(output[:cut], rng)
            where = f"{text!r} in {parts!r}"
            plain, streamed, chat_frames = chat_both(fmt, forced, text, parts)
            assert plain == streamed, where
            check_no_markup(fmt, [plain["content"]])
            if forced:
                assert plain["content"] == "", where
            for name, arguments in plain["calls"]:
                assert name in TOOLS and output.find(arguments) >= 0, where  # what the model wrote so far
            blocks, assembled, events = messages_both(fmt, forced, text, parts)
            assert blocks == assembled, where
            check_no_markup(fmt, [block["text"] for block in blocks if block["type"] == "text"])
            starts = [e["index"] for e in events if e["type"] == "content_block_start"]
            stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
            assert starts == stops == list(range(len(blocks))), where
            items, streamed_items = responses_both(chat_frames, text, fmt, forced)
            assert items == streamed_items, where


def test_a_call_cut_inside_its_closing_tag_is_whole():
    """The issue's case: repeated forced calls, the limit inside the second one's closing tag."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    for forced in (True, False):
        message, num_calls = chat_message(call + "\n" + call[:-1], parser("hermes", forced, False), "length")
        assert num_calls == 2 and message["content"] is None
        assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"tz": "UTC"}'] * 2


@pytest.mark.parametrize("fmt", sorted(OPENERS))
def test_a_call_cut_before_its_name_is_dropped_and_logged(fmt, caplog):
    output = tool_syntax(fmt).render_calls([("get_time", {"tz": "UTC"})])
    opener_end = output.index('"name"') + len('"name": "get')
    caplog.set_level(logging.DEBUG, logger="api.tool_parsers.base")
    message, num_calls = chat_message(output[:opener_end], parser(fmt, True, False), "length")
    assert (message, num_calls) == ({"role": "assistant", "content": ""}, 0)
    assert "cut before its name" in caplog.text


def test_a_cut_call_is_logged_with_its_arguments_so_far(caplog):
    caplog.set_level(logging.DEBUG, logger="api.tool_parsers.base")
    events = parser("hermes", True, False).parse('<tool_call>\n{"name": "get_time", "arguments": {"tz": "U', cut=True)
    assert events == [CutCall(0, "get_time", '{"tz": "U')] and events[0].arguments == {}
    assert "tool call 0 (get_time) cut after 9 characters of arguments" in caplog.text


def test_an_unforced_call_the_model_ended_early_stays_text():
    """No limit cut it: the model stopped inside a call of its own accord, so it is not one."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "U'
    message, num_calls = chat_message(text, parser("hermes", False, False), "stop")
    assert num_calls == 0 and message["content"] == text


@pytest.mark.parametrize("text, expected", [
    ('{"a": {"b": [1, 2.', {"a": {"b": [1]}}), ('{"a": "unfinished', {}), ('{"a": 1, "b', {"a": 1}),
    ('{"a": tr', {}), ('{"a": -12', {"a": -12}), ('{"a": -12e', {}), ("", {}), ('{"a": "x\\"', {}),
    ('{"a": "x\\\\"', {"a": "x\\"}), ('[1, 2', {}),
])
def test_partial_object(text, expected):
    assert partial_object(text) == expected


def test_partial_object_is_what_the_sdks_assemble():
    from jiter import from_json  # what the anthropic SDK parses input_json_delta with

    rng = random.Random(7)
    for _ in range(300):
        text = json.dumps(random_arguments(rng), ensure_ascii=rng.random() < 0.5)
        for cut in range(1, len(text) + 1):
            assert partial_object(text[:cut]) == from_json(text[:cut].encode(), partial_mode=True), text[:cut]
