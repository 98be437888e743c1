"""The paged KV pool: fixed-size blocks of keys and values for every layer.

One tensor holds everything, layer-major::

    storage[layer, 0 = key | 1 = value, block, slot in block, kv head, head dim]

so each layer's K and V are contiguous (num_blocks, block_size, num_kv_heads,
head_dim) tensors, which the attention reads every step. A block id
means the same rows in every layer; a KV transfer moves blocks as one
(n, block_size, kv heads, head_dim) byte frame per layer and K/V, which for a
run of consecutive blocks is a slice of the pool itself. Which blocks belong to whom is the block
manager's business; this pool only stores.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.config import CacheConfig, ConfigError

__all__ = ["KVCache", "KVCacheShape", "num_blocks_for"]


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_dims(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: (layers, 2, block_size, kv heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_dims) * self.dtype.itemsize


def num_blocks_for(cache: CacheConfig, shape: KVCacheShape) -> int:
    """``cache.num_blocks``, or as many blocks as fit in ``cache.memory_bytes``."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    num_blocks = cache.memory_bytes // shape.bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            "engine.cache.memory_bytes",
            f"{cache.memory_bytes} bytes hold no block; one block needs {shape.bytes_per_block}",
        )
    return num_blocks


class KVCache:
    def __init__(self, shape: KVCacheShape, num_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = shape.block_size
        # Zeros, not empty: padded attention reads masked slots, and 0 * NaN
        # from uninitialised memory would poison the softmax output.
        dims = (shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.storage = torch.zeros(dims, dtype=shape.dtype, device=device)
        self._frames = [(layer, kind) for layer in range(shape.num_layers) for kind in (0, 1)]  # wire order
        # A CPU pool's bytes as numpy arrays, (layers, 2, blocks, BS, KVH, D * itemsize) and
        # (layers, 2, blocks, bytes per block): the transfer copies with numpy, never torch.
        self._host = self.storage.view(torch.uint8).numpy() if self.storage.device.type == "cpu" else None
        self._host_rows = None if self._host is None else self._host.reshape(*dims[:3], -1)

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.storage[layer, 0]  # (num_blocks, block_size, kv heads, head_dim), contiguous

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.storage[layer, 1]  # (num_blocks, block_size, kv heads, head_dim), contiguous

    def export_buffers(self, block_ids: list[int]) -> list[memoryview]:
        """The KV of ``block_ids`` as ``2 * num_layers`` contiguous byte buffers of
        (n, BS, KVH, D) elements each: layer 0's keys, layer 0's values, layer 1's
        keys, ... (the wire layout of a KV transfer).

        Consecutive ids in a CPU pool are views of the pool itself, not copies
        (the KV transfer sends them zero-copy): they change if the blocks are
        written, which parked blocks never are. Otherwise one gather per buffer."""
        self._check_ids(block_ids)
        if self._host is None:  # a device pool: one gather, copied to the host
            index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
            slab = self.storage.index_select(2, index).cpu().view(torch.uint8).numpy()  # (layers, 2, n, ...)
            return [memoryview(slab[layer, kind]) for layer, kind in self._frames]
        span = _as_slice(block_ids)
        if span is not None and span.step is None:  # ascending: a contiguous slice of every layer's K and V
            # numpy's stub gives ndarray __buffer__ only for Python >= 3.12; 3.11's buffer protocol is the same.
            return [memoryview(self._host[layer, kind, span])  # type: ignore[arg-type]  # numpy stub, see above
                    for layer, kind in self._frames]
        # numpy's single-threaded take, not torch's index_select: that runs on torch's OpenMP
        # threads, which then spin-wait on the cores ZeroMQ's I/O threads need for the wire.
        rows = np.asarray(block_ids)
        return [memoryview(self._host[layer, kind].take(rows, axis=0)) for layer, kind in self._frames]

    def import_buffers(self, block_ids: list[int], buffers: list[Any]) -> None:
        """Write ``buffers`` (as ``export_buffers`` of an identical pool returns them) into ``block_ids``."""
        self._check_ids(block_ids)
        if len(buffers) != len(self._frames):
            raise ValueError(f"expected {len(self._frames)} frames (K and V of {self.shape.num_layers} layers), "
                             f"got {len(buffers)}")
        expected = len(block_ids) * self.shape.bytes_per_block // len(self._frames)
        frames = []
        for buffer in buffers:
            frame = np.frombuffer(buffer, dtype=np.uint8)
            if frame.nbytes != expected:
                raise ValueError(f"a frame of {frame.nbytes} bytes for {len(block_ids)} blocks, expected {expected}")
            frames.append(frame.reshape(len(block_ids), -1))  # (n, bytes per block of one layer's K or V)
        if self._host_rows is None:  # a device pool (no host view)
            self._import_on_device(block_ids, frames)
            return
        # Plain single-threaded copies: ZeroMQ's I/O thread is receiving the next chunks meanwhile,
        # and an OpenMP-parallel index_copy_ waits at its barrier for the core that thread holds.
        rows = _as_slice(block_ids) or np.asarray(block_ids)
        for (layer, kind), frame in zip(self._frames, frames):
            self._host_rows[layer, kind][rows] = frame

    def export_heads(self, block_ids: list[int], heads: range) -> list[np.ndarray]:
        """``export_buffers`` of KV heads ``heads`` (this pool's indices) only: 2 * num_layers
        contiguous (n, BS, len(heads), D) copies, for a peer whose ranks split the heads otherwise."""
        self._check_ids(block_ids)
        if heads == range(self.shape.num_kv_heads):
            return [np.array(frame, copy=True) for frame in self.export_buffers(block_ids)]
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        slab = self.storage.index_select(2, index)[:, :, :, :, heads.start:heads.stop].contiguous()
        host = slab.cpu().view(torch.uint8).numpy()  # (layers, 2, n, BS, heads, D * itemsize)
        return [host[layer, kind] for layer, kind in self._frames]

    def import_heads(self, block_ids: list[int], heads: range, buffers: list[Any]) -> None:
        """Write ``export_heads`` frames of ``len(heads)`` heads into KV heads ``heads`` of ``block_ids``."""
        self._check_ids(block_ids)
        if len(buffers) != len(self._frames):
            raise ValueError(f"expected {len(self._frames)} frames, got {len(buffers)}")
        dims = (len(block_ids), self.block_size, len(heads), self.shape.head_dim)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        with warnings.catch_warnings():  # received frames are read-only; they are only read here
            warnings.simplefilter("ignore", UserWarning)
            for (layer, kind), buffer in zip(self._frames, buffers):
                frame = np.frombuffer(buffer, dtype=np.uint8)
                if frame.nbytes != math.prod(dims) * self.shape.dtype.itemsize:
                    raise ValueError(f"a frame of {frame.nbytes} bytes for {len(block_ids)} blocks of "
                                     f"{len(heads)} heads")
                values = torch.from_numpy(frame).view(self.storage.dtype).view(dims).to(self.storage.device)
                target = self.storage[layer, kind]  # (blocks, BS, KVH, D)
                target[:, :, heads.start:heads.stop].index_copy_(0, index, values)

    def _import_on_device(self, block_ids: list[int], frames: list[np.ndarray]) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        block_dims = (len(block_ids), self.block_size, self.shape.num_kv_heads, self.shape.head_dim)
        with warnings.catch_warnings():  # received frames are read-only; they are only read here
            warnings.simplefilter("ignore", UserWarning)
            for (layer, kind), frame in zip(self._frames, frames):
                values = torch.from_numpy(frame).view(self.storage.dtype).view(block_dims)
                self.storage[layer, kind].index_copy_(0, index, values.to(self.storage.device))

    def _check_ids(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")


def _as_slice(block_ids: list[int]) -> slice | None:
    """``block_ids`` as a slice of the pool when they run consecutively up or down (a copy, not a scatter)."""
    if not block_ids:
        return None
    first, count = block_ids[0], len(block_ids)
    if block_ids == list(range(first, first + count)):
        return slice(first, first + count)
    if block_ids == list(range(first, first - count, -1)):
        return slice(first, first - count if first - count >= 0 else None, -1)
    return None
