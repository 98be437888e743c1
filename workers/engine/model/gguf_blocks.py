"""GGUF quantized tensors as blocks of 32 weights ``scale * q + zero``, for ``quant_matmul.c``.

Q4_0, Q4_1, Q4_K and Q8_0 all reduce to that form with the file's own numbers
(table below), so a weight the kernel expands is the float ``gguf_dequant``
gives; ``QuantBlocks.dequantize`` is checked against it bit for bit
(tests/workers/test_quant_linear.py). Q6_K (sub-blocks of 16 with their own
scale) and the float types do not fit: those tensors stay dequantized.

=====  ==========================  ==================  ==========
type   file                        scale               zero
=====  ==========================  ==================  ==========
Q4_0   d (q - 8)                   d                   -8 d
Q4_1   d q + m                     d                   m
Q4_K   (d sc_j) q - (dmin m_j)     d sc_j              -dmin m_j
Q8_0   d q (q signed)              d                   0
=====  ==========================  ==================  ==========

Torch-free: rows are numpy arrays, so the loader can unpermute and concatenate
them along the output dimension as it does float weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BLOCK", "KEPT_GGML_TYPES", "QuantBlocks", "read_blocks", "concatenate_blocks"]

BLOCK = 32
KEPT_GGML_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


@dataclass(frozen=True)
class QuantBlocks:
    """N rows of K weights: ``bits`` 4 or 8, ``qs`` (N, K/2) packed nibbles or (N, K) int8 bytes,
    ``scale`` and ``zero`` (N, K/32) float32. Nibbles in GGUF's order: byte j of a block holds
    q[j] (low) and q[j + 16] (high)."""

    bits: int
    qs: np.ndarray
    scale: np.ndarray
    zero: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * BLOCK

    def take_rows(self, order: np.ndarray) -> QuantBlocks:
        return QuantBlocks(self.bits, self.qs[order], self.scale[order], self.zero[order])

    def quants(self) -> np.ndarray:
        """(N, K) float32 of the integer q of every weight."""
        rows = self.qs.shape[0]
        if self.bits == 8:
            return self.qs.view(np.int8).astype(np.float32)
        blocks = self.qs.reshape(rows, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        return (blocks & np.uint8(15)).reshape(rows, -1).astype(np.float32)

    def dequantize(self) -> np.ndarray:
        """(N, K) float32, as the kernel expands them (scale * q + zero, per block of 32)."""
        rows, cols = self.shape
        q = self.quants().reshape(rows, -1, BLOCK)
        return (q * self.scale[..., None] + self.zero[..., None]).reshape(rows, cols)


def read_blocks(tensor: Any) -> QuantBlocks | None:
    """A ``gguf.ReaderTensor`` of a matrix as blocks, or None for a type kept as floats."""
    type_name = tensor.tensor_type.name
    if type_name not in KEPT_GGML_TYPES or len(tensor.shape) != 2:
        return None
    rows = int(tensor.shape[1])  # GGUF lists dimensions fastest first
    raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
    return _DECODERS[type_name](raw, rows)


def concatenate_blocks(parts: list[QuantBlocks]) -> QuantBlocks | None:
    """Parts stacked along the output dimension; None when their bits or widths differ."""
    if len({(part.bits, part.shape[1]) for part in parts}) != 1:
        return None
    return QuantBlocks(parts[0].bits, *(np.concatenate([getattr(p, f) for p in parts]) for f in ("qs", "scale", "zero")))


def _half(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _q4_0(raw: np.ndarray, rows: int) -> QuantBlocks:
    blocks = raw.reshape(rows, -1, 18)  # d (f16), 16 bytes of nibbles
    d = _half(blocks[..., 0:2])
    return QuantBlocks(4, np.ascontiguousarray(blocks[..., 2:]).reshape(rows, -1), d, -8 * d)


def _q4_1(raw: np.ndarray, rows: int) -> QuantBlocks:
    blocks = raw.reshape(rows, -1, 20)  # d, m (f16), 16 bytes of nibbles
    return QuantBlocks(4, np.ascontiguousarray(blocks[..., 4:]).reshape(rows, -1), _half(blocks[..., 0:2]),
                       _half(blocks[..., 2:4]))


def _q8_0(raw: np.ndarray, rows: int) -> QuantBlocks:
    blocks = raw.reshape(rows, -1, 34)  # d (f16), 32 int8
    d = _half(blocks[..., 0:2])
    return QuantBlocks(8, np.ascontiguousarray(blocks[..., 2:]).reshape(rows, -1), d, np.zeros_like(d))


def _q4_k(raw: np.ndarray, rows: int) -> QuantBlocks:
    from gguf.quants import Q4_K

    supers = raw.reshape(-1, 144)  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    d, dmin = _half(supers[:, 0:2])[:, None], _half(supers[:, 2:4])[:, None]
    sc, m = Q4_K.get_scale_min(supers[:, 4:16])
    scale = (d * sc.astype(np.float32)).reshape(rows, -1)
    zero = -(dmin * m.astype(np.float32)).reshape(rows, -1)
    # Each 64 weights are 32 bytes: the first 32 weights in the low nibbles, the next 32 in the high.
    nibbles = supers[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (nibbles & np.uint8(15)).reshape(-1, 2, 16)  # (sub-blocks of 32, halves, 16)
    packed = q[:, 0] | (q[:, 1] << 4)  # GGUF's Q4_0 order within each sub-block
    return QuantBlocks(4, packed.reshape(rows, -1), scale, zero)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k}
