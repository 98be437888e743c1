"""DeepSeek-V4's MoE block: routed experts (hash-routed or top-k routed) plus the shared expert.

Hash layers pick each token's experts by a fixed ``tid2eid[token id]`` table
(paper §2.1); the learned gate still weighs them. Top-k layers pick the
``num_experts_per_tok`` highest ``score + e_score_correction_bias`` (the bias
only steers the choice, the weights are the unbiased scores). Weights are
normalised to sum 1 when ``norm_topk_prob`` (transformers always does), then
scaled by ``routed_scaling_factor``. Every expert is a SwiGLU whose gate is
clamped above and up clamped both ways at ``swiglu_limit``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engine.model.deepseek_v4.config import ScoringFunc
from workers.engine.model.deepseek_v4.ops import top_k_stable

__all__ = ["MoeWeights", "moe"]


@dataclass(frozen=True)
class MoeWeights:
    router: torch.Tensor  # (E, hidden)
    correction_bias: torch.Tensor | None  # (E,), top-k layers
    tid2eid: torch.Tensor | None  # (vocab, k) int64, hash layers
    gate: torch.Tensor  # (E, inter, hidden)
    up: torch.Tensor  # (E, inter, hidden)
    down: torch.Tensor  # (E, hidden, inter)
    experts: range  # the routed experts gate/up/down hold (a rank's share, ``shard.py``), in order
    shared_gate: torch.Tensor  # (inter, hidden)
    shared_up: torch.Tensor
    shared_down: torch.Tensor  # (hidden, inter)
    top_k: int
    scoring: ScoringFunc
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float


def moe(weights: MoeWeights, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(N, hidden) -> (N, hidden); on one rank of many, its experts' and its shared-expert rows' share."""
    scores = _score(weights.scoring, hidden @ weights.router.T)  # (N, E)
    if weights.tid2eid is not None:
        chosen = weights.tid2eid[token_ids]
    else:
        bias = weights.correction_bias if weights.correction_bias is not None else 0.0
        chosen = top_k_stable(scores + bias, weights.top_k)
    routing = scores.gather(1, chosen)
    if weights.norm_topk_prob:
        routing = routing / (routing.sum(dim=-1, keepdim=True) + 1e-20)
    routing = routing * weights.routed_scaling_factor
    out = _routed(weights, hidden, chosen, routing)
    shared = _swiglu(hidden, weights.shared_gate, weights.shared_up, weights.shared_down, weights.swiglu_limit)
    return out + shared


def _routed(weights: MoeWeights, hidden: torch.Tensor, chosen: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum for every token: the (token, slot) pairs sorted by expert so
    each expert takes a contiguous slice of one gathered input, and one scatter adds them all back
    (a decode step is op overhead: a handful of ops per expert, not a mask, gather and scatter each)."""
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=weights.router.shape[0]).tolist()
    rows = order // chosen.shape[1]
    inputs = hidden[rows]
    pieces, kept, start = [], [], 0
    for expert, count in enumerate(counts):
        if count and expert in weights.experts:  # another rank's experts add that rank's share
            local = expert - weights.experts.start
            span = slice(start, start + count)
            pieces.append(
                _swiglu(inputs[span], weights.gate[local], weights.up[local], weights.down[local], weights.swiglu_limit)
            )
            kept.append(order[span])
        start += count
    out = torch.zeros_like(hidden)
    if pieces:
        pairs = torch.cat(kept)
        out.index_add_(0, pairs // chosen.shape[1], torch.cat(pieces) * routing.flatten()[pairs, None])
    return out


def _score(scoring: ScoringFunc, logits: torch.Tensor) -> torch.Tensor:
    if scoring is ScoringFunc.SQRTSOFTPLUS:
        return F.softplus(logits).sqrt()
    if scoring is ScoringFunc.SIGMOID:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, limit: float) -> torch.Tensor:
    g = (x @ gate.T).clamp(max=limit)
    u = (x @ up.T).clamp(min=-limit, max=limit)
    return (F.silu(g) * u) @ down.T
