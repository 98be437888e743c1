"""Linear layers of a float32 CPU model on oneDNN, their weights reordered once at load.

``F.linear`` on the CPU runs MKL's sgemm on the plain (out, in) weight.
oneDNN, given the weight already in its own blocked layout, skips that
per-call work and picks its kernels by the CPU's instruction set. Measured
on the bench model (2-core AMD EPYC, torch 2.13, float32): the 32-row decode
projections 20-40% faster, the 2048-row prefill ones 10-15%; an engine
decode step of 32 requests 10.2 -> 8.5 ms. The arithmetic is float32 either
way; only the summation order differs (about 1e-6 relative).

The instruction set matters more than the layout: MKL takes its AVX2 path
on AMD CPUs even where they have AVX-512, while oneDNN uses AVX-512, so on an
AVX-512 EPYC oneDNN runs these shapes 1.5-2.4x faster than ``F.linear`` and
on an AVX2-only one (emulated: ``ONEDNN_MAX_CPU_ISA=AVX2``) 1.0-1.25x, at
32 rows and more. At one row (a lone decode) oneDNN's fixed cost per call
(~8 us) makes it the slower of the two at either width (one thread, weights
of 256..2048 x 256..688).

Only for float32 on the CPU, where it was measured; bfloat16 on the CPU keeps its
weights as they are (``BucketedLinear``); elsewhere the model is left as it is.

Row counts are bucketed (``padded_rows``). oneDNN compiles a kernel (a
"primitive") per input shape and keeps it in two caches keyed by shape, each
of up to 1,024 entries: oneDNN's own primitive cache and ideep's cache of
torch's ops over it. A step's row count is its token count, which follows
every prompt's length, so each new length made a new entry per weight shape,
~0.5 MB each: a ctx engine serving SmolLM2-135M grew ~2.5 MB a request, until
the caches were full (~500 MB on). Dropping the caches is no fix: building the
primitive on every call costs ~1-2 ms, more than a decode step's matmul.
Zero rows padded up to a bucket (eight a doubling, so at most 1/8 more rows
computed) keep the shapes to a few dozen per weight, all cached: memory stays
flat and no call compiles once they are warm. A row's output does not depend on
the rows beside it, so the padding changes nothing of the real rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedLinear", "BucketedLinear", "can_pack", "pack_linears", "bucket_linears", "prepare_linears",
           "padded_rows", "EXACT_ROWS"]

EXACT_ROWS = 16
"""Up to this many rows (decode steps of a few requests) the shape is used as it is: padding a
1-row call to 2 would double its work, and there are only this many such shapes."""


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to the next bucket: exact up to ``EXACT_ROWS``, then eight buckets a
    doubling (17..32 by 2, 33..64 by 4, ..., 513..1024 by 64), so at most 1/8 more rows."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class _RowBucketedLinear(nn.Module):
    """An inference linear layer that runs its product on ``padded_rows`` rows."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        padded = padded_rows(rows)
        if padded == rows:
            return self._linear(x)
        flat = x.reshape(rows, self.in_features)
        out = self._linear(torch.cat((flat, flat.new_zeros(padded - rows, self.in_features))))
        return out[:rows].reshape(*x.shape[:-1], self.out_features)  # the leading rows: still contiguous

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PackedLinear(_RowBucketedLinear):
    """``nn.Linear`` for inference, the weight held in oneDNN's layout (not a parameter)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class BucketedLinear(_RowBucketedLinear):
    """``nn.Linear`` for inference on bfloat16 CPU weights, which ``F.linear`` runs on oneDNN too
    (not packed: that was measured for float32 only), so its row counts are bucketed as well."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach()  # the same storage: a tied lm_head stays tied
        self.bias = None if linear.bias is None else linear.bias.detach()

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and _onednn_linear_works()


@functools.cache
def _onednn_linear_works() -> bool:
    """The ops are private: a torch without them, or with other signatures, keeps ``nn.Linear``."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe, x = nn.Linear(8, 4), torch.randn(3, 8)
        with torch.inference_mode():
            return torch.allclose(PackedLinear(probe)(x), probe(x), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError, TypeError):
        return False


def pack_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` of ``model`` with a ``PackedLinear``, in place.

    The replaced weights are freed unless shared: a tied ``lm_head`` keeps
    the embedding, and its packed copy costs one more vocab x hidden matrix.
    """
    _replace_linears(model, PackedLinear)


def bucket_linears(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` of ``model`` with a ``BucketedLinear`` (same weights), in place."""
    _replace_linears(model, BucketedLinear)


def prepare_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """The model's linear layers for inference on ``device``: packed (float32 CPU), row-bucketed
    (bfloat16 CPU, on oneDNN as well), or as they are (a GPU; float16 on the CPU, not on oneDNN)."""
    if can_pack(device, dtype):
        pack_linears(model)
    elif device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        bucket_linears(model)


def _replace_linears(model: nn.Module, kind: type[_RowBucketedLinear]) -> None:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, kind(child))
