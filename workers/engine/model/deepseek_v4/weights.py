"""DeepSeek-V4 safetensors (Hugging Face layout) to float32 tensors under transformers' module names.

Accepted names: the published checkpoints' (``layers.0.attn.wq_a.weight``,
``layers.0.ffn.experts.3.w1.weight``, ``embed.weight``, ``head.weight``), what
transformers' ``save_pretrained`` writes (the same under ``model.``) and
transformers' in-memory names (``model.layers.0.self_attn.q_a_proj.weight``).
All become the in-memory names without ``model.``; per-expert matrices are
stacked into ``mlp.experts.gate`` / ``up`` / ``down`` (E, out, in). Quantized
weights are dequantized on the CPU (quant.py); MTP layers are skipped.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from workers.engine.model.deepseek_v4.config import DeepseekV4Config
from workers.engine.model.deepseek_v4.quant import dequantize, is_quantized
from workers.engine.model.model_config import read_json_file

__all__ = ["load_dsv4_tensors"]

log = logging.getLogger(__name__)

# (pattern, replacement) applied in order, as transformers' conversion mapping for deepseek_v4 does.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_PART = {"w1": "gate", "w3": "up", "w2": "down"}
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def canonical_name(name: str) -> str:
    name = name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def load_dsv4_tensors(model_dir: Path, config: DeepseekV4Config) -> dict[str, torch.Tensor]:
    """Every tensor the model needs, float32 (``tid2eid`` int64), under its canonical name."""
    raw = _read_all(model_dir, config.num_layers)
    block = _fp8_block(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in raw.items():
        if name.endswith(_SCALE_SUFFIXES) and _weight_of(name) in raw:
            continue  # folded into its weight below
        if name.endswith(".weight") and is_quantized(tensor):
            tensor = dequantize(tensor, _scale_of(raw, name), block)
        canonical = canonical_name(name)
        match = _EXPERT.match(canonical)
        if match:
            prefix, index, part = match.groups()
            experts.setdefault(prefix, {}).setdefault(_EXPERT_PART[part], {})[int(index)] = tensor.float()
        elif canonical.endswith("tid2eid"):
            tensors[canonical] = tensor.long()
        else:
            tensors[canonical] = tensor.float()
    for prefix, parts in experts.items():
        for part, by_index in parts.items():
            if sorted(by_index) != list(range(config.n_routed_experts)):
                raise ValueError(f"{prefix}: experts {sorted(by_index)} of {config.n_routed_experts} in the checkpoint")
            tensors[f"{prefix}.{part}"] = torch.stack([by_index[i] for i in range(config.n_routed_experts)])
    for prefix in [n.removesuffix(".gate_up_proj") for n in tensors if n.endswith(".experts.gate_up_proj")]:
        gate, up = tensors.pop(prefix + ".gate_up_proj").chunk(2, dim=1)  # transformers packs gate then up
        tensors[prefix + ".gate"], tensors[prefix + ".up"] = gate.contiguous(), up.contiguous()
        tensors[prefix + ".down"] = tensors.pop(prefix + ".down_proj")
    return tensors


def _read_all(model_dir: Path, num_layers: int) -> dict[str, torch.Tensor]:
    if (model_dir / "model.safetensors.index.json").is_file():
        files = sorted(set(read_json_file(model_dir, "model.safetensors.index.json")["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    raw: dict[str, torch.Tensor] = {}
    skipped = 0
    for file_name in files:
        with safe_open(model_dir / file_name, framework="pt") as f:
            for name in f.keys():
                if _is_mtp(name, num_layers):
                    skipped += 1
                    continue
                raw[name] = f.get_tensor(name)
    if skipped:
        # Multi-token prediction heads serve speculative decoding, which this engine does not run.
        log.info("deepseek_v4: skipped %d MTP tensors (speculative decoding heads, unused)", skipped)
    return raw


def _is_mtp(name: str, num_layers: int) -> bool:
    name = name.removeprefix("model.")
    if name.startswith("mtp."):
        return True
    match = re.match(r"layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= num_layers


def _weight_of(scale_name: str) -> str:
    for suffix in _SCALE_SUFFIXES:
        if scale_name.endswith(suffix):
            return scale_name.removesuffix(suffix) + ".weight"
    return scale_name


def _scale_of(raw: dict[str, torch.Tensor], weight_name: str) -> torch.Tensor:
    stem = weight_name.removesuffix(".weight")
    for suffix in _SCALE_SUFFIXES:
        if stem + suffix in raw:
            return raw[stem + suffix]
    raise ValueError(f"{weight_name} is stored as {raw[weight_name].dtype} but has no .scale or .weight_scale_inv")


def _fp8_block(model_dir: Path) -> tuple[int, int] | None:
    quantization = read_json_file(model_dir, "config.json").get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else None
