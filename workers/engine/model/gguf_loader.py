"""Load a llama.cpp GGUF file into ``LlamaForCausalLM``.

Every tensor is dequantized to float32 (``gguf_dequant``) and cast to the
engine's dtype at load: the engine computes in float32/bfloat16/float16, the
file's quantization only saves disk. Two differences from a Hugging Face
checkpoint are undone here:

- names: llama.cpp's ``blk.N.attn_q.weight`` ... (table below);
- rows of the q and k projections: llama.cpp's converter permutes them so
  that each head's rotary pairs are interleaved (GGML's "normal" RoPE);
  the engine rotates halves (Hugging Face's "neox" layout), so the rows are
  permuted back (``unpermute_rotary_rows``).

With ``quantized`` (``engine.weights: quantized``, float32 on the CPU, one
rank), the linear layers whose GGUF tensors are Q4_0/Q4_1/Q4_K/Q8_0 keep
their blocks instead (``gguf_blocks``, ``quant_linear``); the rest (norms,
the embedding table, Q6_K or float tensors) are dequantized as above.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workers.engine.model.gguf_blocks import QuantBlocks, concatenate_blocks, read_blocks
from workers.engine.model.gguf_dequant import dequantize_tensor
from workers.engine.model.gguf_metadata import gguf_model_config, open_gguf
from workers.engine.model.llama import LlamaForCausalLM
from workers.engine.model.missing_weights import MissingWeightsError
from workers.engine.model.model_config import ModelConfig
from workers.engine.model.parallel import TensorParallel, check_shardable
from workers.engine.model.quant_linear import QuantKernel, QuantLinear
from workers.engine.model.shard_plan import apply_cut, finish_cut, shard_cuts

__all__ = ["load_gguf_model", "gguf_weight_sources", "unpermute_rotary_rows", "permute_rotary_rows"]


def gguf_weight_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the GGUF tensors concatenated (dim 0) into it."""
    sources = {"embed_tokens.weight": ["token_embd.weight"], "norm.weight": ["output_norm.weight"]}
    sources["lm_head.weight"] = ["token_embd.weight" if config.tie_word_embeddings else "output.weight"]
    for layer in range(config.num_layers):
        ours, blk = f"layers.{layer}.", f"blk.{layer}."
        sources[f"{ours}input_layernorm.weight"] = [f"{blk}attn_norm.weight"]
        sources[f"{ours}post_attention_layernorm.weight"] = [f"{blk}ffn_norm.weight"]
        sources[f"{ours}self_attn.qkv_proj.weight"] = [f"{blk}attn_{p}.weight" for p in "qkv"]
        if config.qkv_bias:
            sources[f"{ours}self_attn.qkv_proj.bias"] = [f"{blk}attn_{p}.bias" for p in "qkv"]
        sources[f"{ours}self_attn.o_proj.weight"] = [f"{blk}attn_output.weight"]
        if config.o_bias:
            sources[f"{ours}self_attn.o_proj.bias"] = [f"{blk}attn_output.bias"]
        sources[f"{ours}mlp.gate_up_proj.weight"] = [f"{blk}ffn_gate.weight", f"{blk}ffn_up.weight"]
        sources[f"{ours}mlp.down_proj.weight"] = [f"{blk}ffn_down.weight"]
    return sources


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows [x0..x_{d/2}, y0..y_{d/2}] -> [x0, y0, x1, y1, ...]."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of ``permute_rotary_rows``: interleaved pairs back to rotated halves."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def load_gguf_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    tp: TensorParallel | None = None,
    quantized: QuantKernel | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model in eval mode on ``device``; RoPE covers ``max_positions`` (default: the model's).
    With ``tp``, each tensor is dequantized, then cut to this rank's shard. With ``quantized``
    (float32 CPU, no ``tp``: the caller checks), linear layers keep their quantized blocks."""
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    if tp is not None:
        check_shardable(config.num_heads, config.num_kv_heads, config.intermediate_size, tp.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions or config.max_position_embeddings, device, tp)
    sources = gguf_weight_sources(config)
    cuts = shard_cuts(config, tp, sources) if tp is not None else {}
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    missing = sorted({name for names in sources.values() for name in names if name not in tensors})
    if missing:
        raise MissingWeightsError(Path(path), missing)
    # Rows permuted by the converter: q over all heads, k over the KV heads.
    heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads,
             "attn_q.bias": config.num_heads, "attn_k.bias": config.num_kv_heads}
    cache: dict[str, np.ndarray] = {}

    def read(name: str) -> np.ndarray:
        if name not in cache:  # token_embd may be read twice (tied lm_head)
            values = dequantize_tensor(tensors[name])
            suffix = name.split(".", 2)[-1]
            if name.startswith("blk.") and suffix in heads:
                values = unpermute_rotary_rows(values, heads[suffix])
            cache[name] = values
        return cache[name]

    kept = _kept_blocks(sources, tensors, heads) if quantized is not None else {}
    state = {}
    for ours, names in sources.items():
        if ours in kept:
            continue
        # One tensor at a time in the target dtype: peak memory is the model plus one float32 tensor.
        parts = [
            finish_cut(torch.from_numpy(np.ascontiguousarray(apply_cut(read(name), cuts.get(name)))).to(device=device, dtype=dtype),
                       cuts.get(name))
            for name in names
        ]
        state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts)
        for name in names:
            if name != "token_embd.weight":
                cache.pop(name, None)
    model.load_state_dict(state, assign=True, strict=not kept)
    if config.tie_word_embeddings and "lm_head.weight" not in kept:
        model.lm_head.weight = model.embed_tokens.weight
    if quantized is not None:
        _install_quant_linears(model, kept, state, quantized)
    return model.eval(), config


def _kept_blocks(sources: dict[str, list[str]], tensors: dict, heads: dict[str, int]) -> dict[str, QuantBlocks]:
    """Our linear weight name -> its blocks, for the weights whose every GGUF part has a kept type
    of the same bits (``gguf_blocks``); q and k rows unpermuted as the float path does."""
    kept = {}
    for ours, names in sources.items():
        if not ours.endswith(("_proj.weight", "lm_head.weight")):
            continue
        parts: list[QuantBlocks] = []
        for name in names:
            blocks = read_blocks(tensors[name])
            suffix = name.split(".", 2)[-1]
            if blocks is not None and name.startswith("blk.") and suffix in heads:
                order = unpermute_rotary_rows(np.arange(blocks.shape[0]), heads[suffix])
                blocks = blocks.take_rows(order)
            if blocks is None:  # a part stays float, so the whole weight does
                break
            parts.append(blocks)
        joined = concatenate_blocks(parts) if len(parts) == len(names) else None
        if joined is not None:
            kept[ours] = joined
    return kept


def _install_quant_linears(model: LlamaForCausalLM, kept: dict[str, QuantBlocks], state: dict,
                           kernel: QuantKernel) -> None:
    for name, blocks in kept.items():
        path = name.removesuffix(".weight")
        parent_name, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attribute, QuantLinear(blocks, state.get(f"{path}.bias"), kernel))
