"""Wire types of the engine <-> engine boundary: KV transfer (docs/architecture.md, "A request's path").

The gen engine's DEALER talks to the ctx engine's ROUTER over TCP::

    gen -> ctx   [auth, KVPullRequest]               pull blocks [first_block, first_block + num_blocks)
    ctx -> gen   [auth, KVBlocks, frame, ...] ...     a chunk of blocks per message, pipelined, zero-copy
    ctx -> gen   [auth, KVDone] | [auth, KVError]
    gen -> ctx   [auth, KVAck]                       the ctx engine frees the parked blocks

A chunk's frames are the executor's wire layout of those blocks (for the
torch engine, one contiguous slab per layer and K/V: see
``KVCache.export_buffers``); only an identical model on the other side
imports them. ``auth`` authenticates the header and every frame under the
cluster key (``workers.kv_codec``): a message that fails it is dropped,
counted and never decoded, and no block is written into the KV cache
unauthenticated. Torch-free.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "KVPullRequest",
    "KVAck",
    "KVRequestMessage",
    "KVBlocks",
    "KVDone",
    "KVError",
    "KVReplyMessage",
]


class KVPullRequest(msgspec.Struct, frozen=True, array_like=True, tag="pull"):
    pull_id: int  # the gen engine's request id: replies name it
    ctx_request_id: int
    first_block: int
    num_blocks: int
    # Only KV heads [kv_heads_start, kv_heads_stop) of the serving rank (its own indices), for a
    # gen rank that splits the heads otherwise (``workers.kv_layout``); 0, 0: all of them.
    kv_heads_start: int = 0
    kv_heads_stop: int = 0


class KVAck(msgspec.Struct, frozen=True, array_like=True, tag="ack"):
    """Release the parked blocks: the transfer completed, or the gen request was aborted."""

    pull_id: int
    ctx_request_id: int
    completed: bool


KVRequestMessage = KVPullRequest | KVAck


class KVBlocks(msgspec.Struct, frozen=True, array_like=True, tag="blocks"):
    """Header of a chunk of consecutive blocks of a pull; their frames follow it.

    ``descending``: the frames hold the chunk's blocks last first. The ctx
    engine frees a table tail first, so a later table often holds a run of
    descending block ids; sent in memory order, that run is a view of its
    pool (no gather), and the gen side writes it back to front.
    """

    pull_id: int
    index: int  # of the chunk's first block: 0 = the pull's first_block
    num_blocks: int
    descending: bool = False


class KVDone(msgspec.Struct, frozen=True, array_like=True, tag="done"):
    pull_id: int
    num_blocks: int


class KVError(msgspec.Struct, frozen=True, array_like=True, tag="error"):
    pull_id: int
    error: str


KVReplyMessage = KVBlocks | KVDone | KVError
