"""The KV compressor of CSA and HCA layers (paper §2.3.1-2.3.2), also the indexer's key compressor.

Every ``rate`` source tokens close a window that becomes one entry:
``rms_norm(sum_j softmax_j(Z_j + B_j) * C_j)`` with C = H W_kv, Z = H W_gate and
a learned per-slot bias B, then RoPE at the window's first position. With
``overlap`` (CSA) each token projects two series, Ca (first half) and Cb
(second half); entry w pools window w's Cb together with window w-1's Ca,
2 * rate slots (the first window has no Ca: weight 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.model.deepseek_v4.ops import rms_norm
from workers.engine.model.deepseek_v4.rope import RopeTable, apply_rope
from workers.engine.model.deepseek_v4.state import CompressorState

__all__ = ["CompressorWeights", "compress", "compress_one_each"]


@dataclass(frozen=True)
class CompressorWeights:
    kv_proj: torch.Tensor  # (width, hidden)
    gate_proj: torch.Tensor  # (width, hidden)
    position_bias: torch.Tensor  # (rate, width)
    norm: torch.Tensor  # (dim,)
    rate: int
    overlap: bool
    eps: float

    @property
    def dim(self) -> int:
        return self.norm.shape[0]


def compress(weights: CompressorWeights, state: CompressorState, hidden: torch.Tensor, rope: RopeTable) -> None:
    """Feed ``hidden`` (S, hidden) of one sequence, in order, into ``state``: close every full window."""
    kv = torch.cat([state.tail_kv, hidden @ weights.kv_proj.T])
    gate = torch.cat([state.tail_gate, hidden @ weights.gate_proj.T])
    rate, dim = weights.rate, weights.dim
    num_windows = kv.shape[0] // rate
    usable = num_windows * rate
    state.tail_kv, state.tail_gate = kv[usable:], gate[usable:]
    if num_windows == 0:
        return
    first_position = state.entries.shape[0] * rate
    chunk_kv = kv[:usable].view(num_windows, rate, -1)  # (W, rate, width)
    chunk_gate = gate[:usable].view(num_windows, rate, -1) + weights.position_bias
    if weights.overlap:
        pooled_kv = chunk_kv.new_zeros(num_windows, 2 * rate, dim)
        pooled_gate = chunk_gate.new_full((num_windows, 2 * rate, dim), float("-inf"))
        pooled_kv[:, rate:], pooled_gate[:, rate:] = chunk_kv[..., dim:], chunk_gate[..., dim:]
        pooled_kv[1:, :rate], pooled_gate[1:, :rate] = chunk_kv[:-1, :, :dim], chunk_gate[:-1, :, :dim]
        if state.overlap_kv is not None and state.overlap_gate is not None:
            pooled_kv[0, :rate], pooled_gate[0, :rate] = state.overlap_kv, state.overlap_gate
        state.overlap_kv, state.overlap_gate = chunk_kv[-1, :, :dim].clone(), chunk_gate[-1, :, :dim].clone()
        chunk_kv, chunk_gate = pooled_kv, pooled_gate
    positions = first_position + rate * torch.arange(num_windows)
    state.entries = torch.cat([state.entries, _entries(weights, chunk_kv, chunk_gate, positions, rope)])


def compress_one_each(
    weights: CompressorWeights, states: list[CompressorState], hidden: torch.Tensor, rope: RopeTable
) -> None:
    """``compress`` of one new token for each of B sequences, ``hidden`` (B, hidden) row b being
    sequence b's: one product projects them all, a sequence whose window is not full only keeps its
    row, and the windows that close are pooled together (a decode step closes many at once)."""
    kv, gate = hidden @ weights.kv_proj.T, hidden @ weights.gate_proj.T
    rate, dim = weights.rate, weights.dim
    closing = []
    for row, state in enumerate(states):
        if state.tail_kv.shape[0] + 1 < rate:
            state.tail_kv = torch.cat([state.tail_kv, kv[row : row + 1]])
            state.tail_gate = torch.cat([state.tail_gate, gate[row : row + 1]])
        else:
            closing.append(row)
    if not closing:
        return
    closed, rows = [states[row] for row in closing], torch.tensor(closing)
    # Each closing window is its rate - 1 tail rows and the new row: (C, rate, width).
    chunk_kv = torch.cat([torch.stack([s.tail_kv for s in closed]), kv[rows].unsqueeze(1)], dim=1)
    chunk_gate = torch.cat([torch.stack([s.tail_gate for s in closed]), gate[rows].unsqueeze(1)], dim=1)
    chunk_gate = chunk_gate + weights.position_bias
    if weights.overlap:  # the previous window's first half, none (weight 0) before the first window
        no_kv, no_gate = kv.new_zeros(rate, dim), gate.new_full((rate, dim), float("-inf"))
        previous_kv = torch.stack([no_kv if s.overlap_kv is None else s.overlap_kv for s in closed])
        previous_gate = torch.stack([no_gate if s.overlap_gate is None else s.overlap_gate for s in closed])
        for state, window_kv, window_gate in zip(closed, chunk_kv, chunk_gate, strict=True):
            state.overlap_kv, state.overlap_gate = window_kv[:, :dim].clone(), window_gate[:, :dim].clone()
        chunk_kv = torch.cat([previous_kv, chunk_kv[..., dim:]], dim=1)  # (C, 2 * rate, dim)
        chunk_gate = torch.cat([previous_gate, chunk_gate[..., dim:]], dim=1)
    positions = torch.tensor([s.entries.shape[0] * rate for s in closed])
    for state, entry in zip(closed, _entries(weights, chunk_kv, chunk_gate, positions, rope), strict=True):
        state.entries = torch.cat([state.entries, entry.unsqueeze(0)])
        state.tail_kv, state.tail_gate = kv[:0], gate[:0]


def _entries(
    weights: CompressorWeights, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rope: RopeTable
) -> torch.Tensor:
    """(W, slots, dim) windows -> (W, dim) entries: gate-softmax pooling, norm, RoPE at each window's start."""
    entries = rms_norm((kv * gate.softmax(dim=1)).sum(dim=1), weights.norm, weights.eps)
    cos, sin = rope.cos_sin(positions)
    return apply_rope(entries, cos, sin)


def visible_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """(S,) how many entries each query may see: entry w covers tokens [w*rate, (w+1)*rate)."""
    return (positions + 1) // rate
