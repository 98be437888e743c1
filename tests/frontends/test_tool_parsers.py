"""Tool-call parsers on recorded model outputs: whole, and split across stream chunks at every boundary."""

from __future__ import annotations

import json
import time

import pytest

from api.tool_parsers import (
    ArgumentsDelta,
    CallHead,
    CutCall,
    ParsedCall,
    TextDelta,
    ToolCallParser,
    detect_tool_syntax,
    tool_syntax,
)
from workers.engine.model.tiny_tokenizer import CHAT_TEMPLATE

TOOLS = ("get_weather", "get_time")

# (format, model output, expected text, expected calls [(name, arguments)]).
RECORDED = [
    # Qwen2.5-7B-Instruct, one call.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # Hermes-3: text before the call.
    ("hermes", 'Let me look that up.\n<tool_call>\n{"arguments": {"city": "Zürich"}, "name": "get_weather"}\n</tool_call>',
     "Let me look that up.", [("get_weather", {"city": "Zürich"})]),
    # Qwen2.5: two parallel calls.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    # Stopped with EOS right after the JSON (no closing tag).
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    # Malformed JSON: text, verbatim.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', []),
    # Truncated by max_tokens: text, verbatim.
    ("hermes", 'Sure. <tool_call>\n{"name": "get_weather", "argu', 'Sure. <tool_call>\n{"name": "get_weather", "argu', []),
    # A tool the request does not offer: text.
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    # Plain text mentioning the tag's look-alikes.
    ("hermes", "Use <b>bold</b> and a < b, or <tool_use>.", "Use <b>bold</b> and a < b, or <tool_use>.", []),
    # Braces and closing tags inside argument strings.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "}</tool_call>{\\""}}</tool_call>',
     "", [("get_weather", {"city": '}</tool_call>{"'})]),
    # Llama-3.1-8B-Instruct: a bare call.
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    # Llama-3.2: two calls separated by "; ".
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"tz": "UTC"}}',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    # After <|python_tag|> (when special tokens are kept), arguments as a JSON string.
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}', "",
     [("get_time", {"tz": "UTC"})]),
    # Text before a call on its own line.
    ("llama3_json", 'I will check the weather.\n{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "I will check the weather.", [("get_weather", {"city": "Oslo"})]),
    # A JSON answer that is not a call: text.
    ("llama3_json", '{"city": "Paris", "temp": 21}', '{"city": "Paris", "temp": 21}', []),
    # Malformed JSON: text.
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}', '{"name": "get_weather", "parameters": {"city": "Paris"}', []),
    # Braces in the middle of a sentence are not calls.
    ("llama3_json", 'The set {"name": 1} is small.', 'The set {"name": 1} is small.', []),
    # Plain text.
    ("llama3_json", "It is sunny in Paris; 21 degrees.", "It is sunny in Paris; 21 degrees.", []),
]


def run(name: str, chunks: list[str], stream_arguments: bool = False) -> tuple[str, list[tuple[str, dict]], list]:
    parser = ToolCallParser(tool_syntax(name), TOOLS, forced=stream_arguments, streaming=stream_arguments)
    events = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.finish())
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [(e.name, e.arguments) for e in events if isinstance(e, ParsedCall)]
    assert [e.index for e in events if isinstance(e, ParsedCall)] == list(range(len(calls)))
    return text, calls, events


@pytest.mark.parametrize("name, output, text, calls", RECORDED)
def test_whole_output(name, output, text, calls):
    assert run(name, [output])[:2] == (text, calls)


@pytest.mark.parametrize("name, output, text, calls", RECORDED)
def test_split_at_every_boundary(name, output, text, calls):
    for cut in range(1, len(output)):
        assert run(name, [output[:cut], output[cut:]])[:2] == (text, calls), cut
    got_text, got_calls, events = run(name, list(output))  # one character per chunk
    assert (got_text, got_calls) == (text, calls)
    # A call never leaks as text, even partly: every text delta is a piece of the expected text.
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert streamed == text


@pytest.mark.parametrize("name, output, text, calls", [case for case in RECORDED if case[3]])
def test_streamed_arguments_at_every_boundary(name, output, text, calls):
    """Forced calls: the head as soon as the name is read, then argument text that adds up to the JSON."""
    for chunks in [[output[:cut], output[cut:]] for cut in range(1, len(output))] + [list(output)]:
        got_text, got_calls, events = run(name, chunks, stream_arguments=True)
        assert (got_text, got_calls) == (text, calls)
        heads = {e.index: e.name for e in events if isinstance(e, CallHead)}
        for index, (call_name, arguments) in enumerate(calls):
            if index not in heads:  # written arguments-first: reported whole
                continue
            assert heads[index] == call_name
            streamed = "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == index)
            assert json.loads(streamed) == arguments
            order = [type(e).__name__ for e in events if getattr(e, "index", None) == index]
            assert order[0] == "CallHead" and order[-1] == "ParsedCall" and set(order[1:-1]) == {"ArgumentsDelta"}


def test_streamed_call_cut_short_ends_with_its_cut_call():
    parser = ToolCallParser(tool_syntax("llama3_json"), TOOLS, forced=True, streaming=True)
    events = parser.feed('{"name": "get_time", "parameters": {"tz": "Eur') + parser.finish(cut=True)
    assert events == [CallHead(0, "get_time"), ArgumentsDelta(0, '{"tz": "Eur'),
                      CutCall(0, "get_time", '{"tz": "Eur')] and parser.num_calls == 1


def test_text_before_a_call_streams_before_the_call_completes():
    parser = ToolCallParser(tool_syntax("hermes"), TOOLS)
    assert parser.feed("Checking") == [TextDelta("Checking")]
    assert parser.feed(" now.\n<tool_") == [TextDelta(" now.")]  # the newline and the opener prefix held
    assert parser.feed('call>\n{"name": "get_time", "arguments": {}}') == []
    assert parser.feed("\n</tool_call>") == [ParsedCall(0, "get_time", {})]
    assert parser.finish() == []


def test_llama3_rejects_a_non_call_object_early():
    parser = ToolCallParser(tool_syntax("llama3_json"), TOOLS)
    assert parser.feed('{"ci') == [TextDelta('{"ci')]


def test_formats_detected_from_chat_templates():
    assert detect_tool_syntax(CHAT_TEMPLATE).name == "llama3_json"  # the tiny test model
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert detect_tool_syntax(chatml).name == "hermes"  # SmolLM2
    qwen = chatml + "{% if tools %}<tool_call>\n{\"name\": <function-name>}</tool_call>{% endif %}"
    assert detect_tool_syntax(qwen).name == "hermes"
    assert detect_tool_syntax("{{ messages[0].content }}") is None
    assert detect_tool_syntax(None) is None


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; known: hermes, llama3_json"):
        tool_syntax("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("stream_arguments", [False, True])
def test_a_long_call_streamed_in_small_chunks_costs_its_length_once(name, stream_arguments):
    # A file-writing call of 20k characters, 4 per chunk: rescanning the call per chunk took seconds.
    arguments = {"city": "x = 1\n" * 3500}
    key = "arguments" if name == "hermes" else "parameters"
    output = json.dumps({"name": "get_weather", key: arguments})
    if name == "hermes":
        output = f"<tool_call>\n{output}\n</tool_call>"
    start = time.perf_counter()
    _, calls, _ = run(name, [output[i:i + 4] for i in range(0, len(output), 4)], stream_arguments)
    assert calls == [("get_weather", arguments)]
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("name, output, text, calls", RECORDED)
def test_token_by_token_through_the_detokenizer(tokenizer, name, output, text, calls):
    """As a generation streams them: the tiny model's byte-level tokens, one per piece (multi-byte
    characters split across tokens, special tokens such as <|python_tag|> dropped by the detokenizer)."""
    from api.detokenizer import IncrementalDetokenizer

    token_ids = tokenizer.encode(output, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    pieces = [detokenizer.add([token_id]) for token_id in token_ids] + [detokenizer.flush()]
    assert run(name, pieces)[:2] == (text, calls)
