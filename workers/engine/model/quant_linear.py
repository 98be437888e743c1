"""Linear layers over GGUF's quantized blocks (``engine.weights: quantized``), float32 CPU.

A decode step reads every weight once per token: SmolLM2-135M's float32
weights are ~540 MB a token, its Q4_1/Q8_0 blocks ~100 MB. ``QuantLinear``
keeps the blocks (``gguf_blocks``) and multiplies them in ``quant_matmul.c``,
which expands each block of 32 to floats in registers: activations stay
float32 (no 8-bit activation rounding), so the only difference from the
dequantize-at-load path is the order of the sums.

Up to ``DIRECT_ROWS`` rows (decodes) go straight through the kernel. A
prefill's hundreds of rows are compute-bound, where a blocked float GEMM is
faster than expanding blocks per tile of rows: the weight is expanded to a
float32 scratch for that call (written and read once, small beside the
GEMM's work) and multiplied by oneDNN (on a plain weight it ran as fast as on
a prepacked one, 1.3-1.5x ``F.linear``'s MKL: 256 x 576 -> 3072, one thread,
AMD EPYC), its row counts bucketed (``packed_linear.padded_rows``) so its
per-shape kernel caches stay bounded, as ``packed_linear`` explains.

The kernel is built like ``paged_decode.c`` (``native_attention.build_library``)
and probed against the float path; when it cannot be built the model keeps
its dequantized weights and the engine logs why.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.model.gguf_blocks import QuantBlocks
from workers.engine.model.packed_linear import can_pack, padded_rows
from workers.engine.native_attention import build_library

__all__ = ["DIRECT_ROWS", "QuantKernel", "QuantLinear", "load_quant_kernel"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quant_matmul.c")
DIRECT_ROWS = 16
"""Up to this many rows the kernel multiplies the blocks directly; more are a prefill (see above)."""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class QuantKernel:
    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._matmul = library.quant_matmul
        self._matmul.argtypes = (_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64)
        self._matmul.restype = None
        self._dequantize = library.quant_dequantize
        self._dequantize.argtypes = (_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR)
        self._dequantize.restype = None

    def matmul(self, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        """(M, K) contiguous float32 -> (M, N)."""
        out = x.new_empty(x.shape[0], layer.out_features)
        self._matmul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), layer.qs.data_ptr(),
                     layer.scale.data_ptr(), layer.zero.data_ptr(), layer.bits, x.shape[0], layer.out_features,
                     layer.in_features)
        return out

    def dequantize(self, layer: QuantLinear) -> torch.Tensor:
        out = torch.empty(layer.out_features, layer.in_features)
        self._dequantize(layer.qs.data_ptr(), layer.scale.data_ptr(), layer.zero.data_ptr(), layer.bits,
                         layer.out_features, layer.in_features, out.data_ptr())
        return out


class QuantLinear(nn.Module):
    """``nn.Linear`` for inference whose weight is GGUF blocks (float32 activations, CPU)."""

    def __init__(self, blocks: QuantBlocks, bias: torch.Tensor | None, kernel: QuantKernel) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.bits = blocks.bits
        self.qs = torch.from_numpy(np.ascontiguousarray(blocks.qs))
        self.scale = torch.from_numpy(np.ascontiguousarray(blocks.scale, dtype=np.float32))
        self.zero = torch.from_numpy(np.ascontiguousarray(blocks.zero, dtype=np.float32))
        self.bias = bias
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if flat.shape[0] <= DIRECT_ROWS:
            out = self._kernel.matmul(flat, self)
            if self.bias is not None:
                out += self.bias
        else:
            out = _prefill_linear(flat, self._kernel.dequantize(self), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def _prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not can_pack(x.device, x.dtype):  # no usable oneDNN: MKL
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:  # zero rows: the real rows' outputs do not depend on them
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


@functools.cache
def load_quant_kernel() -> QuantKernel | None:
    """The kernel, built if needed; None (logged) when it cannot be built or fails its probe."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc or gcc) on PATH: GGUF weights are dequantized at load")
        return None
    try:
        path = build_library(compiler, SOURCE)
        kernel = QuantKernel(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("quantized matmul kernel unavailable (%s): GGUF weights are dequantized at load", exc)
        return None
    if not _probe(kernel):
        log.warning("quantized matmul kernel disagrees with the float path on its probe: not used")
        return None
    return kernel


def _probe(kernel: QuantKernel) -> bool:
    """4- and 8-bit blocks at 1, 3, 9 (a full tile and one more) and 40 rows against float matmul."""
    generator = np.random.default_rng(0)
    rows, cols = 20, 96
    for bits, qs in ((4, generator.integers(0, 256, (rows, cols // 2), dtype=np.uint8)),
                     (8, generator.integers(0, 256, (rows, cols), dtype=np.uint8))):
        zero = generator.standard_normal((rows, cols // 32), dtype=np.float32) * (bits == 4)  # Q8_0 has none
        blocks = QuantBlocks(bits, qs, generator.random((rows, cols // 32), dtype=np.float32), zero)
        layer = QuantLinear(blocks, None, kernel)
        weight = torch.from_numpy(blocks.dequantize())
        for m in (1, 3, 9, 40):
            x = torch.from_numpy(generator.standard_normal((m, cols), dtype=np.float32))
            if not torch.allclose(layer(x), x @ weight.T, rtol=1e-4, atol=1e-4):
                return False
    return True
