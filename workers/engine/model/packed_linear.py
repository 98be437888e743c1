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

Only for float32 on the CPU, where it was measured; elsewhere ``pack_linears``
leaves the model as it is.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["PackedLinear", "can_pack", "pack_linears"]


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference, the weight held in oneDNN's layout (not a parameter)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


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
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child))
