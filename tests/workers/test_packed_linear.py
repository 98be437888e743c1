"""PackedLinear computes what nn.Linear does; pack_linears swaps only where it was measured to help."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.engine.model.packed_linear import PackedLinear, can_pack, pack_linears

needs_onednn = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [0, 1, 32, 300])
def test_packed_linear_matches_linear(bias: bool, num_rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(num_rows, 96)
    with torch.inference_mode():
        expected = linear(x)
        packed = PackedLinear(linear)(x)
    assert packed.shape == (num_rows, 160)
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_pack_linears_replaces_every_linear_and_keeps_shared_weights() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": nn.Embedding(50, 16), "head": nn.Linear(16, 50, bias=False)})
    model["inner"] = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model["head"].weight = model["embed"].weight  # tied, as lm_head may be
    x = torch.randn(4, 16)
    with torch.inference_mode():
        expected = model["head"](model["inner"](x))
    pack_linears(model)
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert model["embed"].weight.shape == (50, 16)  # the embedding keeps its (shared) weight
    with torch.inference_mode():
        torch.testing.assert_close(model["head"](model["inner"](x)), expected, rtol=1e-5, atol=1e-5)


def test_only_float32_on_the_cpu_is_packed() -> None:
    assert not can_pack(torch.device("cpu"), torch.bfloat16)
    assert not can_pack(torch.device("meta"), torch.float32)
