"""Manifold-constrained hyper-connections (mHC, paper §2.2) and the final hyper head.

The residual is ``hc_mult`` streams (N, hc, D). Before a block, a one-layer
perceptron on the normed, flattened streams gives three weights: ``pre``
collapses the streams into the block's input, ``post`` spreads the block's
output back over the streams, and ``comb`` (hc x hc) mixes the old streams
into the new ones. ``comb`` is projected towards doubly stochastic by
Sinkhorn-Knopp (alternate column and row normalisation) so the residual
mixing neither grows nor shrinks the signal across many layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.model.deepseek_v4.ops import rms_norm

__all__ = ["HyperConnection", "HyperHead", "hyper_collapse", "hyper_expand"]


@dataclass(frozen=True)
class HyperConnection:
    fn: torch.Tensor  # ((2 + hc) * hc, hc * hidden)
    base: torch.Tensor  # ((2 + hc) * hc,)
    scale: torch.Tensor  # (3,): pre, post, comb
    hc_mult: int
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float


@dataclass(frozen=True)
class HyperHead:
    fn: torch.Tensor  # (hc, hc * hidden)
    base: torch.Tensor  # (hc,)
    scale: torch.Tensor  # (1,)
    hc_eps: float
    norm_eps: float


def hyper_collapse(hc: HyperConnection, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, hc, D) -> (post (N, hc), comb (N, hc, hc), the block input (N, D))."""
    n, m = streams.shape[0], hc.hc_mult
    mixes = rms_norm(streams.reshape(n, -1), None, hc.norm_eps) @ hc.fn.T
    pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([m, m, m * m])
    pre = torch.sigmoid(pre_w * hc.scale[0] + pre_b) + hc.hc_eps
    post = 2 * torch.sigmoid(post_w * hc.scale[1] + post_b)
    comb = torch.softmax(comb_w.view(n, m, m) * hc.scale[2] + comb_b.view(m, m), dim=-1) + hc.hc_eps
    # In place: at decode the matrices are tiny and 20 iterations' allocations cost more than the sums.
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(hc.hc_eps))
    for _ in range(hc.sinkhorn_iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(hc.hc_eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(hc.hc_eps))
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1)
    return post, comb, collapsed


def hyper_expand(
    post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor
) -> torch.Tensor:
    """New streams: stream k = post_k * block output + sum_j comb[j, k] * old stream j."""
    return post.unsqueeze(-1) * block_out.unsqueeze(1) + torch.matmul(comb.transpose(-1, -2), streams)


def hyper_head(head: HyperHead, streams: torch.Tensor) -> torch.Tensor:
    """(N, hc, D) -> (N, D): the last collapse, before the final norm."""
    mixes = rms_norm(streams.reshape(streams.shape[0], -1), None, head.norm_eps) @ head.fn.T
    pre = torch.sigmoid(mixes * head.scale + head.base) + head.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1)
