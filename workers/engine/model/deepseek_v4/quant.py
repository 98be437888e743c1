"""Dequantizing the published checkpoints' block-scaled FP8 and FP4 weights to float32 on the CPU.

Layout (DeepSeek's and transformers' FP8 integration alike): a weight ``X.weight``
stored as ``float8_e4m3fn`` (or FP4 e2m1, two values per ``int8``/``uint8`` byte,
low nibble first, the input dim halved) and its scale grid ``X.scale`` (or
``X.weight_scale_inv``): one float32 or UE8M0 (a ``uint8``/``float8_e8m0fnu``
exponent, 2**(b - 127)) per block. The block is ``quantization_config.weight_block_size``
for FP8 (the grid may be ceil-sized: the last block is partial) and 1 x 32 for FP4.
"""

from __future__ import annotations

import torch

__all__ = ["FP4_E2M1_VALUES", "dequantize", "is_quantized"]

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_BLOCK = (1, 32)
_FP4_DTYPES = {torch.int8, torch.uint8} | ({torch.float4_e2m1fn_x2} if hasattr(torch, "float4_e2m1fn_x2") else set())
_UE8M0_DTYPES = {torch.uint8} | ({torch.float8_e8m0fnu} if hasattr(torch, "float8_e8m0fnu") else set())
_FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


def is_quantized(weight: torch.Tensor) -> bool:
    return weight.dtype in _FP8_DTYPES or weight.dtype in _FP4_DTYPES


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fp8_block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 values of ``weight`` (..., rows, cols) under its per-block ``scale`` (..., grid_r, grid_c)."""
    if weight.dtype in _FP4_DTYPES:
        values = _unpack_fp4(weight)
        block = FP4_BLOCK
    else:
        values = weight.to(torch.float32)
        block = fp8_block or _exact_block(values.shape[-2:], scale.shape[-2:])
    scales = _scale_values(scale)
    if scales.dim() < 2:
        return values * scales
    expanded = scales.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    rows, cols = values.shape[-2:]
    if expanded.shape[-2] < rows or expanded.shape[-1] < cols:
        raise ValueError(
            f"scale grid {tuple(scale.shape)} with block {block} does not cover weight {tuple(values.shape)}"
        )
    return values * expanded[..., :rows, :cols]


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    as_bytes = packed.contiguous().view(torch.uint8).long()
    low, high = table[as_bytes & 0xF], table[(as_bytes >> 4) & 0xF]
    return torch.stack([low, high], dim=-1).flatten(-2)  # (..., rows, 2 * packed cols)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype in _UE8M0_DTYPES:
        return (scale.contiguous().view(torch.uint8).to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def _exact_block(shape: torch.Size, grid: torch.Size) -> tuple[int, int]:
    rows, cols = shape
    grid_rows, grid_cols = grid
    if rows % grid_rows or cols % grid_cols:
        raise ValueError(
            f"weight ({rows}, {cols}) is not divisible by its scale grid ({grid_rows}, {grid_cols}) and "
            "config.json has no quantization_config.weight_block_size"
        )
    return rows // grid_rows, cols // grid_cols
