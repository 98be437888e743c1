"""config.json parsing: the supported shapes and errors that name the field."""

from __future__ import annotations

import pytest
import torch

from workers.config import ConfigError
from workers.engine.model.loader import resolve_device
from workers.engine.model.model_config import RopeScaling, parse_model_config

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "eos_token_id": 7,
}


def test_llama_defaults_and_eos_from_both_files() -> None:
    config = parse_model_config(LLAMA, {"eos_token_id": [7, 9]})
    assert (config.head_dim, config.rope_theta, config.rope_scaling) == (16, 10000.0, None)
    assert (config.qkv_bias, config.o_bias, config.tie_word_embeddings) == (False, False, False)
    assert config.eos_token_ids == frozenset({7, 9})
    assert config.max_position_embeddings == 2048


def test_transformers5_rope_parameters_and_mistral_head_dim() -> None:
    raw = dict(
        LLAMA,
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        head_dim=32,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 1024,
        },
    )
    config = parse_model_config(raw)
    assert config.head_dim == 32 and config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)


def test_bias_flags() -> None:
    assert parse_model_config(dict(LLAMA, model_type="qwen2", architectures=["Qwen2ForCausalLM"])).qkv_bias
    llama_bias = parse_model_config(dict(LLAMA, attention_bias=True))
    assert (llama_bias.qkv_bias, llama_bias.o_bias) == (True, True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "config.json:architectures: unsupported architecture 'GPT2LMHeadModel'"),
        ({"num_key_value_heads": 3}, "config.json:num_key_value_heads: 3 does not divide num_attention_heads 4"),
        ({"hidden_act": "gelu"}, "config.json:hidden_act: unsupported activation 'gelu'"),
        ({"hidden_size": "64"}, "config.json:hidden_size: must be int, got '64'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "config.json:rope_scaling: rope_type 'linear' needs 'factor'"),
    ],
)
def test_errors_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_model_config(dict(LLAMA, **change))


def test_missing_field_is_named() -> None:
    raw = {k: v for k, v in LLAMA.items() if k != "vocab_size"}
    with pytest.raises(ConfigError, match="config.json:vocab_size: missing"):
        parse_model_config(raw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_device_resolution_without_cuda() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="engine.device: 'cuda:1' requested but torch sees no CUDA device"):
        resolve_device("cuda:1")
