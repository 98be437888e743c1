"""Bytes of cache state per token of a DeepSeek-V4 sequence, from the config's shapes (float32). Torch-free.

Per layer, for a sequence of ``n`` tokens:
- every layer: the sliding window, min(n, window - 1) keys of ``head_dim`` (K = V: one tensor);
- CSA: n / rate entries of ``head_dim`` and as many indexer keys of ``index_head_dim``,
  plus the compressor tails (< rate tokens of 2 x (kv + gate) x 2 * dim) and the overlap (rate x 2 x dim);
- HCA: n / rate entries of ``head_dim`` plus a tail of < rate tokens of (kv + gate) x dim.
A dense MQA cache of the same model would keep n keys of ``head_dim`` per layer.
"""

from __future__ import annotations

from workers.engine.model.deepseek_v4.config import AttentionKind, DeepseekV4Config

__all__ = ["dense_mqa_bytes_per_token", "state_bytes", "state_bytes_per_token"]

_FLOAT32 = 4


def state_bytes(config: DeepseekV4Config, num_tokens: int, element_bytes: int = _FLOAT32) -> int:
    """Largest state a ``num_tokens``-token sequence keeps (its tails counted full)."""
    total = 0
    for kind in config.layer_kinds:
        elements = min(num_tokens, config.sliding_window - 1) * config.head_dim
        if kind is AttentionKind.CSA:
            rate = config.csa_rate
            for dim in (config.head_dim, config.index_head_dim):
                elements += (num_tokens // rate) * dim  # entries (for the indexer: its keys)
                elements += (rate - 1) * 2 * (2 * dim) + 2 * rate * dim  # tail (kv, gate) and overlap (kv, gate)
        elif kind is AttentionKind.HCA:
            rate = config.hca_rate
            elements += (num_tokens // rate) * config.head_dim + (rate - 1) * 2 * config.head_dim
        total += elements * element_bytes
    return total


def state_bytes_per_token(config: DeepseekV4Config, num_tokens: int, element_bytes: int = _FLOAT32) -> float:
    return state_bytes(config, num_tokens, element_bytes) / num_tokens


def dense_mqa_bytes_per_token(config: DeepseekV4Config, element_bytes: int = _FLOAT32) -> int:
    """A dense MQA cache of the same model: one shared K = V head per layer per token."""
    return config.num_layers * config.head_dim * element_bytes
