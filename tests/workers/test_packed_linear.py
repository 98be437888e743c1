"""PackedLinear computes what nn.Linear does; pack_linears swaps only where it was measured to help;
row counts padded to a few buckets change no output row."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.config import CacheConfig, EngineConfig
from workers.engine.executor import ScheduledRequest, SchedulerOutput
from workers.engine.model import packed_linear
from workers.engine.model.packed_linear import (
    EXACT_ROWS,
    BucketedLinear,
    PackedLinear,
    can_pack,
    pack_linears,
    padded_rows,
    prepare_linears,
)
from workers.engine.model.tiny import make_tiny_model
from workers.engine.model_runner import ModelRunner
from workers.sampling_params import SamplingParams

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


def test_padded_rows_are_few_buckets_at_most_an_eighth_larger() -> None:
    buckets = [padded_rows(rows) for rows in range(1, 1025)]
    assert buckets[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))  # small decode steps as they are
    assert all(rows <= padded < rows * 9 / 8 + 1 for rows, padded in enumerate(buckets, start=1))
    assert all(padded_rows(padded) == padded for padded in buckets)  # a bucket is its own bucket
    assert buckets == sorted(buckets)
    # 16 exact, then 8 a doubling up to 1,024: the shapes oneDNN compiles and caches per weight
    assert len(set(buckets)) == EXACT_ROWS + 8 * 6
    assert (padded_rows(17), padded_rows(33), padded_rows(513), padded_rows(1024)) == (18, 36, 576, 1024)


@needs_onednn
@pytest.mark.parametrize("kind, dtype", [(PackedLinear, torch.float32), (BucketedLinear, torch.bfloat16)])
@pytest.mark.parametrize("num_rows", [17, 41, 300, 1000])
def test_padding_changes_no_row(kind, dtype: torch.dtype, num_rows: int) -> None:
    """The padded call's rows are, bit for bit, the unpadded call's; leading dimensions are kept."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 160).to(dtype)
    bucketed = kind(linear)
    assert padded_rows(num_rows) != num_rows
    x = torch.randn(num_rows, 96, dtype=dtype)
    with torch.inference_mode():
        out = bucketed(x)
        assert torch.equal(out, bucketed._linear(x))
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, linear(x), rtol=tolerance, atol=tolerance)
        assert bucketed(x.reshape(1, num_rows, 96)).shape == (1, num_rows, 160)


@needs_onednn
def test_prepare_linears_by_dtype() -> None:
    cpu = torch.device("cpu")
    for dtype, kind in ((torch.float32, PackedLinear), (torch.bfloat16, BucketedLinear), (torch.float16, nn.Linear)):
        model = nn.Sequential(nn.Linear(8, 8).to(dtype))
        prepare_linears(model, cpu, dtype)
        assert type(model[0]) is kind


@needs_onednn
def test_a_model_step_is_the_same_padded_or_not(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole step's logits (a 37-token prefill beside a 21-token one: 58 rows, padded to 60) are
    identical with the buckets and without them, so greedy tokens are too."""
    runner = ModelRunner(EngineConfig(model=str(make_tiny_model(tmp_path / "tiny")), device="cpu",
                                      cache=CacheConfig(block_size=4, num_blocks=32)))
    assert isinstance(runner.model.lm_head, PackedLinear)
    greedy = SamplingParams(temperature=0.0)
    prompts = [[(7 * i + 3) % 500 + 5 for i in range(37)], [(11 * i + 1) % 500 + 5 for i in range(21)]]
    batch = SchedulerOutput([ScheduledRequest(1, prompts[0], 0, list(range(10)), True, greedy, 0),
                             ScheduledRequest(2, prompts[1], 0, list(range(10, 16)), True, greedy, 0)],
                            num_prefill_tokens=58)
    assert padded_rows(58) == 60
    bucketed = runner.compute_logits(batch)
    monkeypatch.setattr(packed_linear, "padded_rows", lambda rows: rows)
    assert torch.equal(runner.compute_logits(batch), bucketed)
