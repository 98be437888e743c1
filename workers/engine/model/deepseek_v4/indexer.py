"""The Lightning Indexer (paper §2.3.1, eqs. 13-17): which CSA entries each query attends to.

score(t, s) = sum_h w_{t,h} * ReLU(q_{t,h} . K_s) / sqrt(index_head_dim), with
w = H W_w / sqrt(index_n_heads) and K the indexer's own compressed keys. A
query keeps the ``index_topk`` highest-scoring entries among those it may see
(entry s closed at or before it); ties go to the lower entry index (ops.top_k_stable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.model.deepseek_v4.compressor import CompressorWeights, visible_entries
from workers.engine.model.deepseek_v4.ops import top_k_stable
from workers.engine.model.deepseek_v4.rope import RopeTable, apply_rope

__all__ = ["IndexerWeights", "index_scores", "select_entries"]


@dataclass(frozen=True)
class IndexerWeights:
    compressor: CompressorWeights
    q_b_proj: torch.Tensor  # (n_heads * head_dim, q_lora_rank)
    weights_proj: torch.Tensor  # (n_heads, hidden)
    num_heads: int
    head_dim: int
    top_k: int


def index_scores(
    weights: IndexerWeights,
    keys: torch.Tensor,
    hidden: torch.Tensor,
    q_residual: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeTable,
) -> torch.Tensor:
    """(S, T) scores of S queries against T indexer keys; entries a query may not see are -inf.

    ``keys`` is (T, D), shared by the S queries of one sequence, or (S, T, D), each
    query its own sequence's keys (a batched decode: one query per sequence, shorter
    sequences' keys padded at the end, which their positions make invisible).
    """
    q = (q_residual @ weights.q_b_proj.T).view(-1, weights.num_heads, weights.head_dim)
    cos, sin = rope.cos_sin(positions)
    q = apply_rope(q, cos, sin)
    pattern = "shd,td->sht" if keys.dim() == 2 else "shd,std->sht"
    per_head = torch.relu(torch.einsum(pattern, q.float(), keys.float())) * weights.head_dim**-0.5
    head_weights = (hidden @ weights.weights_proj.T).float() * weights.num_heads**-0.5  # (S, H)
    scores = (per_head * head_weights.unsqueeze(-1)).sum(dim=1)
    future = torch.arange(keys.shape[-2]) >= visible_entries(positions, weights.compressor.rate).unsqueeze(-1)
    return scores.masked_fill(future, float("-inf"))


def select_entries(scores: torch.Tensor, positions: torch.Tensor, rate: int, top_k: int) -> torch.Tensor:
    """(S, T) bool: the entries each query attends to (its top-k among the visible ones)."""
    num_entries = scores.shape[-1]
    selected = torch.zeros_like(scores, dtype=torch.bool)
    if num_entries == 0:
        return selected
    chosen = top_k_stable(scores, min(top_k, num_entries))
    selected.scatter_(-1, chosen, True)
    # A query that sees fewer than k entries was handed invisible ones to fill its k: drop them.
    return selected & (torch.arange(num_entries) < visible_entries(positions, rate).unsqueeze(-1))
