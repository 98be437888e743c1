"""GGUF weights kept quantized (``engine.weights: quantized``): the blocks are the file's exact
weights, the kernel multiplies them as the float path does, and a served model's logits stay close."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from gguf_files import write_gguf

from workers.config import CacheConfig, ConfigError, EngineConfig
from workers.engine.model.gguf_blocks import QuantBlocks, read_blocks
from workers.engine.model.gguf_dequant import dequantize, dequantize_tensor
from workers.engine.model.gguf_metadata import open_gguf
from workers.engine.model.quant_linear import DIRECT_ROWS, QuantLinear, load_quant_kernel
from workers.engine.model.tiny import make_tiny_model
from workers.engine.model_runner import ModelRunner

LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def kernel():
    built = load_quant_kernel()
    if built is None:
        pytest.skip("no C compiler: the quantized path is unavailable (tested: it refuses clearly)")
    return built


def _fake_tensor(raw: np.ndarray, type_name: str, rows: int, cols: int):
    """What ``read_blocks`` reads of a ``gguf.ReaderTensor``."""
    return types.SimpleNamespace(data=raw, tensor_type=types.SimpleNamespace(name=type_name), shape=[cols, rows],
                                 name="w")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_are_the_files_weights_bit_for_bit(type_name):
    from gguf import GGMLQuantizationType, quants

    weights = np.random.default_rng(1).standard_normal((24, 128)).astype(np.float32)
    raw = quants.quantize(weights, GGMLQuantizationType[type_name])
    blocks = read_blocks(_fake_tensor(raw, type_name, 24, 128))
    assert blocks is not None and blocks.shape == (24, 128)
    assert np.array_equal(blocks.dequantize(), dequantize(raw, type_name, (24, 128), "w"))


def test_q4_k_blocks_are_the_files_weights_bit_for_bit():
    # gguf has no Q4_K quantizer: random super-blocks with finite half-precision d and dmin.
    generator = np.random.default_rng(2)
    rows, cols = 4, 512
    raw = generator.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = np.frombuffer(generator.uniform(0.001, 0.1, rows * cols // 256 * 2).astype(np.float16).tobytes(),
                                  dtype=np.uint8).reshape(rows, cols // 256, 4)
    blocks = read_blocks(_fake_tensor(raw.reshape(rows, -1), "Q4_K", rows, cols))
    assert blocks is not None and blocks.bits == 4
    assert np.array_equal(blocks.dequantize(), dequantize(raw.reshape(rows, -1), "Q4_K", (rows, cols), "w"))


def test_q6_k_and_floats_stay_dequantized():
    for type_name in ("Q6_K", "F32", "F16"):
        assert read_blocks(_fake_tensor(np.zeros((2, 8), np.uint8), type_name, 2, 8)) is None


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 8, DIRECT_ROWS, DIRECT_ROWS + 1, 100])
def test_kernel_matches_float_matmul(kernel, bits, rows):
    # Decode-sized calls go through the kernel directly, prefills through the expanded weight.
    generator = np.random.default_rng(rows)
    out_features, in_features = 40, 96
    qs = generator.integers(0, 256, (out_features, in_features * bits // 8), dtype=np.uint8)
    scale = generator.random((out_features, in_features // 32), dtype=np.float32)
    zero = generator.standard_normal((out_features, in_features // 32), dtype=np.float32) * (bits == 4)
    blocks = QuantBlocks(bits, qs, scale, zero)
    bias = torch.randn(out_features)
    layer = QuantLinear(blocks, bias, kernel)
    x = torch.randn(rows, 3, in_features)[:, 1]  # rows with a stride: the layer copies them contiguous
    expected = x @ torch.from_numpy(blocks.dequantize()).T + bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-3)  # sums of ~100 terms up to ~100


def test_tiny_model_quantized_matches_dequantized(kernel, tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", size="test")
    types_ = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
    types_.update({f"blk.{i}.{t}.weight": ("Q4_1" if i % 2 else "Q4_0") for i in range(2) for t in LAYER_TENSORS})
    gguf_path = write_gguf(model_dir, tmp_path / "q4.gguf", types=types_)
    logits = _runner_logits(gguf_path, [list(range(3, 40, 3))])[0]
    torch.testing.assert_close(logits["quantized"], logits["dequantize"], rtol=1e-4, atol=1e-4)


def test_quantized_weights_refuse_what_they_do_not_run(tmp_path):
    with pytest.raises(ConfigError, match="engine.weights: must be dequantize or quantized"):
        EngineConfig(model="m", weights="int3").validate()
    model_dir = make_tiny_model(tmp_path / "tiny", size="test")
    gguf_path = write_gguf(model_dir, tmp_path / "f.gguf")
    with pytest.raises(ConfigError, match="engine.weights: 'quantized' runs float32 on the CPU"):
        ModelRunner(EngineConfig(model=str(gguf_path), device="cpu", dtype="bfloat16", weights="quantized"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_smollm2_quantized_logits_and_greedy_agree(kernel, smollm2_gguf):
    """The shipped Q4_1 model (Q8_0 embedding/head): every linear weight's blocks are the file's, and
    over a prompt set the teacher-forced greedy tokens agree with the float32 path at >= 99% of
    positions, logits within 0.01 (max abs; their range is ~30; measured 1e-4: the same weights, sums reordered). docs/quantization.md states these."""
    reader = open_gguf(smollm2_gguf)
    for tensor in reader.tensors[:12]:
        blocks = read_blocks(tensor)
        if blocks is not None:
            assert np.array_equal(blocks.dequantize(), dequantize_tensor(tensor)), tensor.name
    from api.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(smollm2_gguf)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of",
               "Once upon a time, in a small village,", "The three primary colors are"]
    distance, agree, total = 0.0, 0, 0
    for logits in _runner_logits(smollm2_gguf, [tokenizer.encode(prompt) for prompt in prompts]):
        distance = max(distance, (logits["quantized"] - logits["dequantize"]).abs().max().item())
        agree += int((logits["quantized"].argmax(-1) == logits["dequantize"].argmax(-1)).sum())
        total += logits["quantized"].shape[0]
    print(f"SmolLM2 Q4_1 quantized vs float32: logits max abs distance {distance:.4f}, "
          f"greedy agreement {agree}/{total}")  # the figures docs/quantization.md quotes (pytest -s)
    assert distance < 0.01, distance
    assert agree >= 0.99 * total, (agree, total)


def _runner_logits(path, prompts: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Each prompt's logits at every position under both weight modes: a prefill of half the
    prompt (two chunks), then decodes."""
    from test_model_reference import _paged_logits

    cache = CacheConfig(block_size=16, num_blocks=16)
    logits: list[dict[str, torch.Tensor]] = [{} for _ in prompts]
    for mode in ("dequantize", "quantized"):
        runner = ModelRunner(EngineConfig(model=str(path), device="cpu", cache=cache, weights=mode))
        kept = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
        assert len(kept) == (0 if mode == "dequantize" else 4 * runner.model_config.num_layers + 1)  # and lm_head
        for prompt, into in zip(prompts, logits):
            into[mode] = _paged_logits(runner, prompt, list(range(-(-len(prompt) // 16) + 1)), len(prompt) // 2)
    return logits
