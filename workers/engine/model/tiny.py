"""A deterministic random-weight Llama (or Qwen2) checkpoint for tests and local runs.

``make_tiny_model(path)`` writes a complete Hugging Face model directory:
config.json, generation_config.json, model.safetensors (or shards and
model.safetensors.index.json), tokenizer.json and tokenizer_config.json with a
Llama-3 chat template. Nothing is downloaded; the same arguments give
byte-identical files. Torch-free (numpy + safetensors.numpy).

Weight scale: projections are N(0, 1/fan_in) so attention patterns and MLP
outputs are far from uniform (a bug in the KV cache changes the logits by
much more than float noise), and ``lm_head`` gives logits of standard
deviation ~2 so greedy argmax is not decided by rounding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from workers.engine.model.tiny_tokenizer import write_tokenizer

__all__ = ["TinySize", "TINY_SIZES", "make_tiny_model"]


@dataclass(frozen=True)
class TinySize:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


TINY_SIZES: dict[str, TinySize] = {
    "test": TinySize(512, 64, 2, 4, 2, 128),
    "bench": TinySize(2048, 256, 4, 8, 4, 688),
    # Heads, KV heads and MLP split over 2 and 3 tensor-parallel ranks (the vocabulary over 3 does not).
    "tp": TinySize(512, 192, 2, 12, 6, 384),
}

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_MAX_POSITION_EMBEDDINGS = 2048


def make_tiny_model(
    path: str | Path,
    size: str = "test",
    seed: int = 0,
    *,
    arch: str = "llama",
    tie_word_embeddings: bool = False,
    num_shards: int = 1,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = _MAX_POSITION_EMBEDDINGS,
) -> Path:
    """Write the tiny checkpoint into ``path`` (created if needed) and return it.

    ``arch``: "llama" or "qwen2" (Qwen2 adds q/k/v biases). ``num_shards`` > 1
    writes ``model-0000i-of-0000n.safetensors`` and an index instead of one
    ``model.safetensors``. ``rope_scaling`` goes into config.json as is
    (e.g. a Llama-3.1 ``{"rope_type": "llama3", ...}`` dict).
    """
    if size not in TINY_SIZES:
        raise ValueError(f"size must be one of {sorted(TINY_SIZES)}, got {size!r}")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(_ARCHITECTURES)}, got {arch!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    dims = TINY_SIZES[size]
    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)
    token_ids = write_tokenizer(model_dir, dims.vocab_size, max_position_embeddings)
    config = _hf_config(dims, arch, tie_word_embeddings, rope_scaling, max_position_embeddings, token_ids)
    _write_json(model_dir / "config.json", config)
    _write_json(
        model_dir / "generation_config.json",
        {"bos_token_id": token_ids["bos"], "eos_token_id": [token_ids["eos"], token_ids["eot"]]},
    )
    tensors = _random_weights(dims, arch, tie_word_embeddings, seed)
    _write_weights(model_dir, tensors, num_shards)
    return model_dir


def _hf_config(
    dims: TinySize,
    arch: str,
    tie_word_embeddings: bool,
    rope_scaling: dict | None,
    max_position_embeddings: int,
    token_ids: dict[str, int],
) -> dict:
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.hidden_size // dims.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": token_ids["bos"],
        "eos_token_id": [token_ids["eos"], token_ids["eot"]],
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=dims.num_layers)
    return config


def _random_weights(dims: TinySize, arch: str, tied: bool, seed: int) -> dict[str, np.ndarray]:
    """HF tensor names to float32 arrays, drawn in a fixed order from one generator."""
    rng = np.random.default_rng(seed)
    head_dim = dims.hidden_size // dims.num_heads
    q_size, kv_size = dims.num_heads * head_dim, dims.num_kv_heads * head_dim

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)

    def norm() -> np.ndarray:
        # Not exactly 1, so a model that ignores the norm weight fails the reference test.
        return (1.0 + 0.1 * rng.standard_normal(dims.hidden_size)).astype(np.float32)

    def bias(features: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(features)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": rng.standard_normal((dims.vocab_size, dims.hidden_size)).astype(np.float32)}
    for layer in range(dims.num_layers):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = norm()
        tensors[prefix + "self_attn.q_proj.weight"] = linear(q_size, dims.hidden_size)
        tensors[prefix + "self_attn.k_proj.weight"] = linear(kv_size, dims.hidden_size)
        tensors[prefix + "self_attn.v_proj.weight"] = linear(kv_size, dims.hidden_size)
        if arch == "qwen2":
            tensors[prefix + "self_attn.q_proj.bias"] = bias(q_size)
            tensors[prefix + "self_attn.k_proj.bias"] = bias(kv_size)
            tensors[prefix + "self_attn.v_proj.bias"] = bias(kv_size)
        tensors[prefix + "self_attn.o_proj.weight"] = linear(dims.hidden_size, q_size)
        tensors[prefix + "post_attention_layernorm.weight"] = norm()
        tensors[prefix + "mlp.gate_proj.weight"] = linear(dims.intermediate_size, dims.hidden_size)
        tensors[prefix + "mlp.up_proj.weight"] = linear(dims.intermediate_size, dims.hidden_size)
        tensors[prefix + "mlp.down_proj.weight"] = linear(dims.hidden_size, dims.intermediate_size)
    tensors["model.norm.weight"] = norm()
    if not tied:
        tensors["lm_head.weight"] = np.float32(2.0) * linear(dims.vocab_size, dims.hidden_size)
    return tensors


def _write_weights(model_dir: Path, tensors: dict[str, np.ndarray], num_shards: int) -> None:
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if num_shards == 1:
        save_file(tensors, str(model_dir / "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    shard_size = -(-len(names) // num_shards)  # ceil: every shard non-empty when names >= shards
    weight_map: dict[str, str] = {}
    for index in range(num_shards):
        shard_names = names[index * shard_size : (index + 1) * shard_size]
        file_name = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({name: tensors[name] for name in shard_names}, str(model_dir / file_name), metadata=metadata)
        weight_map.update({name: file_name for name in shard_names})
    total_size = sum(array.nbytes for array in tensors.values())
    _write_json(
        model_dir / "model.safetensors.index.json",
        {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
    )


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
