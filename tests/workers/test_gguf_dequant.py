"""Each GGUF tensor type the loader claims, on synthetic data, against an independent implementation:
transformers' torch dequantizer for the block formats, numpy bit arithmetic for the float types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workers.config import ConfigError
from workers.engine.model.gguf_dequant import SUPPORTED_GGML_TYPES, dequantize

ROWS, COLS = 6, 512  # two super-blocks of 256 per row: every K-quant field is exercised


def random_blocks(type_name: str, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes whose float16 scales are finite (random bits may spell inf/NaN)."""
    block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(ROWS * COLS // block_elements, block_bytes), dtype=np.uint8)
    scale_offsets = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [block_bytes - 2]}
    for offset in scale_offsets[type_name]:
        scales = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_block_formats_match_transformers(type_name):
    from transformers.integrations.gguf.dequant import dequantize as reference

    data = random_blocks(type_name, np.random.default_rng(len(type_name)))
    ours = dequantize(data, type_name, (ROWS, COLS), "t")
    expected = reference(torch.from_numpy(data.copy()), int(GGMLQuantizationType[type_name]), torch.float32)
    assert ours.shape == (ROWS, COLS) and ours.dtype == np.float32
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0
    np.testing.assert_allclose(ours, expected.reshape(ROWS, COLS).numpy(), rtol=1e-6, atol=1e-7)


def test_float_types():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(values.copy(), "F32", (ROWS, COLS), "t"), values)
    half = values.astype(np.float16)
    np.testing.assert_array_equal(dequantize(half, "F16", (ROWS, COLS), "t"), half.astype(np.float32))
    # bfloat16: the top 16 bits of a float32, stored as bytes in the file.
    bf16_bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    expected = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(dequantize(bf16_bits.view(np.uint8), "BF16", (ROWS, COLS), "t"), expected)


def test_supported_types_are_the_tested_ones():
    assert set(SUPPORTED_GGML_TYPES) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


def test_unsupported_type_names_the_tensor_and_type():
    with pytest.raises(ConfigError) as info:
        dequantize(np.zeros((1, 110), np.uint8), "Q3_K", (1, 256), "blk.3.ffn_up.weight")
    assert info.value.key == "blk.3.ffn_up.weight" and "Q3_K" in str(info.value)
