"""GGUF tensor data to float32 numpy arrays, for the types the engine loads.

The block formats are llama.cpp's (``ggml-quants.c``); ``gguf.quants`` holds
numpy implementations of each, used here. A tensor of another type is a
``ConfigError`` naming the tensor and its type, never silently wrong weights.
Torch-free: the loader converts to the engine's dtype afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from workers.config import ConfigError

__all__ = ["SUPPORTED_GGML_TYPES", "dequantize_tensor", "dequantize"]

# Each type here has a test against an independent implementation (tests/workers/test_gguf_dequant.py).
SUPPORTED_GGML_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """``data`` (the raw bytes or elements of one tensor) as float32 of ``shape`` (numpy order)."""
    from gguf import GGMLQuantizationType, quants

    if type_name not in SUPPORTED_GGML_TYPES:
        raise ConfigError(what, f"tensor type {type_name} is not supported; supported: {list(SUPPORTED_GGML_TYPES)}")
    qtype = GGMLQuantizationType[type_name]
    if type_name == "BF16" and data.dtype != np.uint8:
        data = data.view(np.uint8)  # gguf.quants' BF16 works on bytes
    values = quants.dequantize(data, qtype)
    # A copy: F32 data is a view of the file's read-only memory map.
    return np.array(values, dtype=np.float32).reshape(shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A ``gguf.ReaderTensor`` as float32 (out_features, in_features, ...) in numpy (row-major) order.

    GGUF lists dimensions fastest-first (``tensor.shape`` is ggml's ``ne``); numpy's order is the
    reverse, which for a weight matrix is torch's ``nn.Linear`` layout (out, in).
    """
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return dequantize(tensor.data, tensor.tensor_type.name, shape, f"{tensor.name}")
