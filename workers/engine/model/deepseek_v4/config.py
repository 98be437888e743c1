"""DeepSeek-V4's config.json as a frozen typed object; errors name the config.json key. Torch-free.

Reads both the keys transformers writes (``layer_types``, ``mlp_layer_types``,
``compress_rates``, nested ``rope_parameters``) and the published checkpoints'
legacy ones (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``,
a flat ``rope_scaling``), folding them as transformers' ``DeepseekV4Config`` does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from workers.config import ConfigError
from workers.engine.model.model_config import _require, _token_ids, read_json_file

__all__ = [
    "AttentionKind",
    "DeepseekV4Config",
    "MlpKind",
    "RopeSpec",
    "ScoringFunc",
    "is_deepseek_v4_dir",
    "load_dsv4_config",
]

MODEL_TYPE = "deepseek_v4"


class AttentionKind(enum.Enum):
    SLIDING = "sliding_attention"
    CSA = "compressed_sparse_attention"
    HCA = "heavily_compressed_attention"


class MlpKind(enum.Enum):
    HASH_MOE = "hash_moe"
    MOE = "moe"


class ScoringFunc(enum.Enum):
    SQRTSOFTPLUS = "sqrtsoftplus"
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


_LEGACY_RATIO_KINDS = {0: AttentionKind.SLIDING, 4: AttentionKind.CSA, 128: AttentionKind.HCA}


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: ``rope_dim`` trailing channels of a head, interleaved pairs."""

    theta: float
    rope_dim: int
    yarn_factor: float | None = None  # None: plain RoPE
    yarn_original_max_positions: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    attention_factor: float = 1.0  # cos/sin multiplier; the V4 reference keeps it 1 under YaRN


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_kinds: tuple[AttentionKind, ...]
    mlp_kinds: tuple[MlpKind, ...]
    csa_rate: int
    hca_rate: int
    main_rope: RopeSpec
    """Sliding-window-only layers."""
    compress_rope: RopeSpec
    """CSA/HCA layers, their compressors and the indexer."""
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: ScoringFunc
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    eos_token_ids: frozenset[int]

    @property
    def num_kv_heads(self) -> int:
        """Shared-KV MQA: one KV head, read by every query head (what KV transfers between layouts plan by)."""
        return 1

    def compress_rate(self, kind: AttentionKind) -> int:
        return {AttentionKind.SLIDING: 0, AttentionKind.CSA: self.csa_rate, AttentionKind.HCA: self.hca_rate}[kind]


def is_deepseek_v4_dir(model: str | Path | None) -> bool:
    """Whether ``model`` is a directory whose config.json says model_type deepseek_v4 (a GGUF file: no)."""
    config_json = Path(model or "") / "config.json"
    if not config_json.is_file():
        return False
    return read_json_file(config_json.parent, "config.json").get("model_type") == MODEL_TYPE


def load_dsv4_config(model_dir: str | Path) -> DeepseekV4Config:
    model_dir = Path(model_dir)
    raw = read_json_file(model_dir, "config.json")
    generation = (
        read_json_file(model_dir, "generation_config.json") if (model_dir / "generation_config.json").is_file() else {}
    )
    return parse_dsv4_config(raw, generation)


def parse_dsv4_config(raw: dict, generation: dict | None = None) -> DeepseekV4Config:
    if raw.get("model_type") != MODEL_TYPE:
        raise ConfigError("config.json:model_type", f"must be {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError("config.json:hidden_act", f"only 'silu' is supported, got {raw['hidden_act']!r}")
    if int(raw.get("num_key_value_heads", 1)) != 1:
        raise ConfigError("config.json:num_key_value_heads", "DeepSeek-V4 attention is shared-KV MQA: must be 1")
    num_layers = _require(raw, "num_hidden_layers", int)
    head_dim = _require(raw, "head_dim", int)
    rates = dict(raw.get("compress_rates") or {})
    csa_rate = int(rates.get(AttentionKind.CSA.value, raw.get("compress_rate_csa", 4)))
    hca_rate = int(rates.get(AttentionKind.HCA.value, raw.get("compress_rate_hca", 128)))
    num_heads = _require(raw, "num_attention_heads", int)
    o_groups = _require(raw, "o_groups", int)
    if num_heads % o_groups:
        raise ConfigError("config.json:o_groups", f"{o_groups} does not divide num_attention_heads {num_heads}")
    main_rope, compress_rope = _rope_specs(raw, head_dim)
    index_head_dim = _require(raw, "index_head_dim", int)
    if index_head_dim < compress_rope.rope_dim:
        raise ConfigError(
            "config.json:index_head_dim", f"{index_head_dim} is below the rope dim {compress_rope.rope_dim}"
        )
    scoring = str(raw.get("scoring_func", "sqrtsoftplus"))
    try:
        scoring_func = ScoringFunc(scoring)
    except ValueError:
        raise ConfigError(
            "config.json:scoring_func", f"must be one of {[s.value for s in ScoringFunc]}, got {scoring!r}"
        ) from None
    return DeepseekV4Config(
        vocab_size=_require(raw, "vocab_size", int),
        hidden_size=_require(raw, "hidden_size", int),
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        q_lora_rank=_require(raw, "q_lora_rank", int),
        o_groups=o_groups,
        o_lora_rank=_require(raw, "o_lora_rank", int),
        sliding_window=_require(raw, "sliding_window", int),
        layer_kinds=_layer_kinds(raw, num_layers),
        mlp_kinds=_mlp_kinds(raw, num_layers),
        csa_rate=csa_rate,
        hca_rate=hca_rate,
        main_rope=main_rope,
        compress_rope=compress_rope,
        index_n_heads=_require(raw, "index_n_heads", int),
        index_head_dim=index_head_dim,
        index_topk=_require(raw, "index_topk", int),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        n_routed_experts=_require(raw, "n_routed_experts", int),
        num_experts_per_tok=_require(raw, "num_experts_per_tok", int),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        moe_intermediate_size=_require(raw, "moe_intermediate_size", int),
        scoring_func=scoring_func,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0)),
        eos_token_ids=_token_ids(raw.get("eos_token_id")) | _token_ids((generation or {}).get("eos_token_id")),
    )


def _layer_kinds(raw: dict, num_layers: int) -> tuple[AttentionKind, ...]:
    if raw.get("layer_types") is not None:
        key, names = "config.json:layer_types", list(raw["layer_types"])
        try:
            kinds = [AttentionKind(name) for name in names]
        except ValueError:
            raise ConfigError(key, f"entries must be among {[k.value for k in AttentionKind]}, got {names}") from None
    elif raw.get("compress_ratios") is not None:
        key, ratios = "config.json:compress_ratios", list(raw["compress_ratios"])
        if any(r not in _LEGACY_RATIO_KINDS for r in ratios):
            raise ConfigError(key, f"entries must be among {sorted(_LEGACY_RATIO_KINDS)}, got {ratios}")
        kinds = [_LEGACY_RATIO_KINDS[r] for r in ratios]
    else:
        raise ConfigError("config.json:layer_types", "missing (neither layer_types nor compress_ratios)")
    if len(kinds) < num_layers:
        raise ConfigError(key, f"has {len(kinds)} entries for {num_layers} layers")
    return tuple(kinds[:num_layers])  # the legacy list also covers the MTP layers


def _mlp_kinds(raw: dict, num_layers: int) -> tuple[MlpKind, ...]:
    if raw.get("mlp_layer_types") is None:
        num_hash = int(raw.get("num_hash_layers", 3))
        return tuple(MlpKind.HASH_MOE if i < num_hash else MlpKind.MOE for i in range(num_layers))
    names = list(raw["mlp_layer_types"])
    try:
        kinds = [MlpKind(name) for name in names]
    except ValueError:
        raise ConfigError("config.json:mlp_layer_types", f"entries must be hash_moe or moe, got {names}") from None
    if len(kinds) < num_layers:
        raise ConfigError("config.json:mlp_layer_types", f"has {len(kinds)} entries for {num_layers} layers")
    return tuple(kinds[:num_layers])


def _rope_specs(raw: dict, head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    if raw.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * float(raw["partial_rotary_factor"]))
    else:
        rope_dim = int(raw.get("qk_rope_head_dim", head_dim // 8))
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ConfigError(
            "config.json:partial_rotary_factor", f"gives a rope dim of {rope_dim} for head_dim {head_dim}"
        )
    parameters = raw.get("rope_parameters") or {}
    if isinstance(parameters.get("compress"), dict):
        key, main_raw, compress_raw = (
            "config.json:rope_parameters.compress",
            parameters.get("main") or {},
            parameters["compress"],
        )
    else:
        key = "config.json:rope_scaling" if raw.get("rope_scaling") else "config.json:rope_parameters"
        main_raw, compress_raw = {}, dict(raw.get("rope_scaling") or parameters)
        compress_raw["rope_theta"] = raw.get("compress_rope_theta", 160000.0)
    main = RopeSpec(theta=float(main_raw.get("rope_theta", raw.get("rope_theta", 10000.0))), rope_dim=rope_dim)
    compress_theta = float(compress_raw.get("rope_theta", raw.get("compress_rope_theta", 160000.0)))
    rope_type = compress_raw.get("rope_type", compress_raw.get("type", "default"))
    if rope_type == "default":
        return main, RopeSpec(theta=compress_theta, rope_dim=rope_dim)
    if rope_type != "yarn":
        raise ConfigError(key, f"rope_type must be default or yarn, got {rope_type!r}")
    for name in ("factor", "original_max_position_embeddings"):
        if name not in compress_raw:
            raise ConfigError(f"{key}.{name}", "missing (YaRN needs it)")
    return main, RopeSpec(
        theta=compress_theta,
        rope_dim=rope_dim,
        yarn_factor=float(compress_raw["factor"]),
        yarn_original_max_positions=int(compress_raw["original_max_position_embeddings"]),
        yarn_beta_fast=float(compress_raw.get("beta_fast") or 32.0),
        yarn_beta_slow=float(compress_raw.get("beta_slow") or 1.0),
        # The V4 reference does not scale cos/sin under YaRN (transformers forces attention_factor 1).
        attention_factor=float(compress_raw.get("attention_factor", 1.0)),
    )
