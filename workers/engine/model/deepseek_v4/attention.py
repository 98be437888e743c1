"""DeepSeek-V4 attention for one layer (paper §2.3): shared-KV MQA over a sliding window plus,
on CSA/HCA layers, the compressed entries (all visible ones for HCA, the indexer's picks for CSA).

Per-head learnable sinks join the softmax's denominator; the output's rope
slice is rotated back by the query's angle; the grouped output projection
maps each group of heads to ``o_lora_rank`` then all groups to ``hidden``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.model.deepseek_v4.compressor import CompressorWeights, compress, visible_entries
from workers.engine.model.deepseek_v4.config import AttentionKind
from workers.engine.model.deepseek_v4.indexer import IndexerWeights, index_scores, select_entries
from workers.engine.model.deepseek_v4.ops import rms_norm
from workers.engine.model.deepseek_v4.rope import RopeTable, apply_rope
from workers.engine.model.deepseek_v4.state import LayerState

__all__ = ["AttentionWeights", "SequenceSlice", "attention"]


@dataclass(frozen=True)
class AttentionWeights:
    kind: AttentionKind
    q_a_proj: torch.Tensor  # (q_lora_rank, hidden)
    q_a_norm: torch.Tensor
    q_b_proj: torch.Tensor  # (heads * head_dim, q_lora_rank)
    kv_proj: torch.Tensor  # (head_dim, hidden)
    kv_norm: torch.Tensor
    o_a_proj: torch.Tensor  # (groups * o_lora_rank, heads * head_dim / groups)
    o_b_proj: torch.Tensor  # (hidden, groups * o_lora_rank)
    sinks: torch.Tensor  # (heads,)
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None
    num_heads: int
    head_dim: int
    o_groups: int
    sliding_window: int
    eps: float


@dataclass
class SequenceSlice:
    """The rows [start, end) of a flat batch that belong to one sequence, and its layer state."""

    start: int
    end: int
    state: LayerState


def attention(
    weights: AttentionWeights,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    slices: list[SequenceSlice],
    rope: RopeTable,
) -> torch.Tensor:
    """(N, hidden) -> (N, hidden) for a flat batch of tokens; each slice's state is advanced."""
    n = hidden.shape[0]
    q_residual = rms_norm(hidden @ weights.q_a_proj.T, weights.q_a_norm, weights.eps)
    q = rms_norm((q_residual @ weights.q_b_proj.T).view(n, weights.num_heads, weights.head_dim), None, weights.eps)
    cos, sin = rope.cos_sin(positions)
    q = apply_rope(q, cos, sin)
    kv = apply_rope(rms_norm(hidden @ weights.kv_proj.T, weights.kv_norm, weights.eps), cos, sin)  # (N, D)
    out = torch.empty_like(q)
    for part in slices:
        rows = slice(part.start, part.end)
        out[rows] = _attend_one(
            weights, q[rows], kv[rows], hidden[rows], q_residual[rows], positions[rows], part.state, rope
        )
    out = apply_rope(out, cos, -sin)
    grouped = out.reshape(n, weights.o_groups, -1)  # (N, G, heads/G * D)
    o_a = weights.o_a_proj.view(weights.o_groups, -1, grouped.shape[-1])  # (G, o_lora_rank, heads/G * D)
    mixed = torch.einsum("ngi,goi->ngo", grouped, o_a).flatten(1)
    return mixed @ weights.o_b_proj.T


def _attend_one(
    weights: AttentionWeights,
    q: torch.Tensor,
    kv: torch.Tensor,
    hidden: torch.Tensor,
    q_residual: torch.Tensor,
    positions: torch.Tensor,
    state: LayerState,
    rope: RopeTable,
) -> torch.Tensor:
    """One sequence's S new queries (S, H, D) over its window and compressed entries."""
    keys = torch.cat([state.window, kv])  # the previous (W - 1) keys and the new ones
    key_positions = positions[-1] - keys.shape[0] + 1 + torch.arange(keys.shape[0])
    distance = positions.unsqueeze(-1) - key_positions  # (S, K)
    window_mask = (distance >= 0) & (distance < weights.sliding_window)
    state.window = keys[-(weights.sliding_window - 1) :] if weights.sliding_window > 1 else keys[:0]
    scale = weights.head_dim**-0.5
    logits = torch.einsum("shd,kd->hsk", q, keys) * scale
    logits = logits.masked_fill(~window_mask, float("-inf"))
    values = keys
    if weights.compressor is not None and state.compressor is not None:
        compress(weights.compressor, state.compressor, hidden, rope)
        entries = state.compressor.entries
        if weights.indexer is not None and state.indexer is not None:
            compress(weights.indexer.compressor, state.indexer, hidden, rope)
            scores = index_scores(weights.indexer, state.indexer.entries, hidden, q_residual, positions, rope)
            entry_mask = select_entries(scores, positions, weights.compressor.rate, weights.indexer.top_k)
        else:
            entry_mask = torch.arange(entries.shape[0]) < visible_entries(positions, weights.compressor.rate).unsqueeze(
                -1
            )
        entry_logits = torch.einsum("shd,td->hst", q, entries) * scale
        logits = torch.cat([logits, entry_logits.masked_fill(~entry_mask, float("-inf"))], dim=-1)
        values = torch.cat([keys, entries])
    sinks = weights.sinks.view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1]  # the sink takes its share, then is dropped
    return torch.einsum("hsk,kd->shd", probs, values)
