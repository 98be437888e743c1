"""Load a Llama-family checkpoint into ``LlamaForCausalLM``: a Hugging Face directory
(safetensors) or a llama.cpp ``.gguf`` file (``gguf_loader``).

From a directory it reads ``model.safetensors`` or the shards named by
``model.safetensors.index.json``. The model is built on the meta device and
its parameters are replaced by the loaded tensors (already in the target
dtype and on the target device), so nothing is initialised twice.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from workers.config import ConfigError
from workers.engine.model.gguf_loader import load_gguf_model
from workers.engine.model.gguf_metadata import is_gguf_file
from workers.engine.model.llama import LlamaForCausalLM
from workers.engine.model.missing_weights import MissingWeightsError
from workers.engine.model.model_config import ModelConfig, load_model_config, read_json_file
from workers.engine.model.parallel import TensorParallel, check_shardable
from workers.engine.model.quant_linear import QuantKernel, load_quant_kernel
from workers.engine.model.shard_plan import Cut, apply_cut, finish_cut, shard_cuts

__all__ = ["DTYPES", "MissingWeightsError", "resolve_device", "load_model", "hf_weight_sources"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto`` is cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("engine.device", f"{device!r} requested but torch sees no CUDA device")
    return torch.device(device)


def hf_weight_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face tensors concatenated (dim 0) into it."""
    sources = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    # Tied: lm_head shares embed_tokens' tensor; a checkpoint may still carry lm_head.weight.
    sources["lm_head.weight"] = ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    for layer in range(config.num_layers):
        ours, hf = f"layers.{layer}.", f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sources[f"{ours}{norm}.weight"] = [f"{hf}{norm}.weight"]
        attn = f"{hf}self_attn."
        sources[f"{ours}self_attn.qkv_proj.weight"] = [f"{attn}{p}_proj.weight" for p in "qkv"]
        if config.qkv_bias:
            sources[f"{ours}self_attn.qkv_proj.bias"] = [f"{attn}{p}_proj.bias" for p in "qkv"]
        sources[f"{ours}self_attn.o_proj.weight"] = [f"{attn}o_proj.weight"]
        if config.o_bias:
            sources[f"{ours}self_attn.o_proj.bias"] = [f"{attn}o_proj.bias"]
        sources[f"{ours}mlp.gate_up_proj.weight"] = [f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"]
        sources[f"{ours}mlp.down_proj.weight"] = [f"{hf}mlp.down_proj.weight"]
    return sources


def load_model(
    model_dir: str | Path,
    dtype: str,
    device: torch.device,
    max_positions: int | None = None,
    tp: TensorParallel | None = None,
    weights: str = "dequantize",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model in eval mode on ``device``; RoPE covers ``max_positions`` (default: the model's).
    ``model_dir`` is a Hugging Face model directory or a ``.gguf`` file. With ``tp``, only
    this rank's shard is read and built (``shard_plan``). ``weights`` is ``engine.weights``."""
    model_dir = Path(model_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if is_gguf_file(model_dir):
        kernel = _quant_kernel(weights, dtype, device, tp)
        return load_gguf_model(model_dir, DTYPES[dtype], device, max_positions, tp, kernel)
    config = load_model_config(model_dir)
    if tp is not None:
        check_shardable(config.num_heads, config.num_kv_heads, config.intermediate_size, tp.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions or config.max_position_embeddings, device, tp)
    sources = hf_weight_sources(config)
    files = _tensor_files(model_dir)
    missing = sorted({name for names in sources.values() for name in names if name not in files})
    if missing:
        raise MissingWeightsError(model_dir, missing)
    cuts = shard_cuts(config, tp, sources) if tp is not None else {}
    hf_tensors = _read_tensors(model_dir, files, {name for names in sources.values() for name in names}, cuts)
    state = {
        ours: torch.cat([hf_tensors[name] for name in names]).to(device=device, dtype=DTYPES[dtype])
        for ours, names in sources.items()
    }
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval(), config


def _quant_kernel(weights: str, dtype: str, device: torch.device, tp: TensorParallel | None) -> QuantKernel | None:
    """The kernel that keeps a GGUF's quantized blocks, when ``engine.weights`` asks for it."""
    if weights != "quantized":
        return None
    if device.type != "cpu" or dtype != "float32" or tp is not None:
        raise ConfigError("engine.weights", f"'quantized' runs float32 on the CPU on one rank, "
                                            f"got {dtype} on {device.type} with {tp.size if tp else 1} rank(s)")
    kernel = load_quant_kernel()
    if kernel is None:
        raise ConfigError("engine.weights", "'quantized' requested but its kernel cannot be built (logged above)")
    return kernel


def _tensor_files(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name."""
    if (model_dir / "model.safetensors.index.json").is_file():
        index = read_json_file(model_dir, "model.safetensors.index.json")
        return dict(index["weight_map"])
    if not (model_dir / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"neither model.safetensors nor model.safetensors.index.json found in model directory {model_dir}"
        )
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return {name: "model.safetensors" for name in f.keys()}


def _read_tensors(
    model_dir: Path, files: dict[str, str], names: set[str], cuts: dict[str, Cut]
) -> dict[str, torch.Tensor]:
    by_file: dict[str, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(files[name], []).append(name)
    tensors = {}
    for file_name, file_names in by_file.items():
        path = model_dir / file_name
        if not path.is_file():
            raise FileNotFoundError(f"{file_name} (named by model.safetensors.index.json) not found in {model_dir}")
        with safe_open(path, framework="pt") as f:
            for name in file_names:
                if name in cuts:  # a TP shard: only its rows/columns are read
                    tensors[name] = finish_cut(apply_cut(f.get_slice(name), cuts[name]), cuts[name])
                else:
                    tensors[name] = f.get_tensor(name)
    return tensors
