"""Small numeric pieces shared by the DeepSeek-V4 modules."""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "top_k_stable"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32; ``weight`` None is the unweighted norm of q and mHC."""
    x = x.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight is None else weight * normed


def top_k_stable(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores along the last dim, ties broken by the LOWER index first.

    The tie-break is part of the engine's definition (docs/deepseek_v4.md): a
    stable descending sort keeps equal scores in index order, so prefill,
    chunked prefill and decode pick the same set whatever the summation order
    upstream left tied. ``torch.topk`` does not promise any order for ties.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
