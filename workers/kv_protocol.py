"""Wire types of the engine <-> engine boundary: KV transfer (DESIGN.md §6).

The gen engine's DEALER talks to the ctx engine's ROUTER over TCP::

    gen -> ctx   [mac, KVPullRequest]            pull blocks [first_block, first_block + num_blocks)
    ctx -> gen   [mac, KVBlock, raw block] ...   one message per block, pipelined, zero-copy
    ctx -> gen   [mac, KVDone] | [mac, KVError]
    gen -> ctx   [mac, KVAck]                    the ctx engine frees the parked blocks

``mac`` is the HMAC-SHA256 under the cluster key of the header and, for a
block, of its raw bytes: a message whose MAC does not check is dropped,
counted and never decoded, and a block is never written into the KV cache
unauthenticated. Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any

import msgspec
import zmq

__all__ = [
    "KV_TRANSFER_ERROR",
    "KVPullRequest",
    "KVAck",
    "KVRequestMessage",
    "KVBlock",
    "KVDone",
    "KVError",
    "KVReplyMessage",
    "KVFrameCodec",
]

log = logging.getLogger(__name__)

# Prefix of the ``RequestOutput.error`` of a gen request whose pull failed (frontends map it to a 502).
KV_TRANSFER_ERROR = "kv transfer failed"


class KVPullRequest(msgspec.Struct, frozen=True, array_like=True, tag="pull"):
    pull_id: int  # the gen engine's request id: replies name it
    ctx_request_id: int
    first_block: int
    num_blocks: int


class KVAck(msgspec.Struct, frozen=True, array_like=True, tag="ack"):
    """Release the parked blocks: the transfer completed, or the gen request was aborted."""

    pull_id: int
    ctx_request_id: int
    completed: bool


KVRequestMessage = KVPullRequest | KVAck


class KVBlock(msgspec.Struct, frozen=True, array_like=True, tag="block"):
    """Header of one block; the block's raw bytes are the next frame."""

    pull_id: int
    index: int  # 0 = the pull's first_block


class KVDone(msgspec.Struct, frozen=True, array_like=True, tag="done"):
    pull_id: int
    num_blocks: int


class KVError(msgspec.Struct, frozen=True, array_like=True, tag="error"):
    pull_id: int
    error: str


KVReplyMessage = KVBlock | KVDone | KVError


class KVFrameCodec:
    """``[mac, header(, block)]`` messages; the MAC covers the header and the block bytes."""

    def __init__(self, key: bytes, decode_type: Any, name: str) -> None:
        if len(key) < 16:
            raise ValueError(f"the cluster key must be at least 16 bytes, got {len(key)}")
        self._key = key
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self.name = name
        self.num_rejected = 0

    def _mac(self, header: bytes | memoryview, block: Any = None) -> bytes:
        mac = hmac.new(self._key, header, hashlib.sha256)
        if block is not None:
            mac.update(block)
        return mac.digest()

    def encode(self, message: Any, block: Any = None) -> list[Any]:
        """Frames to send; ``block`` (a buffer) travels as its own frame, not copied here."""
        header = self._encoder.encode(message)
        frames: list[Any] = [self._mac(header, block), header]
        if block is not None:
            frames.append(block)
        return frames

    def decode(self, frames: list[zmq.Frame]) -> tuple[Any, memoryview | None] | None:
        """(message, block buffer or None), or None when the message was dropped."""
        if len(frames) not in (2, 3):
            return self._reject(f"{len(frames)} frames")
        mac, header = frames[0].bytes, frames[1].buffer
        block = frames[2].buffer if len(frames) == 3 else None
        if not hmac.compare_digest(mac, self._mac(header, block)):
            return self._reject("HMAC check failed")
        try:
            message = self._decoder.decode(header)
        except msgspec.DecodeError as exc:
            return self._reject(f"undecodable header: {exc}")
        return message, block

    def _reject(self, why: str) -> None:
        self.num_rejected += 1
        if self.num_rejected <= 10 or self.num_rejected % 1000 == 0:
            log.warning("%s: dropped a message (%s); %d rejected so far", self.name, why, self.num_rejected)
        return None
