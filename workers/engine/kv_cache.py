"""The paged KV pool: fixed-size blocks of keys and values for every layer.

One tensor holds everything, layer-major::

    storage[layer, 0 = key | 1 = value, block, slot in block, kv head, head dim]

so each layer's K and V are contiguous (num_blocks, block_size, num_kv_heads,
head_dim) tensors, which the attention gathers from every step. A block id
means the same rows in every layer; exporting gathers a block's rows of all
layers into one contiguous (layers, 2, block_size, kv heads, head_dim) slab,
the wire layout of a KV transfer. Which blocks belong to whom is the block
manager's business; this pool only stores.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """KV of ``block_ids`` as one contiguous CPU tensor (n, layers, 2, block_size, kv heads, head_dim)."""
        self._check_ids(block_ids)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        blocks = self.storage.index_select(2, index)  # (layers, 2, n, BS, KVH, D)
        # Reordered on the device, then one transfer.
        return blocks.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()  # (n, layers, 2, BS, KVH, D)

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write ``blocks`` (as ``export_blocks`` returns them) into ``block_ids``."""
        self._check_ids(block_ids)
        expected = (len(block_ids), *self.shape.block_dims)
        if tuple(blocks.shape) != expected or blocks.dtype != self.storage.dtype:
            got = f"{tuple(blocks.shape)} {blocks.dtype}"
            raise ValueError(f"blocks must be {expected} {self.storage.dtype}, got {got}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.storage.device)
        layer_major = blocks.to(self.storage.device).permute(1, 2, 0, 3, 4, 5)  # (layers, 2, n, BS, KVH, D)
        self.storage.index_copy_(2, index, layer_major)

    def _check_ids(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
