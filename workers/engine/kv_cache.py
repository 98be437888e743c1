"""The paged KV pool: fixed-size blocks of keys and values for every layer.

One tensor holds everything, layer-major::

    storage[layer, 0 = key | 1 = value, block, slot in block, kv head, head dim]

so each layer's K and V are contiguous (num_blocks, block_size, num_kv_heads,
head_dim) tensors, which the attention gathers from every step. A block id
means the same rows in every layer; a KV transfer moves blocks as one
(n, block_size, kv heads, head_dim) frame per layer and K/V, which for a run
of consecutive blocks is a slice of the pool itself. Which blocks belong to whom is the block
manager's business; this pool only stores.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        num_elements = 1
        for dim in self.block_dims:
            num_elements *= dim
        return num_elements * torch.empty((), dtype=self.dtype).element_size()


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

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.storage[layer, 0]  # (num_blocks, block_size, kv heads, head_dim), contiguous

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.storage[layer, 1]  # (num_blocks, block_size, kv heads, head_dim), contiguous

    def export_frames(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The KV of ``block_ids`` as ``2 * num_layers`` contiguous CPU tensors of (n, BS, KVH, D):
        layer 0's keys, layer 0's values, layer 1's keys, ... (the wire layout of a KV transfer).

        Consecutive ids in a CPU pool are views of the pool itself, not copies
        (the KV transfer sends them zero-copy): they change if the blocks are
        written, which parked blocks never are. Otherwise one gather."""
        self._check_ids(block_ids)
        first = block_ids[0] if block_ids else 0
        if self.storage.device.type == "cpu" and block_ids == list(range(first, first + len(block_ids))):
            slab = self.storage[:, :, first:first + len(block_ids)]
        else:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
            slab = self.storage.index_select(2, index).cpu()  # (layers, 2, n, BS, KVH, D)
        return [slab[layer, kind] for layer in range(self.shape.num_layers) for kind in (0, 1)]

    def import_frames(self, block_ids: list[int], frames: list[torch.Tensor]) -> None:
        """Write ``frames`` (as ``export_frames`` returns them) into ``block_ids``."""
        self._check_ids(block_ids)
        shape = self.shape
        expected = (len(block_ids), shape.block_size, shape.num_kv_heads, shape.head_dim)
        if len(frames) != 2 * shape.num_layers:
            raise ValueError(f"expected {2 * shape.num_layers} frames (K and V of {shape.num_layers} layers), "
                             f"got {len(frames)}")
        for frame in frames:
            if tuple(frame.shape) != expected or frame.dtype != self.storage.dtype:
                raise ValueError(f"frames must be {expected} {self.storage.dtype}, "
                                 f"got {tuple(frame.shape)} {frame.dtype}")
        if self.storage.device.type == "cpu":
            # A plain single-threaded numpy copy: ZeroMQ's I/O thread is receiving the next chunks
            # meanwhile, and an OpenMP-parallel index_copy_ waits at its barrier for the core that
            # thread holds (10x slower on 2 cores in benchmarks/kv_transfer.py).
            rows = np.asarray(block_ids)
            for number, frame in enumerate(frames):
                layer, kind = divmod(number, 2)
                self.storage[layer, kind].view(torch.uint8).numpy()[rows] = frame.view(torch.uint8).numpy()
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        for number, frame in enumerate(frames):
            layer, kind = divmod(number, 2)
            self.storage[layer, kind].index_copy_(0, index, frame.to(self.storage.device))

    def _check_ids(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
