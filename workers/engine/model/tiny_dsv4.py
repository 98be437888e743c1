"""A deterministic random-weight DeepSeek-V4 checkpoint, written through transformers.

``make_tiny_dsv4(path)`` builds ``DeepseekV4ForCausalLM`` from a small
``DeepseekV4Config`` and saves it with ``save_pretrained``, so the files are
exactly what transformers writes for this architecture (names, shapes and the
config keys), next to the tiny tokenizer that ``tiny.py`` writes.

What the tiny config keeps from the real one, so tests exercise every path:
all three attention layer types (sliding window only, CSA at rate 4 with the
Lightning Indexer, HCA at rate 128), both MoE kinds (hash and top-k routed),
``hc_mult`` 4, 16 routed experts with top-4, a window of 128 and YaRN on the
compressed branches. ``index_topk`` 16 means the indexer really selects once a
prompt has more than 64 tokens (1,500 tokens give 375 CSA entries).

Weight scale: transformers' own init (std 0.02, zero position biases, sinks
and hyper-connection bases) would give near-uniform logits in which a cache
bug hides; projections here are N(0, 1/fan_in) and every bias/sink/scale is
drawn, so a wrong branch moves the logits by far more than float noise.
Needs the dev extra (torch + transformers >= 5.24); the engine never imports this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.engine.model.tiny_tokenizer import write_tokenizer

if TYPE_CHECKING:
    import torch

__all__ = ["TINY_DSV4_CONFIG", "make_tiny_dsv4"]

_VOCAB_SIZE = 512
_MAX_POSITION_EMBEDDINGS = 65536

# The DeepseekV4Config keys of the tiny model (everything else is the config's default).
TINY_DSV4_CONFIG: dict = {
    "vocab_size": _VOCAB_SIZE,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "num_experts_per_tok": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": _MAX_POSITION_EMBEDDINGS,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    # YaRN on the compressed branches as the published config has it (factor 16 over the original length).
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": _MAX_POSITION_EMBEDDINGS // 16,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 16,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def make_tiny_dsv4(path: str | Path, seed: int = 0, **overrides: object) -> Path:
    """Write the tiny DeepSeek-V4 checkpoint into ``path`` and return it.

    ``overrides`` replace keys of ``TINY_DSV4_CONFIG`` (e.g. ``index_topk=4096``
    for a checkpoint whose indexer keeps every entry).
    """
    try:
        import torch
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as exc:  # the serving install has no transformers
        raise RuntimeError("--arch deepseek_v4 needs the dev extra (torch and transformers >= 5.24)") from exc
    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)
    token_ids = write_tokenizer(model_dir, _VOCAB_SIZE, _MAX_POSITION_EMBEDDINGS)
    keys = {**TINY_DSV4_CONFIG, **overrides}
    config = DeepseekV4Config(
        **keys, bos_token_id=token_ids["bos"], eos_token_id=[token_ids["eos"], token_ids["eot"]], dtype="float32"
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = DeepseekV4ForCausalLM(config).float()
    _randomize(model, generator)
    model.save_pretrained(model_dir)
    (model_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": token_ids["bos"], "eos_token_id": [token_ids["eos"], token_ids["eot"]]}, indent=2)
        + "\n",
        encoding="utf-8",
    )
    return model_dir


def _randomize(model: Any, generator: torch.Generator) -> None:  # Any: transformers' model types are partial
    """Every parameter and buffer drawn in name order from one generator (see the module docstring)."""
    import torch

    config = model.config
    with torch.no_grad():
        for name, tensor in sorted([*model.named_parameters(), *model.named_buffers()]):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                # Each token's own top-k distinct experts (a permutation prefix per token).
                noise = torch.rand(config.vocab_size, config.n_routed_experts, generator=generator)
                tensor.copy_(noise.argsort(dim=-1)[:, : config.num_experts_per_tok])
            elif tensor.dim() == 1 and "norm" in name:
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            elif tensor.dim() == 1 or "position_bias" in name:
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))
            else:
                fan_in = tensor.shape[-1]
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / fan_in**0.5)
        model.lm_head.weight.mul_(2.0)  # logits of std ~2: greedy argmax not decided by rounding
