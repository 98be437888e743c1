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

__all__ = ["CompressorWeights", "compress"]


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
    entries = rms_norm((chunk_kv * chunk_gate.softmax(dim=1)).sum(dim=1), weights.norm, weights.eps)
    positions = first_position + rate * torch.arange(num_windows)
    cos, sin = rope.cos_sin(positions)
    state.entries = torch.cat([state.entries, apply_rope(entries, cos, sin)])


def visible_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """(S,) how many entries each query may see: entry w covers tokens [w*rate, (w+1)*rate)."""
    return (positions + 1) // rate
