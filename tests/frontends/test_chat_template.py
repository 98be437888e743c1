"""Tokenizer loading and chat-template rendering (sandboxed jinja2, tools, errors)."""

from __future__ import annotations

import json

import pytest

from api.tokenizer import ChatTemplateError, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def test_config_is_read(tokenizer, tiny_model_dir):
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|eot_id|>"
    assert tokenizer.eos_token_id == tokenizer.backend.token_to_id("<|eot_id|>")
    assert tokenizer.model_max_length == config["model_max_length"]
    assert tokenizer.vocab_size == 512
    assert tokenizer.has_chat_template


@pytest.mark.parametrize("text", ["", "Hello world", "naïve café 🐉 — 日本語", "<|eot_id|>inline<|begin_of_text|>",
                                  "  spaces\n\ttabs  " * 50])
@pytest.mark.parametrize("special", [True, False])
def test_the_fast_encode_path_gives_the_backends_ids(tokenizer, text, special):
    assert tokenizer.encode(text, add_special_tokens=special) == tokenizer.backend.encode(
        text, add_special_tokens=special).ids


def test_encode_adds_bos_and_count_tokens(tokenizer):
    ids = tokenizer.encode("Hello world")
    assert ids[0] == tokenizer.backend.token_to_id("<|begin_of_text|>")
    assert tokenizer.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tokenizer.count_tokens("Hello world") == len(ids)


def test_chat_rendering_matches_llama3_layout(tokenizer):
    text = tokenizer.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_prompt = tokenizer.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_prompt.endswith("Hi<|eot_id|>")


def test_tools_reach_the_template(tokenizer):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    text = tokenizer.render_chat([{"role": "user", "content": "Weather?"}], tools=[tool])
    assert "You can call these tools." in text
    assert json.dumps(tool) in text
    assert "get_weather" not in tokenizer.render_chat([{"role": "user", "content": "Weather?"}])


def test_chat_token_ids_have_one_bos(tokenizer):
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    bos = tokenizer.backend.token_to_id("<|begin_of_text|>")
    assert ids.count(bos) == 1 and ids[0] == bos
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|begin_of_text|><|start_header_id|>user")


def test_raise_exception_in_template_is_a_chat_template_error(tokenizer):
    strict = Tokenizer(tokenizer.backend, {
        "chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
    })
    assert strict.render_chat([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.render_chat([{"role": "assistant", "content": "x"}])


def test_template_is_sandboxed(tokenizer):
    hostile = Tokenizer(tokenizer.backend, {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(ChatTemplateError):
        hostile.render_chat([{"role": "user", "content": "x"}])


def test_named_templates_pick_tool_use(tokenizer):
    named = Tokenizer(tokenizer.backend, {"chat_template": [
        {"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"},
    ]})
    assert named.render_chat([{"role": "user", "content": "x"}]) == "plain"
    assert named.render_chat([{"role": "user", "content": "x"}], tools=[{"type": "function"}]) == "tools"


def test_no_template_is_an_error(tokenizer):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tokenizer.backend, {}).render_chat([{"role": "user", "content": "x"}])
