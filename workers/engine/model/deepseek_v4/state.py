"""What one sequence keeps between forwards, per layer: every state kind of DeepSeek-V4's attention.

- ``window``: the last ``sliding_window - 1`` keys (K = V) of the sliding-window branch.
- a ``CompressorState`` per compressor (the CSA/HCA compressor, and the CSA
  indexer's own one at ``index_head_dim``):
  - ``entries``: the compressed entries emitted so far (T, dim), one per
    ``rate`` tokens, RoPE applied (for the indexer these are its keys);
  - ``tail_kv`` / ``tail_gate``: the projections of the < ``rate`` tokens
    since the last closed window, not yet compressed;
  - ``overlap_kv`` / ``overlap_gate`` (CSA only): the last closed window's
    first-half series, which the next window's entry also pools over.

Those fields are all a cached forward needs to equal the full one; the paged
engine cache stores the same kinds per block (docs/deepseek_v4.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.engine.model.deepseek_v4.config import AttentionKind, DeepseekV4Config

__all__ = ["CompressorState", "LayerState", "SequenceState"]


@dataclass
class CompressorState:
    entries: torch.Tensor  # (T, dim)
    tail_kv: torch.Tensor  # (< rate, width); width = 2 * dim with overlap
    tail_gate: torch.Tensor
    overlap_kv: torch.Tensor | None = None  # (rate, dim), CSA only, None before the first window closes
    overlap_gate: torch.Tensor | None = None

    @classmethod
    def empty(cls, dim: int, width: int) -> CompressorState:
        return cls(torch.zeros(0, dim), torch.zeros(0, width), torch.zeros(0, width))


@dataclass
class LayerState:
    window: torch.Tensor  # (<= sliding_window - 1, head_dim)
    compressor: CompressorState | None = None  # CSA and HCA
    indexer: CompressorState | None = None  # CSA only


@dataclass
class SequenceState:
    """A sequence's whole cache; ``num_tokens`` is the next token's position."""

    layers: list[LayerState]
    num_tokens: int = 0
    extra: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of every tensor this sequence keeps (the measured counterpart of cache_bytes.state_bytes)."""
        total = 0
        for layer in self.layers:
            total += layer.window.nbytes
            for part in (layer.compressor, layer.indexer):
                if part is not None:
                    tensors = (part.entries, part.tail_kv, part.tail_gate, part.overlap_kv, part.overlap_gate)
                    total += sum(t.nbytes for t in tensors if t is not None)
        return total

    @classmethod
    def empty(cls, config: DeepseekV4Config) -> SequenceState:
        layers = []
        for kind in config.layer_kinds:
            layer = LayerState(window=torch.zeros(0, config.head_dim))
            if kind is AttentionKind.CSA:
                layer.compressor = CompressorState.empty(config.head_dim, 2 * config.head_dim)
                layer.indexer = CompressorState.empty(config.index_head_dim, 2 * config.index_head_dim)
            elif kind is AttentionKind.HCA:
                layer.compressor = CompressorState.empty(config.head_dim, config.head_dim)
            layers.append(layer)
        return cls(layers=layers)
