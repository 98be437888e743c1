"""Tool calling with a chat template that knows nothing of tools (SmolLM2's ChatML template):
the tools, the calls and the results reach the prompt in the model's call format, and an agent
loop's second turn renders instead of failing on the assistant's null content."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from http_harness import make_harness

from api.tokenizer import Tokenizer
from api.tool_parsers import detect_tool_syntax
from api.tool_prompt import adapt_conversation

# SmolLM2-135M-Instruct's template, verbatim from its GGUF (tokenizer.chat_template).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12 C"},
]


@pytest.fixture(scope="module")
def chatml(tiny_model_dir) -> Tokenizer:
    tiny = Tokenizer.from_model_dir(tiny_model_dir)
    return Tokenizer(tiny.backend, {"chat_template": SMOLLM2_TEMPLATE, "eos_token": "<|eot_id|>"})


def test_the_conversation_is_rewritten_in_hermes_format(chatml):
    syntax = detect_tool_syntax(chatml.chat_template_source)
    assert syntax is not None and syntax.name == "hermes"
    messages = [HISTORY[0], {**HISTORY[1], "tool_calls": [
        {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
        for call in HISTORY[1]["tool_calls"]]}, *HISTORY[2:]]
    prompt = chatml.render_chat(adapt_conversation(messages, TOOLS, chatml.chat_template_source, syntax), tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\n# Tools\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>') in prompt
    # One user turn holds the round of results; no "tool" role the model never saw.
    assert ("<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n12 C\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in prompt
    assert "<|im_start|>tool" not in prompt


def test_a_template_that_writes_tools_is_left_alone(tiny_model_dir):
    tiny = Tokenizer.from_model_dir(tiny_model_dir)
    syntax = detect_tool_syntax(tiny.chat_template_source)
    assert adapt_conversation(HISTORY, TOOLS, tiny.chat_template_source, syntax) is HISTORY


@pytest_asyncio.fixture
async def chatml_harness(tiny_model_dir, chatml):
    _, harness = await make_harness(tiny_model_dir, chatml)
    yield harness
    await harness.http.aclose()
    await harness.client.close()


@pytest.mark.asyncio
async def test_agent_loop_second_turn_on_a_tool_unaware_template(chatml_harness):
    # Counted, not generated: the harness's model is 256 tokens long, the tiny tokenizer spells ChatML out.
    h = chatml_harness
    response = await h.http.post("/tokenize", json={"model": h.model, "messages": HISTORY, "tools": TOOLS})
    assert response.status_code == 200, response.text
    text = h.tokenizer.decode(response.json()["tokens"], skip_special_tokens=False)
    assert "<tool_call>" in text and "<tool_response>" in text and "<tools>" in text
    response = await h.http.post("/v1/messages/count_tokens", json={"model": h.model, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21 C"}]}]})
    assert response.status_code == 200, response.text
    expected = h.tokenizer.encode_chat([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                         '</tool_call>'},
        {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}])
    assert response.json()["input_tokens"] == len(expected)


@pytest.mark.asyncio
async def test_a_template_that_fails_on_the_conversation_is_a_400(tiny_model_dir):
    broken = Tokenizer.from_model_dir(tiny_model_dir)
    broken = Tokenizer(broken.backend, {"chat_template": "{{ messages[0]['content'] + 1 }}"})
    _, h = await make_harness(tiny_model_dir, broken)
    try:
        response = await h.http.post("/v1/chat/completions", json={
            "model": h.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert response.status_code == 400 and "chat template failed" in response.json()["error"]["message"]
    finally:
        await h.http.aclose()
        await h.client.close()
