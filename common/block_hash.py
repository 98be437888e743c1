"""Chained block hashes: the wire format of prefix caching.

A block hash names the KV of one *full* block together with everything before
it: ``hash(block i) = H(seed, hash(block i-1), tokens of block i)``. Every
worker and the orchestrator's router call these functions with the same
``CacheConfig.hash_seed`` and so agree on the hash of a prefix without
talking to each other.

Encoding (stable across processes, machines and Python versions; never
Python's ``hash()``): BLAKE2b with an 8-byte digest and the personalisation
``disagg-blockv1`` over

    seed          8 bytes, unsigned little-endian
    has_parent    1 byte (0 or 1)
    parent        8 bytes, unsigned little-endian (zeros when no parent)
    num_tokens    4 bytes, unsigned little-endian
    token ids     4 bytes each, unsigned little-endian

and the digest read as an unsigned little-endian 64-bit integer.

Collision policy: a 64-bit hash can collide. The block manager therefore
treats a hash match as a *candidate* and also compares the block's token ids
and its parent hash; a collision costs a cache miss, never wrong KV. The
router only uses hashes to estimate overlap, where a rare collision costs a
slightly worse routing choice.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

__all__ = ["BlockHash", "hash_block_tokens", "compute_block_hashes"]

BlockHash = NewType("BlockHash", int)
"""An unsigned 64-bit chained hash of a full block and its prefix."""

_PERSON = b"disagg-blockv1"
_MAX_SEED = 2**64
# What one hash costs is mostly its setup (at 16 tokens a block: 1.6 us, 0.7 us without): the
# BLAKE2b state with the personalisation is built once and copied, the header's and the common
# block sizes' struct formats compiled once.
_BLAKE2B = hashlib.blake2b(digest_size=8, person=_PERSON)
_HEADER = struct.Struct("<QBQI")
_BODIES: dict[int, struct.Struct] = {}
_MAX_BODIES = 64  # distinct token counts kept compiled (a pool has one block size)
# A whole prompt's ids packed at once (compute_block_hashes): 4-byte unsigned, little-endian.
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], seed: int) -> BlockHash:
    """The hash of one block whose predecessor hashes to ``parent`` (None for the first)."""
    if not 0 <= seed < _MAX_SEED:
        raise ValueError(f"hash seed must be in [0, 2**64), got {seed}")
    num_tokens = len(token_ids)
    body = _BODIES.get(num_tokens)
    if body is None:
        body = struct.Struct(f"<{num_tokens}I")
        if len(_BODIES) < _MAX_BODIES:
            _BODIES[num_tokens] = body
    state = _BLAKE2B.copy()
    state.update(_HEADER.pack(seed, parent is not None, parent or 0, num_tokens))
    try:
        state.update(body.pack(*token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    return BlockHash(int.from_bytes(state.digest(), "little"))


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: int,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``; a trailing partial block has none.

    ``parent`` continues an existing chain (``token_ids`` then start at a block boundary).
    The same hashes as ``hash_block_tokens`` block after block, at about 0.7 us a block instead
    of 1.1 (a 32,000-token prompt the orchestrator routes: 1.4 ms instead of 2.2): the ids are
    packed once, and each block's header after the first is three fixed pieces.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0 <= seed < _MAX_SEED:
        raise ValueError(f"hash seed must be in [0, 2**64), got {seed}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    try:
        packed = array(_UINT32, token_ids[: num_blocks * block_size])
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    body = memoryview(packed).cast("B")
    step = 4 * block_size
    with_parent = struct.pack("<QB", seed, 1)  # the header is seed, has_parent, parent, num_tokens
    num_tokens = struct.pack("<I", block_size)
    copy, from_bytes = _BLAKE2B.copy, int.from_bytes
    hashes: list[BlockHash] = []
    for start in range(0, num_blocks * step, step):
        state = copy()
        if parent is None:
            state.update(_HEADER.pack(seed, False, 0, block_size))
        else:
            state.update(with_parent)
            state.update(parent.to_bytes(8, "little"))
            state.update(num_tokens)
        state.update(body[start : start + step])
        parent = BlockHash(from_bytes(state.digest(), "little"))
        hashes.append(parent)
    return hashes
