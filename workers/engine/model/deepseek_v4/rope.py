"""DeepSeek-V4's RoPE: interleaved pairs on the trailing ``rope_dim`` channels of a head.

Two tables: "main" (plain, ``rope_theta``) for sliding-window-only layers and
"compress" (``compress_rope_theta``, optionally YaRN) for CSA/HCA layers, their
compressed entries and the indexer. The attention output's rope slice is
rotated back by the query's angle (``sin`` negated): K = V, so V carries the
key's rotation and the product keeps only the relative one.
"""

from __future__ import annotations

import math

import torch

from workers.engine.model.deepseek_v4.config import RopeSpec

__all__ = ["RopeTable", "apply_rope"]


def rope_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """(rope_dim / 2,) float32 inverse frequencies, as transformers computes them (default or YaRN)."""
    dim = spec.rope_dim
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if spec.yarn_factor is None:
        return extrapolation
    interpolation = 1.0 / (spec.yarn_factor * pos_freqs)
    original = spec.yarn_original_max_positions

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    # YaRN's band: dims rotating more than beta_fast times over the original length keep their
    # frequency, fewer than beta_slow are interpolated by `factor`, a linear ramp in between.
    low = max(math.floor(correction_dim(spec.yarn_beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(spec.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class RopeTable:
    """cos/sin for any positions: (N, rope_dim / 2) each, float32."""

    def __init__(self, spec: RopeSpec) -> None:
        self.inv_freq = rope_inv_freq(spec)
        self.attention_factor = spec.attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` (N, ..., D) in interleaved pairs.

    ``cos``/``sin`` are (N, rope_dim / 2) and broadcast over the middle dims.
    """
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    pairs = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)
