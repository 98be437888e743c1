"""The generated tiny checkpoint: deterministic, and a valid Hugging Face model directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it; nothing may be downloaded

from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.engine.model.tiny import TINY_SIZES, make_tiny_model


def _file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), size="test")


def test_same_arguments_write_identical_bytes(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", size="test")
    assert _file_bytes(again) == _file_bytes(tiny_dir)
    assert sorted(_file_bytes(again)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_other_seed_changes_weights_only(tiny_dir: Path, tmp_path: Path) -> None:
    other = _file_bytes(make_tiny_model(tmp_path / "other", size="test", seed=1))
    mine = _file_bytes(tiny_dir)
    assert other["model.safetensors"] != mine["model.safetensors"]
    assert other["tokenizer.json"] == mine["tokenizer.json"]
    assert other["config.json"] == mine["config.json"]


def test_config_has_the_test_size(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    size = TINY_SIZES["test"]
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (size.num_layers, size.hidden_size)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["vocab_size"] == 512
    assert config["eos_token_id"] == [1, 4]
    assert config["bos_token_id"] == 0


def test_transformers_loads_tokenizer_offline(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tokenizer) == 512
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.bos_token_id == 0
    assert tokenizer.eos_token == "<|eot_id|>" and tokenizer.eos_token_id == 4
    text = "Hello world! Café 中文 😀 def f(x): return x"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 0
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Merges exist: far fewer tokens than UTF-8 bytes.
    assert len(ids) < len(text.encode("utf-8")) * 0.8
    # A multi-byte character split over tokens decodes whole only with all its tokens.
    emoji_ids = tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(emoji_ids) == "😀"


def test_transformers_loads_model_offline(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 2


def test_chat_template_renders_llama3_turns(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"


def test_chat_template_renders_tools_and_tool_turns(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "21 C"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        'You can call these tools. To call one, answer with JSON {"name": ..., "parameters": ...}.\n'
        '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}\n\n'
        "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n21 C<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_qwen2_and_sharded_variants(tmp_path: Path) -> None:
    qwen = make_tiny_model(tmp_path / "qwen", arch="qwen2")
    config = json.loads((qwen / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen2", ["Qwen2ForCausalLM"])
    sharded = make_tiny_model(tmp_path / "sharded", num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    assert "lm_head.weight" in index["weight_map"]
    tied = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True, num_shards=2)
    assert "lm_head.weight" not in json.loads((tied / "model.safetensors.index.json").read_text())["weight_map"]


def test_bench_size_shape(tmp_path: Path) -> None:
    bench = make_tiny_model(tmp_path / "bench", size="bench")
    config = json.loads((bench / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (4, 256, 2048)
    assert json.loads((bench / "tokenizer.json").read_text())["model"]["vocab"].__len__() == 2048


def test_bad_arguments_name_the_parameter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        make_tiny_model(tmp_path, size="huge")
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path, arch="gpt2")
