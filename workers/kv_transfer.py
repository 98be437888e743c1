"""The KV-transfer agent of one engine: ctx-side server and gen-side puller (docs/architecture.md, "A request's path").

Ctx side: a ``context_only`` request parks its prompt's blocks at finish; ``KVServer``
(``workers.kv_server``) answers pulls of them from a thread of its own, so a pull never waits
for the ctx engine's step, and hands the acks back to the engine loop, which frees the blocks;
so does the park deadline.

Gen side, inside the engine loop: ``tick()`` between steps reads and writes non-blocking ZeroMQ
sockets whose TCP work happens in ZeroMQ's I/O thread, so a pull in flight never stalls the
decode of other requests, and ``EngineCore`` stays single-threaded (a block is written into
the KV cache only while its request still owns it: an aborted request's late blocks are
dropped, never written into blocks someone else now holds). A ``generation_only`` request
waits in ``WAITING_FOR_REMOTE_KV`` until the scheduler allocates its blocks (reusing local
prefix hits), then only the missing blocks are pulled, each chunk imported as it arrives (at
most ``TICK_BYTES`` per tick); an abort releases the ctx side too. Wire format:
``workers.kv_protocol``; authentication: ``workers.kv_codec``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from workers.kv_codec import KVFrameCodec
from workers.kv_core import KVCore
from workers.kv_protocol import (
    KVAck,
    KVBlocks,
    KVDone,
    KVPullRequest,
    KVReplyMessage,
    KVRequestMessage,
)
from workers.kv_server import (
    CHUNK_BYTES,
    EXPIRY_MARGIN_SECONDS,
    MAX_MESSAGES_PER_TICK,
    TICK_BYTES,
    KVServer,
    blocks_within,
)
from workers.protocol import (
    AddContextRequest,
    AddRemoteRequest,
    KVTransferStats,
    ParkedKV,
    RequestOutput,
)

__all__ = ["DisaggEngineSpec", "KVTransferAgent", "EXPIRY_MARGIN_SECONDS"]

log = logging.getLogger("disagg.kv_transfer")



class DisaggEngineSpec(msgspec.Struct, frozen=True):
    """The engine's part of disaggregated serving (inside the 0600 engine spec file)."""

    role: str  # both | ctx | gen
    cluster_key_hex: str  # read by the launcher from the 0600 cluster key file
    kv_host: str = "127.0.0.1"  # the agent binds here (0.0.0.0: every interface)
    kv_port: int = 0  # 0: a free port
    kv_advertise_host: str | None = None  # the host in kv_endpoint (None: kv_host, or the FQDN for 0.0.0.0)
    pull_timeout_seconds: float = 30.0  # a pull with no progress for this long fails its request

    def build_agent(self, core: KVCore, ctx: zmq.Context) -> KVTransferAgent:
        return KVTransferAgent(core, bytes.fromhex(self.cluster_key_hex), ctx, self.kv_host, self.kv_port,
                               self.kv_advertise_host, self.pull_timeout_seconds)


@dataclass
class _Pull:
    """A gen-side request whose KV comes from ``endpoint``."""

    endpoint: str
    ctx_request_id: int
    block_ids: list[int] = field(default_factory=list)
    started: float | None = None  # None: blocks not allocated yet, nothing requested
    last_progress: float = 0.0
    num_received: int = 0
    num_bytes: int = 0
    layout: str | None = None  # pulled by every rank from the ctx ranks (``kv_rank_pulls``)
    x_request_id: str | None = None  # the request's HTTP id, for the log lines about it


class KVTransferAgent:
    """One engine's KV-transfer endpoint; every method is called from the engine loop."""

    def __init__(self, core: KVCore, key: bytes, ctx: zmq.Context, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, pull_timeout: float = 30.0) -> None:
        self.core = core
        self.pull_timeout = pull_timeout
        self._tick_blocks = blocks_within(TICK_BYTES, core.kv_bytes_per_block)
        self._ctx = ctx
        self._request_codec = KVFrameCodec(key, KVRequestMessage, "kv puller requests")
        self._reply_codec = KVFrameCodec(key, KVReplyMessage, "kv puller")
        if advertise_host is None:
            advertise_host = socket.getfqdn() if host in ("0.0.0.0", "*", "") else host
        self.server = KVServer(core, key, ctx, host, port, advertise_host,
                               blocks_within(CHUNK_BYTES, core.kv_bytes_per_block), self._tick_blocks)
        self.endpoint = self.server.endpoint
        self.server.start()
        self._poller: zmq.Poller | None = None
        self._dealers: dict[str, zmq.Socket] = {}
        # Each dealer's connection events: a ctx agent whose connection drops (its engine died) or is
        # refused fails the pulls from it at once instead of after ``pull_timeout`` of silence. Its
        # parked KV is gone either way: even a reconnect reaches a new ROUTER identity, which
        # would never be sent the blocks of the old one.
        self._monitors: dict[str, zmq.Socket] = {}
        self._ctx_requests: dict[int, int] = {}  # live ctx request id -> its prompt tokens
        self._pulls: dict[int, _Pull] = {}  # gen request id -> its pull
        self._stats: dict[int, KVTransferStats] = {}  # gen request id -> its transfer (finishing output)
        # Counters for metrics (the ctx side's: ``server.num_pulls_served``, ``server.num_bytes_sent``).
        self.num_pulls_completed = 0
        self.num_pulls_failed = 0
        self.num_bytes_received = 0
        self.ranks: Any = None  # ``kv_rank_pulls.RankedPulls`` of a torch engine (``attach_ranks``)

    def attach_ranks(self, ranks: Any) -> None:
        """Pull from (and serve to) other tensor-parallel layouts head by head (``kv_rank_pulls``)."""
        self.ranks = ranks
        if self._poller is not None:
            ranks.puller.register(self._poller)

    # ---- engine loop hooks -------------------------------------------------

    def register(self, poller: zmq.Poller) -> None:
        """Wake the engine loop's poll on KV-transfer traffic too."""
        self._poller = poller
        poller.register(self.server.pipe, zmq.POLLIN)  # acks to apply
        if self.ranks is not None:
            self.ranks.puller.register(poller)
        for sock in (*self._dealers.values(), *self._monitors.values()):
            poller.register(sock, zmq.POLLIN)

    def add_context(self, message: AddContextRequest) -> Any:
        request, prefix = message.request, message.kv_prefix
        if prefix is None:
            engine_request = self.core.add_request(request, park_kv_seconds=message.park_kv_seconds)
        else:  # the prompt's first blocks come from a peer (the KV pool), the rest is prefilled here
            endpoint, layout = self._source(prefix.kv_endpoint)
            engine_request = self.core.add_remote_request(request, (), message.park_kv_seconds, prefix.num_tokens)
            self._pulls[request.request_id] = _Pull(endpoint, prefix.ctx_request_id, layout=layout,
                                                    x_request_id=request.x_request_id)
        self._ctx_requests[request.request_id] = len(request.prompt_token_ids)
        return engine_request

    def add_remote(self, message: AddRemoteRequest) -> Any:
        request = message.request
        endpoint, layout = self._source(message.kv_endpoint)
        engine_request = self.core.add_remote_request(request, [message.first_token_id])
        self._pulls[request.request_id] = _Pull(endpoint, message.ctx_request_id, layout=layout,
                                                x_request_id=request.x_request_id)
        return engine_request

    def _source(self, endpoint: str) -> tuple[str, str | None]:
        """Where to pull from and ack, and the other side's rank layout when every rank pulls its
        heads (``kv_rank_pulls``); ValueError: a bad layout."""
        if self.ranks is not None and self.ranks.wants(endpoint):
            return self.ranks.ack_endpoint(endpoint), endpoint
        return endpoint, None

    def abort(self, request_id: int) -> None:
        """Before ``core.abort``: a gen request's pull stops and the ctx side is released."""
        pull = self._pulls.pop(request_id, None)
        if pull is not None and pull.layout is not None:
            self.ranks.abort(request_id)  # before core.abort frees the blocks
        if pull is not None:
            self._send_request(pull.endpoint, KVAck(request_id, pull.ctx_request_id, completed=False))

    def has_work(self) -> bool:
        """Pulls are waiting to be requested: the loop must not block in poll. (A step allocates a
        gen request's blocks after this tick took the pulls: the pull request waited for the loop's
        idle poll, 250 ms, before it was sent.)"""
        return self.core.has_kv_pulls()

    def tick(self) -> None:
        now = time.time()
        self.core.release_expired(now)  # also while no step runs
        for ctx_request_id in self.server.take_released():
            self._release(ctx_request_id)
        for pull in self.core.take_kv_pulls():
            self._start_pull(pull.request_id, pull.block_ids, pull.first_block, now)
        for dealer in list(self._dealers.values()):
            self._receive_replies(dealer)
        for endpoint, monitor in list(self._monitors.items()):
            self._watch_connection(endpoint, monitor)
        if self.ranks is not None:
            self._finish_ranked(self.ranks.tick())
        self._check_timeouts(time.time())

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Annotate finishing outputs: parked KV (ctx), transfer stats (gen)."""
        for output in outputs:
            if output.finish_reason is None:
                continue
            request_id = output.request_id
            stats = self._stats.pop(request_id, None)
            if stats is not None:
                output.kv_transfer = stats
            self._pulls.pop(request_id, None)
            num_prompt = self._ctx_requests.pop(request_id, None)
            if num_prompt is None:
                continue
            if output.finish_reason == "stop":
                self.core.release_parked(request_id)  # EOS or a stop token: there is no gen leg
                continue
            # The deadline is the one the scheduler set when it parked the blocks (its only owner).
            block_ids, deadline = self.core.parked_block_ids(request_id), self.core.parked_deadline(request_id)
            if block_ids is not None and deadline is not None:
                output.kv_parked = ParkedKV(num_prompt, deadline - EXPIRY_MARGIN_SECONDS)
                if self.ranks is not None:  # each follower serves its own heads of these blocks
                    self.ranks.park(request_id, block_ids, deadline)

    def close(self) -> None:
        self.server.close()
        for dealer in self._dealers.values():
            dealer.disable_monitor()  # else its internal monitor socket keeps the context from terminating
        for sock in (*self._monitors.values(), *self._dealers.values()):
            sock.close(linger=0)

    # ---- ctx side ----------------------------------------------------------

    def _release(self, ctx_request_id: int) -> None:
        """The gen side acknowledged (or aborted) a pull: free the parked blocks, on every rank."""
        self.core.release_parked(ctx_request_id)
        if self.ranks is not None:
            self.ranks.unpark(ctx_request_id)

    # ---- gen side ----------------------------------------------------------

    def _start_pull(self, request_id: int, block_ids: list[int], first_block: int, now: float) -> None:
        pull = self._pulls.get(request_id)
        if pull is None:
            return  # aborted meanwhile
        pull.block_ids, pull.started, pull.last_progress = block_ids, now, now
        if not block_ids:  # every block hit this engine's prefix cache
            self._complete(request_id, pull)
            return
        if pull.layout is not None:
            try:
                self.ranks.start(request_id, pull.layout, pull.ctx_request_id, first_block, block_ids)
            except ValueError as exc:
                self._fail(request_id, str(exc))
            return
        self._send_request(pull.endpoint, KVPullRequest(request_id, pull.ctx_request_id, first_block,
                                                        len(block_ids)))

    def _send_request(self, endpoint: str, message: KVRequestMessage) -> None:
        dealer = self._dealers.get(endpoint)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)  # blocks of pulls already allocated: never drop them
            monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
            dealer.connect(endpoint)
            self._dealers[endpoint], self._monitors[endpoint] = dealer, monitor
            if self._poller is not None:
                self._poller.register(dealer, zmq.POLLIN)
                self._poller.register(monitor, zmq.POLLIN)
        try:
            dealer.send_multipart(self._request_codec.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV request to %s dropped: its queue is full", endpoint)

    def _watch_connection(self, endpoint: str, monitor: zmq.Socket) -> None:
        gone = None
        for _ in range(MAX_MESSAGES_PER_TICK):
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if gone != "disconnected":  # a drop is followed by refused reconnects: name the cause
                gone = "disconnected" if event["event"] == zmq.EVENT_DISCONNECTED else "refused the connection"
        if gone is None:
            return
        for request_id in [rid for rid, p in self._pulls.items() if p.endpoint == endpoint and p.started is not None]:
            self._fail(request_id, f"the ctx engine's KV agent at {endpoint} {gone} (its worker is gone)")

    def _receive_replies(self, dealer: zmq.Socket) -> None:
        budget = self._tick_blocks  # what is left waits in the socket, which keeps the loop's poll awake
        for message, frames in authenticated_replies(dealer, self._reply_codec):
            pull = self._pulls.get(message.pull_id)
            if pull is None or pull.started is None:
                continue  # aborted: its blocks may belong to someone else now
            if isinstance(message, KVBlocks):
                self._receive_blocks(message, pull, frames)
                budget -= message.num_blocks
                if (pull.layout is None and message.pull_id in self._pulls
                        and pull.num_received == len(pull.block_ids)):
                    # Every block is in (chunks are checked contiguous): done now, not one more wake
                    # later when the KVDone sent after them arrives (it then finds no pull: ignored).
                    # A ranked pull completes when every rank has imported its heads (kv_rank_pulls).
                    self._complete(message.pull_id, pull)
                if budget <= 0:
                    return
            elif isinstance(message, KVDone):
                if pull.num_received != len(pull.block_ids) or message.num_blocks != len(pull.block_ids):
                    self._fail(message.pull_id, f"{pull.num_received} of {len(pull.block_ids)} blocks arrived")
                else:
                    self._complete(message.pull_id, pull)
            else:
                self._fail(message.pull_id, message.error)

    def _receive_blocks(self, message: KVBlocks, pull: _Pull, frames: list[memoryview]) -> None:
        """Import a chunk straight from the received frames (the only copy on this side)."""
        end = message.index + message.num_blocks
        if message.num_blocks < 1 or message.index != pull.num_received or end > len(pull.block_ids):
            self._fail(message.pull_id, f"bad chunk: blocks [{message.index}, {end}) after {pull.num_received} "
                                        f"of {len(pull.block_ids)}")
            return
        block_ids = pull.block_ids[message.index:end]
        try:
            self.core.import_blocks(block_ids[::-1] if message.descending else block_ids, frames)
        except ValueError as exc:  # e.g. a ctx engine with another model or block size
            self._fail(message.pull_id, str(exc))
            return
        pull.num_received = end
        pull.num_bytes += sum(frame.nbytes for frame in frames)
        pull.last_progress = time.time()

    def _finish_ranked(self, finished: list[tuple[int, str | None, int]]) -> None:
        for request_id, error, num_bytes in finished:
            pull = self._pulls.get(request_id)
            if pull is None:
                continue
            pull.num_received, pull.num_bytes = len(pull.block_ids), num_bytes
            if error is None:
                self._complete(request_id, pull)
            else:
                self._fail(request_id, error)

    def _complete(self, request_id: int, pull: _Pull) -> None:
        seconds = time.time() - (pull.started or time.time())  # the last block is in: the transfer is over
        del self._pulls[request_id]
        self.core.finish_remote_kv(request_id)
        self._send_request(pull.endpoint, KVAck(request_id, pull.ctx_request_id, completed=True))
        self._stats[request_id] = KVTransferStats(len(pull.block_ids), pull.num_bytes, seconds)
        self.num_pulls_completed += 1
        self.num_bytes_received += pull.num_bytes

    def _fail(self, request_id: int, why: str) -> None:
        """Release the ctx side and prefill the request here instead (``recompute_remote``: its
        client may hold its first token already); ended with a clear error only when it cannot be."""
        self.num_pulls_failed += 1
        pull = self._pulls.get(request_id)
        named = {"request_id": pull.x_request_id if pull is not None else None}  # common.log_format
        self.abort(request_id)
        if self.core.recompute_remote(request_id):
            self._stats[request_id] = KVTransferStats(0, 0, 0.0, recomputed=True)
            log.warning("KV pull for request %d failed (%s): its prompt is prefilled here instead", request_id, why,
                        extra=named)
        else:  # no longer waiting for this KV (aborted meanwhile): nothing left to end
            log.warning("KV pull for request %d failed: %s", request_id, why, extra=named)

    def _check_timeouts(self, now: float) -> None:
        stalled = [rid for rid, p in self._pulls.items()  # ranked pulls: each rank's puller times out
                   if p.started is not None and p.layout is None and now - p.last_progress > self.pull_timeout]
        for request_id in stalled:
            self._fail(request_id, f"no KV arrived from {self._pulls[request_id].endpoint} "
                                   f"for {self.pull_timeout:g} s")


def authenticated_replies(dealer: zmq.Socket, codec: KVFrameCodec) -> Iterator[tuple[Any, list[memoryview]]]:
    """The (message, frames) waiting on ``dealer``, at most MAX_MESSAGES_PER_TICK; a message that
    fails its check is dropped (counted by ``codec``). Receives lazily: stop iterating to stop."""
    for _ in range(MAX_MESSAGES_PER_TICK):
        try:
            frames = dealer.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        decoded = codec.decode(frames)
        if decoded is not None:
            yield decoded
