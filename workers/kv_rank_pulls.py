"""KV transfer between tensor-parallel layouts: every gen rank pulls its own KV heads.

A ctx worker of TP ``a`` advertises each rank's KV server and head range
(``kv_layout``); its rank 0 tells the followers which blocks a request
parked (``RankPark``), so each serves its own heads of them (its
``KVTransferAgent`` over a ``FollowerKVStore``). On a gen worker of TP ``b``,
rank 0's agent hands a pull to ``RankedPulls``: each gen rank gets the
pieces (ctx rank, heads) that hold its KV heads (``plan_pulls``); rank 0
pulls its own with a ``KVHeadPuller``, each follower its own (``RankPull``),
in parallel, each over its own authenticated ZeroMQ connections. The pull is
complete when every rank has imported its heads; rank 0 then acks ctx rank 0,
which frees the blocks and unparks them on its followers.

A TP-1 gen worker pulling from a TP-1 ctx worker keeps the plain path in
``kv_transfer`` (no head slicing). Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from workers.kv_codec import KVFrameCodec
from workers.kv_layout import PullSource, is_single_rank, parse_layout, plan_pulls
from workers.kv_protocol import KVBlocks, KVDone, KVPullRequest, KVReplyMessage, KVRequestMessage
from workers.kv_transfer import authenticated_replies
from workers.rank_protocol import PullPiece, RankAbortPull, RankPark, RankPull, RankUnpark

if TYPE_CHECKING:
    from workers.engine.request import Request
    from workers.engine.scheduler import KVPull
    from workers.protocol import EngineRequest

__all__ = ["KVHeadPuller", "RankedPulls", "FollowerKVStore"]

log = logging.getLogger("disagg.kv_transfer")


@dataclass
class _Piece:
    source: PullSource
    num_received: int = 0
    done: bool = False


@dataclass
class _HeadPull:
    ctx_request_id: int
    first_block: int
    block_ids: list[int]
    pieces: dict[str, _Piece]  # by ctx endpoint: one piece per ctx rank
    last_progress: float = field(default_factory=time.time)
    num_bytes: int = 0


class KVHeadPuller:
    """Pulls KV heads of blocks from ctx ranks into this rank's pool (``import_heads``)."""

    def __init__(self, ctx: zmq.Context, key: bytes, import_heads: Callable[[list[int], range, list[Any]], None],
                 pull_timeout: float) -> None:
        self._ctx = ctx
        self._import_heads = import_heads
        self.pull_timeout = pull_timeout
        self._request_codec = KVFrameCodec(key, KVRequestMessage, "kv head puller")
        self._reply_codec = KVFrameCodec(key, KVReplyMessage, "kv head puller")
        self._dealers: dict[str, zmq.Socket] = {}
        self._poller: zmq.Poller | None = None
        self._pulls: dict[int, _HeadPull] = {}
        self._finished: list[tuple[int, str | None, int]] = []

    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        for dealer in self._dealers.values():
            poller.register(dealer, zmq.POLLIN)

    def start(self, pull_id: int, ctx_request_id: int, first_block: int, block_ids: list[int],
              sources: list[PullSource]) -> None:
        pull = _HeadPull(ctx_request_id, first_block, block_ids, {s.endpoint: _Piece(s) for s in sources})
        self._pulls[pull_id] = pull
        if not block_ids:
            self._finished.append((pull_id, None, 0))
            del self._pulls[pull_id]
            return
        for source in sources:
            self._dealer(source.endpoint).send_multipart(self._request_codec.encode(KVPullRequest(
                pull_id, ctx_request_id, first_block, len(block_ids), source.ctx_heads.start, source.ctx_heads.stop)))

    def abort(self, pull_id: int) -> None:
        """Late chunks of the pull are dropped, never written (its blocks may be someone else's now)."""
        self._pulls.pop(pull_id, None)

    def tick(self) -> list[tuple[int, str | None, int]]:
        """Pulls that ended since the last tick: (pull id, error or None, bytes received)."""
        for endpoint, dealer in self._dealers.items():
            self._receive(endpoint, dealer)
        now = time.time()
        for pull_id, pull in list(self._pulls.items()):
            if now - pull.last_progress > self.pull_timeout:
                self._end(pull_id, f"no KV arrived for {self.pull_timeout:g} s")
        finished, self._finished = self._finished, []
        return finished

    def close(self) -> None:
        for dealer in self._dealers.values():
            dealer.close(linger=0)

    def _dealer(self, endpoint: str) -> zmq.Socket:
        dealer = self._dealers.get(endpoint)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)  # blocks of allocated pulls: never drop them
            dealer.connect(endpoint)
            self._dealers[endpoint] = dealer
            if self._poller is not None:
                self._poller.register(dealer, zmq.POLLIN)
        return dealer

    def _receive(self, endpoint: str, dealer: zmq.Socket) -> None:
        for message, frames in authenticated_replies(dealer, self._reply_codec):
            pull = self._pulls.get(message.pull_id)
            piece = None if pull is None else pull.pieces.get(endpoint)
            if pull is None or piece is None:
                continue  # aborted
            if isinstance(message, KVBlocks):
                self._import(message, pull, piece, frames)
            elif isinstance(message, KVDone):
                if piece.num_received != len(pull.block_ids):
                    self._end(message.pull_id, f"{piece.num_received} of {len(pull.block_ids)} blocks arrived "
                                               f"from {endpoint}")
                    continue
                piece.done = True
                if all(p.done for p in pull.pieces.values()):
                    self._end(message.pull_id, None)
            else:
                self._end(message.pull_id, f"{endpoint}: {message.error}")

    def _import(self, message: KVBlocks, pull: _HeadPull, piece: _Piece, frames: list[memoryview]) -> None:
        end = message.index + message.num_blocks
        if message.index != piece.num_received or end > len(pull.block_ids):
            self._end(message.pull_id, f"bad chunk [{message.index}, {end})")
            return
        block_ids = pull.block_ids[message.index:end]
        try:
            self._import_heads(block_ids[::-1] if message.descending else block_ids, piece.source.local_heads,
                               frames)
        except ValueError as exc:
            self._end(message.pull_id, str(exc))
            return
        piece.num_received = end
        pull.num_bytes += sum(frame.nbytes for frame in frames)
        pull.last_progress = time.time()

    def _end(self, pull_id: int, error: str | None) -> None:
        pull = self._pulls.pop(pull_id, None)
        if pull is not None:
            self._finished.append((pull_id, error, pull.num_bytes))


class RankedPulls:
    """Gen rank 0's side: split each pull over the group's ranks and collect their results;
    ctx rank 0's side: park and unpark on the followers."""

    def __init__(self, puller: KVHeadPuller, num_kv_heads: int, rank_kv_heads: list[range], link: Any) -> None:
        self.puller = puller
        self.num_kv_heads = num_kv_heads
        self.rank_kv_heads = rank_kv_heads  # the KV heads of each rank of this worker
        self.link = link  # the LeaderLink, None for one rank
        self._pending: dict[int, set[int]] = {}  # pull id -> ranks still pulling
        self._errors: dict[int, str] = {}
        self._bytes: dict[int, int] = {}

    def wants(self, kv_endpoint: str) -> bool:
        """Whether a pull from ``kv_endpoint`` goes through the ranks (else the plain path)."""
        return len(self.rank_kv_heads) > 1 or not is_single_rank(kv_endpoint)

    def ack_endpoint(self, kv_endpoint: str) -> str:
        """The ctx rank 0's endpoint (its KV agent): where the ack goes."""
        return parse_layout(kv_endpoint, self.num_kv_heads)[0].endpoint

    def start(self, pull_id: int, kv_endpoint: str, ctx_request_id: int, first_block: int,
              block_ids: list[int]) -> None:
        """Raises ValueError for a layout that does not cover this model's KV heads."""
        layout = parse_layout(kv_endpoint, self.num_kv_heads)
        plans = [plan_pulls(layout, heads) for heads in self.rank_kv_heads]
        self._pending[pull_id] = set(range(len(plans)))
        self._bytes[pull_id] = 0
        for rank, sources in enumerate(plans[1:], start=1):
            pieces = [PullPiece(s.endpoint, s.ctx_heads.start, s.ctx_heads.stop, s.local_heads.start,
                                s.local_heads.stop) for s in sources]
            self.link.send_to(rank, RankPull(pull_id, ctx_request_id, first_block, block_ids, pieces))
        self.puller.start(pull_id, ctx_request_id, first_block, block_ids, plans[0])

    def abort(self, pull_id: int) -> None:
        if self._pending.pop(pull_id, None) is None:
            return
        self._errors.pop(pull_id, None)
        self._bytes.pop(pull_id, None)
        self.puller.abort(pull_id)
        if self.link is not None:
            self.link.send_all(RankAbortPull(pull_id))

    def tick(self) -> list[tuple[int, str | None, int]]:
        """Pulls every rank has finished: (pull id, the first error or None, bytes over all ranks)."""
        if not self._pending:  # the usual case between pulls: nothing to look at
            if self.link is not None:
                self.link.take_pull_results()  # late results of aborted pulls
            return []
        results = [(0, pull_id, error, num_bytes) for pull_id, error, num_bytes in self.puller.tick()]
        if self.link is not None:
            results += [(m.rank, m.pull_id, m.error, m.num_bytes) for m in self.link.take_pull_results()]
        finished = []
        for rank, pull_id, error, num_bytes in results:
            pending = self._pending.get(pull_id)
            if pending is None:
                continue
            pending.discard(rank)
            self._bytes[pull_id] += num_bytes
            if error is not None:
                self._errors.setdefault(pull_id, f"rank {rank}: {error}")
            if not pending:
                del self._pending[pull_id]
                finished.append((pull_id, self._errors.pop(pull_id, None), self._bytes.pop(pull_id)))
        return finished

    def park(self, ctx_request_id: int, block_ids: list[int], expires_at: float) -> None:
        if self.link is not None:
            self.link.send_all(RankPark(ctx_request_id, block_ids, expires_at))

    def unpark(self, ctx_request_id: int) -> None:
        if self.link is not None:
            self.link.send_all(RankUnpark(ctx_request_id))


class FollowerKVStore:
    """What a follower's ``KVTransferAgent`` reads instead of an ``EngineCore`` (``kv_core.KVCore``):
    the parked tables rank 0 sent, and the rank's own pool. It serves pulls, never starts one."""

    def __init__(self, runner: Any) -> None:
        self.executor = runner
        self._parked: dict[int, tuple[list[int], float]] = {}

    @property
    def kv_bytes_per_block(self) -> int:
        return int(self.executor.kv_bytes_per_block)

    def park(self, message: RankPark) -> None:
        # ``expires_at`` is rank 0's own deadline (``EngineCore.parked_deadline``): one owner.
        self._parked[message.ctx_request_id] = (message.block_ids, message.expires_at)

    def release_parked(self, ctx_request_id: int) -> bool:
        return self._parked.pop(ctx_request_id, None) is not None

    def parked_block_ids(self, ctx_request_id: int) -> list[int] | None:
        entry = self._parked.get(ctx_request_id)
        return None if entry is None else entry[0]

    def parked_deadline(self, ctx_request_id: int) -> float | None:
        entry = self._parked.get(ctx_request_id)
        return None if entry is None else entry[1]

    def release_expired(self, now: float) -> list[int]:
        expired = [r for r, (_, expires) in self._parked.items() if expires <= now]
        for request_id in expired:
            del self._parked[request_id]
        return expired

    def export_blocks(self, block_ids: list[int]) -> list[Any]:
        return list(self.executor.export_blocks(block_ids))

    def export_heads(self, block_ids: list[int], heads: range) -> list[Any]:
        return list(self.executor.export_heads(block_ids, heads))

    def take_kv_pulls(self) -> list[KVPull]:
        return []

    def has_kv_pulls(self) -> bool:
        return False  # a follower serves pulls; rank 0 starts every one

    # The gen side: rank 0 adds every request and starts every pull, so a follower's agent never
    # calls these; they fail loudly rather than pretend.
    def add_request(self, engine_request: EngineRequest, park_kv_seconds: float | None = None) -> Request:
        raise RuntimeError("a follower rank's KV store takes no requests")

    def add_remote_request(self, engine_request: EngineRequest, output_token_ids: Sequence[int] = (),
                           park_kv_seconds: float | None = None, num_remote_tokens: int | None = None) -> Request:
        raise RuntimeError("a follower rank's KV store takes no requests")

    def import_blocks(self, block_ids: list[int], buffers: list[Any]) -> None:
        raise RuntimeError("a follower rank's KV agent starts no pulls")

    def finish_remote_kv(self, request_id: int) -> None:
        raise RuntimeError("a follower rank's KV agent starts no pulls")

    def recompute_remote(self, request_id: int) -> bool:
        raise RuntimeError("a follower rank's KV agent starts no pulls")

    def abort(self, request_id: int) -> None:
        pass  # nothing of a request lives here but its parked table, which rank 0 releases


def attach_rank_pulls(agent: Any, executor: Any, ctx: zmq.Context, key: bytes, pull_timeout: float,
                      link: Any = None) -> str:
    """Give rank 0's KV agent of a torch engine its ``RankedPulls``; the KV endpoint to advertise
    (with ``link``: every rank's endpoint and KV heads, ``kv_layout``)."""
    from workers.kv_layout import RankKV, format_layout

    config = executor.model_config
    tp = getattr(executor, "tp", None)
    own = tp.heads(config.num_heads, config.num_kv_heads).kv_heads if tp is not None else range(config.num_kv_heads)
    ranks = [RankKV(agent.endpoint, own)]
    if link is not None:
        for rank in link.followers:
            ready = link.ready[rank]
            ranks.append(RankKV(ready.kv_endpoint or "", range(ready.kv_heads_start, ready.kv_heads_stop)))
    puller = KVHeadPuller(ctx, key, executor.import_heads, pull_timeout)
    agent.attach_ranks(RankedPulls(puller, config.num_kv_heads, [r.kv_heads for r in ranks], link))
    return agent.endpoint if link is None else format_layout(ranks)
