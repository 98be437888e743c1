"""DeepSeek-V4 attention for one layer (paper §2.3): shared-KV MQA over a sliding window plus,
on CSA/HCA layers, the compressed entries (all visible ones for HCA, the indexer's picks for CSA).

Per-head learnable sinks join the softmax's denominator; the output's rope
slice is rotated back by the query's angle; the grouped output projection
maps each group of heads to ``o_lora_rank`` then all groups to ``hidden``.

A sequence with several new tokens (a prefill chunk) attends on its own; the
sequences with one new token each (decodes) attend together, their windows and
compressed entries stacked and padded, so a decode step is a few batched
products per layer instead of a Python loop over the batch. Padding takes no
share of a softmax (its logits are -inf), so each row's result is its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.model.deepseek_v4.compressor import CompressorWeights, compress, compress_one_each, visible_entries
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
    singles = [part for part in slices if part.end - part.start == 1]
    if singles:
        rows = torch.tensor([part.start for part in singles])
        states = [part.state for part in singles]
        out[rows] = _attend_decode(
            weights, q[rows], kv[rows], hidden[rows], q_residual[rows], positions[rows], states, rope
        )
    for part in slices:
        if part.end - part.start > 1:
            span = slice(part.start, part.end)
            out[span] = _attend_one(
                weights, q[span], kv[span], hidden[span], q_residual[span], positions[span], part.state, rope
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
    return torch.einsum("hsk,kd->shd", _probabilities(logits, weights.sinks), values)


def _attend_decode(
    weights: AttentionWeights,
    q: torch.Tensor,
    kv: torch.Tensor,
    hidden: torch.Tensor,
    q_residual: torch.Tensor,
    positions: torch.Tensor,
    states: list[LayerState],
    rope: RopeTable,
) -> torch.Tensor:
    """B sequences' one new query each (B, H, D), each over its own window and compressed entries."""
    keys, key_valid = _stacked_windows(states, kv, weights.sliding_window)  # (B, K, D), (B, K)
    scale = weights.head_dim**-0.5
    logits = torch.einsum("bhd,bkd->hbk", q, keys) * scale  # (H, B, K): the layout _attend_one has
    logits = logits.masked_fill(~key_valid, float("-inf"))
    values = keys
    compressor = weights.compressor
    if compressor is not None:
        compressors = [s.compressor for s in states if s.compressor is not None]
        compress_one_each(compressor, compressors, hidden, rope)
        entries = _padded([c.entries for c in compressors])  # (B, T, D)
        if weights.indexer is not None:
            index = weights.indexer
            indexers = [s.indexer for s in states if s.indexer is not None]
            compress_one_each(index.compressor, indexers, hidden, rope)
            index_keys = _padded([i.entries for i in indexers])
            scores = index_scores(index, index_keys, hidden, q_residual, positions, rope)
            entry_mask = select_entries(scores, positions, compressor.rate, index.top_k)
        else:
            entry_mask = torch.arange(entries.shape[1]) < visible_entries(positions, compressor.rate).unsqueeze(-1)
        entry_logits = torch.einsum("bhd,btd->hbt", q, entries) * scale
        logits = torch.cat([logits, entry_logits.masked_fill(~entry_mask, float("-inf"))], dim=-1)
        values = torch.cat([keys, entries], dim=1)
    return torch.einsum("hbk,bkd->bhd", _probabilities(logits, weights.sinks), values)


def _stacked_windows(states: list[LayerState], kv: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's window keys then its new key, right-aligned in (B, K, D) so the new key is last;
    which slots hold a key. Each state's window moves on by the new key."""
    lengths = [state.window.shape[0] for state in states]
    longest = max(lengths)
    keys = kv.new_zeros(len(states), longest + 1, kv.shape[-1])
    for row, (state, length) in enumerate(zip(states, lengths, strict=True)):
        keys[row, longest - length : longest] = state.window
        moved = torch.cat([state.window, kv[row : row + 1]])  # a window of W keeps the W - 1 previous keys
        state.window = moved[-(window - 1) :] if window > 1 else moved[:0]
    keys[:, longest] = kv
    first = longest - torch.tensor(lengths)
    return keys, torch.arange(longest + 1) >= first.unsqueeze(-1)


def _padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(B, T, D): each sequence's rows from the start, zeros after (its positions make them invisible)."""
    out = tensors[0].new_zeros(len(tensors), max(t.shape[0] for t in tensors), tensors[0].shape[-1])
    for row, tensor in enumerate(tensors):
        out[row, : tensor.shape[0]] = tensor
    return out


def _probabilities(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax of (H, S, K) logits over K with each head's sink in the denominator."""
    combined = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, logits.shape[1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return combined.softmax(dim=-1)[..., :-1]  # the sink takes its share, then is dropped
