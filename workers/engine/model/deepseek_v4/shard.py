"""DeepSeek-V4 over a worker's ranks: what each rank holds and computes.

===================  =========================================================
attention            tensor-parallel over the query heads: rank r computes
                     heads ``RankShare.heads`` (its rows of ``q_b_proj``, its
                     ``sinks``) and their share of the grouped output
                     projection (``o_a_proj``'s columns of those heads,
                     ``o_b_proj``'s columns of their groups); an all-reduce
                     sums the ranks' outputs. The projection is linear from
                     the heads to ``hidden``, so a group may span ranks.
KV and compressors   replicated: the one shared KV head (MQA), the CSA/HCA
                     compressors and the Lightning Indexer are computed by
                     every rank from the same replicated input, so every
                     rank's cache is the whole cache (which is what lets a
                     ctx worker of one layout feed a gen worker of another).
routed experts       expert-parallel: rank r holds experts ``RankShare.experts``
                     and adds their weighted outputs for the tokens routed to
                     them; routing (hash or top-k) is replicated, so every
                     rank agrees which experts a token takes.
shared expert        tensor-parallel over its intermediate size (column- then
                     row-parallel): its partial sum joins the routed experts'
                     in the MoE's one all-reduce, so splitting it costs no
                     collective and saves memory; replicating it would do
                     ``size`` times the work for nothing.
embedding            replicated (a lookup; no collective per layer input).
lm_head              vocabulary-parallel; rank 0 gathers the logits.
mHC, norms, router   replicated (small, and their inputs are replicated).
===================  =========================================================

Two all-reduces per layer, as Megatron's dense layers have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.config import ConfigError
from workers.engine.model.deepseek_v4.config import DeepseekV4Config
from workers.engine.model.parallel import TP_KEY, TensorParallel

__all__ = ["RankShare", "rank_share", "check_dsv4_shardable", "shard_tensors"]


@dataclass(frozen=True)
class RankShare:
    """What one rank of ``size`` computes (global indices)."""

    heads: range
    groups: range  # the output-projection groups its heads fall in
    group_columns: range  # within each of those groups, o_a_proj's input columns of its heads
    experts: range
    shared_rows: range  # the shared expert's intermediate rows


def check_dsv4_shardable(config: DeepseekV4Config, size: int) -> None:
    """Raise ConfigError (naming tensor_parallel_size) when the model does not split over ``size`` ranks."""
    if size < 1:
        raise ConfigError(TP_KEY, f"must be >= 1, got {size}")
    heads_per_group = config.num_heads // config.o_groups
    heads_per_rank, remainder = divmod(config.num_heads, size)
    if remainder:
        raise ConfigError(TP_KEY, f"{size} does not divide the model's {config.num_heads} attention heads")
    if heads_per_rank % heads_per_group and heads_per_group % heads_per_rank:
        raise ConfigError(TP_KEY, f"{size} ranks of {heads_per_rank} heads do not tile the output projection's "
                                  f"groups of {heads_per_group} heads")
    if config.n_routed_experts % size:
        raise ConfigError(TP_KEY, f"{size} does not divide the model's {config.n_routed_experts} routed experts")
    if _shared_size(config) % size:
        raise ConfigError(TP_KEY, f"{size} does not divide the shared expert's intermediate size "
                                  f"{_shared_size(config)}")


def rank_share(config: DeepseekV4Config, rank: int, size: int) -> RankShare:
    check_dsv4_shardable(config, size)
    per_rank = config.num_heads // size
    heads = range(rank * per_rank, (rank + 1) * per_rank)
    per_group = config.num_heads // config.o_groups
    first_group = heads.start // per_group
    if per_rank >= per_group:  # whole groups
        groups = range(first_group, first_group + per_rank // per_group)
        columns = range(0, per_group * config.head_dim)
    else:  # a part of one group
        groups = range(first_group, first_group + 1)
        offset = heads.start - first_group * per_group
        columns = range(offset * config.head_dim, (offset + per_rank) * config.head_dim)
    experts = _even(config.n_routed_experts, rank, size)
    return RankShare(heads, groups, columns, experts, _even(_shared_size(config), rank, size))


def shard_tensors(config: DeepseekV4Config, tensors: dict[str, torch.Tensor], tp: TensorParallel) -> None:
    """Replace, in place, every tensor the rank holds a part of by that part (a copy: the whole goes)."""
    share = rank_share(config, tp.rank, tp.size)
    d, o_rank = config.head_dim, config.o_lora_rank
    for name in list(tensors):
        tensor = tensors[name]
        part: torch.Tensor | None = None
        if name.endswith("self_attn.q_b_proj.weight"):
            part = tensor[share.heads.start * d : share.heads.stop * d]
        elif name.endswith("self_attn.sinks"):
            part = tensor[share.heads.start : share.heads.stop]
        elif name.endswith("self_attn.o_a_proj.weight"):
            grouped = tensor.view(config.o_groups, o_rank, -1)[share.groups.start : share.groups.stop]
            part = grouped[:, :, share.group_columns.start : share.group_columns.stop].reshape(-1, len(share.group_columns))
        elif name.endswith("self_attn.o_b_proj.weight"):
            part = tensor[:, share.groups.start * o_rank : share.groups.stop * o_rank]
        elif name.endswith(("mlp.experts.gate", "mlp.experts.up", "mlp.experts.down")):
            part = tensor[share.experts.start : share.experts.stop]
        elif name.endswith(("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")):
            part = tensor[share.shared_rows.start : share.shared_rows.stop]
        elif name.endswith("shared_experts.down_proj.weight"):
            part = tensor[:, share.shared_rows.start : share.shared_rows.stop]
        elif name == "lm_head.weight" or (name == "embed_tokens.weight" and config.tie_word_embeddings):
            vocab, padded = tp.vocab_rows(config.vocab_size)
            rows = tensor[vocab.start : vocab.stop]
            part = torch.cat([rows, rows.new_zeros((padded - rows.shape[0], rows.shape[1]))])
            if name == "embed_tokens.weight":  # tied: the embedding stays whole, the head is the shard
                tensors["lm_head.weight"] = part.clone()
                continue
        if part is not None:
            tensors[name] = part.contiguous().clone()


def _shared_size(config: DeepseekV4Config) -> int:
    return config.moe_intermediate_size * config.n_shared_experts


def _even(total: int, rank: int, size: int) -> range:
    per_rank = total // size
    return range(rank * per_rank, (rank + 1) * per_rank)
