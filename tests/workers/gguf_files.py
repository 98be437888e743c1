"""Write a GGUF file from a Hugging Face Llama checkpoint, as llama.cpp's converter lays it out.

Only what the engine's loader reads: the ``llama.*`` shape metadata, the
EOS id and the tensors under llama.cpp's names, with the q/k rows permuted
the way ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.numpy import load_file


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # Verbatim from llama.cpp's convert_hf_to_gguf.py, LlamaModel.permute.
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def write_gguf(model_dir: Path, path: Path, architecture: str = "llama",
               types: dict[str, str] | None = None) -> Path:
    """``types``: tensor name -> GGML type to store it as (default F32)."""
    config = json.loads((model_dir / "config.json").read_text())
    hf = load_file(model_dir / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(path, architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"] if isinstance(config["eos_token_id"], int)
                            else config["eos_token_id"][0])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for layer in range(config["num_hidden_layers"]):
        for hf_name, ours in per_layer.items():
            names[f"model.layers.{layer}.{hf_name}.weight"] = f"blk.{layer}.{ours}.weight"
    for hf_name, name in names.items():
        if hf_name not in hf:
            continue  # lm_head of a tied checkpoint
        values = hf[hf_name].astype(np.float32)
        if name.endswith("attn_q.weight"):
            values = llama_cpp_permute(values, heads)
        elif name.endswith("attn_k.weight"):
            values = llama_cpp_permute(values, kv_heads)
        qtype = GGMLQuantizationType[(types or {}).get(name, "F32")]
        data = quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape if qtype in (
            GGMLQuantizationType.F32, GGMLQuantizationType.F16) else None, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
