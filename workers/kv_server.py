"""The ctx side of KV transfer, on a thread of its own: pulls are answered while the engine runs a step.

The engine loop used to serve pulls between steps (``KVTransferAgent.tick``), so a pull that
arrived while the ctx engine prefilled the next prompts waited for the whole step: at
concurrency 8 with 2,048-token prompts about 1 s of a disaggregated request's time to first
token (``benchmarks/disagg_ttft.py``, ``kv_transfer`` in its breakdown). Now this thread answers
a pull as it arrives: it streams the parked blocks in messages of up to ``CHUNK_BYTES`` (at most
``TICK_BYTES`` per round, so a flood of pulls cannot keep it from reading acks; pulls are
answered first come, first served: the first prompt's KV arrives first). A chunk is a run of consecutive block
ids, ascending or descending, sent as views of the KV pool (never copied by this process), where
the table has such runs (``_next_chunk``); short runs are gathered.

Thread safety. The thread owns its ROUTER socket and codecs. Of the core it only reads: the
parked tables (``parked_block_ids`` / ``parked_deadline``, dict lookups, atomic under the GIL)
and the KV pool of parked blocks (``export_blocks`` / ``export_heads``), which no step writes
(a parked block is in use, not evictable, and belongs to no running request). It frees
nothing: an ack (the transfer completed, or the gen request was aborted) is queued for the
engine loop, which the ``pipe`` socket wakes, and which frees the blocks between steps
(``take_released``): the block manager keeps one thread. A table is served only until its
advertised expiry (the scheduler's deadline less ``EXPIRY_MARGIN_SECONDS``), so the engine
loop's own expiry of it at the deadline never frees blocks that a chunk is still cut from.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from workers.kv_codec import KVFrameCodec
from workers.kv_core import KVCore
from workers.kv_protocol import (
    KVAck,
    KVBlocks,
    KVDone,
    KVError,
    KVPullRequest,
    KVReplyMessage,
    KVRequestMessage,
)

__all__ = ["KVServer", "CHUNK_BYTES", "TICK_BYTES", "MIN_VIEW_RUN", "EXPIRY_MARGIN_SECONDS", "MAX_MESSAGES_PER_TICK",
           "blocks_within"]

log = logging.getLogger("disagg.kv_transfer")

# Budgets in bytes, not blocks: a block is 64 KiB of the bench model's KV but 2 MiB of an 8B
# model's (bfloat16). Always at least one block.
CHUNK_BYTES = 2 * 2**20  # per message: 32 of the bench model's blocks
# A run of at least this many consecutive block ids (ascending or descending) goes out as views
# of the KV pool, cut where the run ends; shorter runs are gathered into full chunks.
MIN_VIEW_RUN = 8
# What one round sends (ctx) or one tick imports (gen): the server reads acks between rounds,
# and a gen engine's decode of other requests goes on during a long pull.
TICK_BYTES = 16 * 2**20
MAX_MESSAGES_PER_TICK = 4096  # bound one drain of a socket
# The signed expiry is this much earlier than the engine's real deadline (set a few
# microseconds before the output leaves the step): never later. Blocks are served until then.
EXPIRY_MARGIN_SECONDS = 0.5
_server_ids = itertools.count()


@dataclass
class _Send:
    """A pull being answered."""

    identity: bytes
    pull_id: int
    ctx_request_id: int
    block_ids: list[int]
    next_index: int = 0
    heads: range | None = None  # only these KV heads of this rank (a gen rank that splits them otherwise)


class KVServer:
    """Serves parked KV to pulls from a thread; ``start`` once, ``close`` at the end.

    The engine loop registers ``pipe`` in its poller and calls ``take_released`` when it wakes.
    """

    def __init__(self, core: KVCore, key: bytes, ctx: zmq.Context, host: str, port: int,
                 advertise_host: str, chunk_blocks: int, tick_blocks: int) -> None:
        self.core = core
        self._chunk_blocks, self._tick_blocks = chunk_blocks, tick_blocks
        self._requests = KVFrameCodec(key, KVRequestMessage, "kv server")
        self._replies = KVFrameCodec(key, KVReplyMessage, "kv server replies")
        self._router = ctx.socket(zmq.ROUTER)  # used by the thread alone once it starts
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, 0)  # a pull's blocks are bounded by one prompt's KV
        self._router.bind(f"tcp://{host}:{port if port else '*'}")
        bound_port = int(self._router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self.endpoint = f"tcp://{advertise_host}:{bound_port}"
        # One PAIR each way: the thread wakes the engine loop (acks to apply), the loop stops the thread.
        address = f"inproc://kv-server-{next(_server_ids)}"
        self.pipe = ctx.socket(zmq.PAIR)  # the engine loop's end
        self.pipe.setsockopt(zmq.LINGER, 0)
        self.pipe.bind(address)
        self._thread_pipe = ctx.socket(zmq.PAIR)
        self._thread_pipe.setsockopt(zmq.LINGER, 0)
        self._thread_pipe.connect(address)
        self._sends: deque[_Send] = deque()
        self._released: deque[int] = deque()  # ctx request ids acknowledged: the loop frees them
        self._thread = threading.Thread(target=self._run, name="kv-server", daemon=True)
        # Counters for metrics (written by the thread).
        self.num_pulls_served = 0
        self.num_bytes_sent = 0

    @property
    def num_rejected(self) -> int:
        """Messages dropped for failing their authentication."""
        return self._requests.num_rejected

    def start(self) -> None:
        self._thread.start()

    def take_released(self) -> list[int]:
        """Engine loop: the ctx request ids whose parked blocks the gen side is done with."""
        while True:  # drain the wake-ups; the deque, not their count, is what was released
            try:
                self.pipe.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        released = []
        while self._released:
            released.append(self._released.popleft())
        return released

    def close(self) -> None:
        if self._thread.is_alive():
            self.pipe.send(b"stop")
            self._thread.join(timeout=10)
        else:  # never started: the thread's sockets are still this thread's
            self._router.close(linger=0)
            self._thread_pipe.close(linger=0)
        self.pipe.close(linger=0)

    # ---- the thread --------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._thread_pipe, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(0 if self._sends else None))
                if self._thread_pipe in events:
                    return
                self._serve_requests()
                self._send_blocks()
        except Exception:  # logged: its pulls then fail on the gen side's timeout
            log.exception("the KV server thread failed")
        finally:
            self._router.close(linger=0)
            self._thread_pipe.close(linger=0)

    def _serve_requests(self) -> None:
        num_released = len(self._released)
        for _ in range(MAX_MESSAGES_PER_TICK):
            try:
                identity, *frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            decoded = self._requests.decode(frames)
            if decoded is None:
                continue
            message = decoded[0]
            if isinstance(message, KVPullRequest):
                self._accept_pull(identity.bytes, message)
            else:
                self._release(message)
        if len(self._released) != num_released:
            try:
                self._thread_pipe.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the loop has wake-ups queued already: it drains every release at once

    def _servable(self, ctx_request_id: int) -> list[int] | None:
        """The parked table, while it is before its advertised expiry."""
        deadline = self.core.parked_deadline(ctx_request_id)
        if deadline is not None and time.time() >= deadline - EXPIRY_MARGIN_SECONDS:
            return None
        return self.core.parked_block_ids(ctx_request_id)

    def _accept_pull(self, identity: bytes, pull: KVPullRequest) -> None:
        parked = self._servable(pull.ctx_request_id)
        end = pull.first_block + pull.num_blocks
        if parked is None:
            error = f"request {pull.ctx_request_id} has no parked KV here (expired, released or unknown)"
        elif pull.first_block < 0 or pull.num_blocks < 1 or end > len(parked):
            error = f"blocks [{pull.first_block}, {end}) are outside the {len(parked)} parked blocks"
        else:
            self.num_pulls_served += 1
            heads = range(pull.kv_heads_start, pull.kv_heads_stop) if pull.kv_heads_stop else None
            self._sends.append(_Send(identity, pull.pull_id, pull.ctx_request_id, parked[pull.first_block:end],
                                     heads=heads))
            return
        log.warning("refused a KV pull: %s", error)
        self._reply(identity, KVError(pull.pull_id, error))

    def _release(self, ack: KVAck) -> None:
        self._sends = deque(s for s in self._sends if s.ctx_request_id != ack.ctx_request_id)
        self._released.append(ack.ctx_request_id)

    def _send_blocks(self) -> None:
        budget = self._tick_blocks
        while self._sends and budget > 0:
            send = self._sends[0]
            if self._servable(send.ctx_request_id) is None:  # the deadline passed mid-transfer
                self._sends.popleft()
                self._reply(send.identity, KVError(send.pull_id, f"request {send.ctx_request_id}'s parked KV "
                                                                  f"expired during the transfer"))
                continue
            chunk, descending = _next_chunk(send.block_ids, send.next_index, min(budget, self._chunk_blocks))
            ids = chunk[::-1] if descending else chunk
            frames = (self.core.export_blocks(ids) if send.heads is None
                      else self.core.export_heads(ids, send.heads))
            self._reply(send.identity, KVBlocks(send.pull_id, send.next_index, len(chunk), descending), frames)
            self.num_bytes_sent += sum(memoryview(frame).nbytes for frame in frames)
            send.next_index += len(chunk)
            budget -= len(chunk)
            if send.next_index == len(send.block_ids):
                self._sends.popleft()
                self._reply(send.identity, KVDone(send.pull_id, len(send.block_ids)))

    def _reply(self, identity: bytes, message: KVReplyMessage, frames: Sequence[Any] = ()) -> None:
        self._router.send_multipart([identity, *self._replies.encode(message, frames)], flags=zmq.NOBLOCK,
                                    copy=False)


def blocks_within(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks in ``budget_bytes``: at least one."""
    return max(1, budget_bytes // max(1, bytes_per_block))


def _next_chunk(block_ids: list[int], start: int, limit: int) -> tuple[list[int], bool]:
    """The next chunk of ``block_ids`` from ``start`` (at most ``limit`` blocks) and whether it
    runs descending: the run of consecutive ids there when it is long enough to send as views
    of the pool (or fills the chunk), else ``limit`` blocks to gather."""
    end = min(start + limit, len(block_ids))
    first, step = block_ids[start], 1
    if end - start > 1 and block_ids[start + 1] == first - 1:
        step = -1
    run = 1
    while start + run < end and block_ids[start + run] == first + step * run:
        run += 1
    if run >= MIN_VIEW_RUN or start + run == end:
        return block_ids[start:start + run], step < 0 and run > 1
    return block_ids[start:end], False
