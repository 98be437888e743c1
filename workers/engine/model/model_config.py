"""The model's shape, parsed from a Hugging Face ``config.json`` into a frozen typed object.

Supported: the Llama family of decoders (``llama``, ``mistral``, ``qwen2``).
Errors are ``ConfigError`` naming the config.json field and its value, or
``FileNotFoundError`` naming the missing file. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from workers.config import ConfigError

__all__ = ["ModelConfig", "RopeScaling", "load_model_config", "read_json_file"]

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_T = TypeVar("_T")


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` of config.json (HF 5 calls it ``rope_parameters``)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2 always; Llama with ``attention_bias``)."""
    o_bias: bool
    """o_proj carries a bias (Llama with ``attention_bias``)."""
    eos_token_ids: frozenset[int]
    """From config.json and generation_config.json together."""


def read_json_file(model_dir: Path, name: str) -> dict:
    path = model_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found in model directory {model_dir}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json`` if present) of ``model_dir``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    raw = read_json_file(model_dir, "config.json")
    generation = {}
    if (model_dir / "generation_config.json").is_file():
        generation = read_json_file(model_dir, "generation_config.json")
    return parse_model_config(raw, generation)


def parse_model_config(raw: dict, generation: dict | None = None) -> ModelConfig:
    model_type = _require(raw, "model_type", str)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = sorted(SUPPORTED_MODEL_TYPES)
        raise ConfigError("config.json:model_type", f"unsupported model_type {model_type!r}; supported: {supported}")
    for architecture in raw.get("architectures") or []:
        if architecture not in SUPPORTED_MODEL_TYPES.values():
            raise ConfigError("config.json:architectures", f"unsupported architecture {architecture!r}")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError("config.json:hidden_act", f"unsupported activation {hidden_act!r}; only 'silu'")
    if raw.get("mlp_bias"):
        raise ConfigError("config.json:mlp_bias", "MLP biases are not supported")
    hidden_size = _require(raw, "hidden_size", int)
    num_heads = _require(raw, "num_attention_heads", int)
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    if num_heads % num_kv_heads != 0:
        raise ConfigError(
            "config.json:num_key_value_heads", f"{num_kv_heads} does not divide num_attention_heads {num_heads}"
        )
    attention_bias = bool(raw.get("attention_bias", False))
    rope_theta, rope_scaling = _parse_rope(raw)
    return ModelConfig(
        model_type=model_type,
        vocab_size=_require(raw, "vocab_size", int),
        hidden_size=hidden_size,
        intermediate_size=_require(raw, "intermediate_size", int),
        num_layers=_require(raw, "num_hidden_layers", int),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        eos_token_ids=_token_ids(raw.get("eos_token_id")) | _token_ids((generation or {}).get("eos_token_id")),
    )


def _parse_rope(raw: dict) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes rope_parameters (theta inside); older files use
    # rope_theta + rope_scaling. Both are read.
    parameters = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or parameters
    key = "config.json:rope_scaling" if raw.get("rope_scaling") else "config.json:rope_parameters"
    rope_theta = float(raw.get("rope_theta") or parameters.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(key, f"unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return rope_theta, None
    if "factor" not in scaling:
        raise ConfigError(key, f"rope_type {rope_type!r} needs 'factor'")
    return rope_theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _require(raw: dict, name: str, kind: type[_T]) -> _T:
    if name not in raw:
        raise ConfigError(f"config.json:{name}", "missing")
    value = raw[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"config.json:{name}", f"must be {kind.__name__}, got {value!r}")
    return value


def _token_ids(value: int | list[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(int(v) for v in value)
