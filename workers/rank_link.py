"""The link between engine rank 0 (the leader) and its tensor-parallel followers.

Rank 0 binds a ROUTER on ``tcp://master_addr:master_port``; each follower
connects a DEALER, says ``RankHello`` and later ``RankReady``. Every step the
leader sends each follower the same signed ``RankStep`` (encoded once).

Liveness, so that no rank ever waits for a dead one:

- ZeroMQ heartbeats (``HEARTBEAT_IVL`` / ``HEARTBEAT_TIMEOUT``) run in the
  I/O threads, so a busy step does not miss them; a peer that dies closes
  its TCP connection at once, one that hangs is dropped after the timeout.
- Both ends watch their socket's monitor for ``EVENT_DISCONNECTED``: a
  follower whose leader disconnects exits; a leader that loses a follower
  raises ``RankLost`` from ``check()`` (the engine loop calls it each turn
  and polls the monitor, so an idle engine wakes for it too).
- A follower's torch collectives fail on their own when a peer process dies
  (its sockets close); their timeout covers a peer that hangs in a step.

Torch-free.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from workers.ipc import FrameCodec
from workers.rank_protocol import (
    FollowerMessage,
    LeaderMessage,
    RankFailed,
    RankHello,
    RankPullDone,
    RankReady,
    RankStep,
    RankStepDone,
    RankStop,
)

__all__ = ["RankLost", "LeaderLink", "FollowerLink", "HEARTBEAT_MS", "HEARTBEAT_TIMEOUT_MS"]

log = logging.getLogger("disagg.ranks")

HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000  # a hung peer (SIGSTOP, a dead host) is dropped after this


class RankLost(RuntimeError):
    """A rank of the tensor-parallel group is gone: the worker cannot go on."""


def _configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    return sock


def _disconnected(monitor: zmq.Socket) -> bool:
    """Drain ``monitor``; whether it reported a dropped connection."""
    dropped = False
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        dropped = dropped or event["event"] == zmq.EVENT_DISCONNECTED
    return dropped


class LeaderLink:
    """Rank 0's end: one ROUTER for all followers."""

    def __init__(self, ctx: zmq.Context, key: bytes, world_size: int, addr: str, port: int) -> None:
        self.world_size = world_size
        self._send_codec: FrameCodec = FrameCodec(key, LeaderMessage, "rank leader")
        self._recv_codec: FrameCodec = FrameCodec(key, FollowerMessage, "rank leader")
        self.sock = _configure(ctx.socket(zmq.ROUTER))
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished follower raises
        self.sock.bind(f"tcp://{addr}:{port}")
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._peers: dict[int, bytes] = {}  # rank -> ZeroMQ identity
        self.pids: dict[int, int] = {}
        self.ready: dict[int, RankReady] = {}
        self._done: dict[int, int] = {}  # rank -> the last step it finished (synthetic lockstep)
        self._pull_results: list[RankPullDone] = []

    @property
    def followers(self) -> range:
        return range(1, self.world_size)

    def wait_hellos(self, timeout: float) -> None:
        """Every follower connected (said ``RankHello``); RankLost on a failure or the timeout."""
        self._wait_for_all(self._peers, "did not connect", timeout)

    def wait_ready(self, timeout: float) -> dict[int, RankReady]:
        """Every follower's ``RankReady`` (their shards loaded); RankLost on a failure or the timeout."""
        self._wait_for_all(self.ready, "were not ready", timeout)
        return self.ready

    def _wait_for_all(self, seen: dict[int, Any], what: str, timeout: float) -> None:
        """Receive until ``seen`` (filled by ``_receive``) has every follower."""
        deadline = time.monotonic() + timeout
        while len(seen) < self.world_size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(self.followers) - set(seen))
                raise RankLost(f"tensor-parallel ranks {missing} {what} within {timeout:g} s")
            self._receive(min(remaining, 1.0))

    def send_step(self, step: RankStep) -> None:
        frames = self._send_codec.encode(step)
        for rank in self.followers:
            self._send(rank, frames)

    def send_to(self, rank: int, message: LeaderMessage) -> None:
        self._send(rank, self._send_codec.encode(message))

    def send_all(self, message: LeaderMessage) -> None:
        frames = self._send_codec.encode(message)
        for rank in self.followers:
            self._send(rank, frames)

    def take_pull_results(self) -> list[RankPullDone]:
        """The followers' finished KV pulls since the last call (``check`` receives them)."""
        results, self._pull_results = self._pull_results, []
        return results

    def wait_done(self, step: int, timeout: float) -> None:
        """Every follower's ``RankStepDone`` for ``step`` (the synthetic engine's lockstep)."""
        deadline = time.monotonic() + timeout
        while any(self._done.get(rank, -1) < step for rank in self.followers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankLost(f"a tensor-parallel rank did not finish step {step} within {timeout:g} s")
            self._receive(min(remaining, 0.2))  # short slices: the monitor is read between them

    def check(self) -> None:
        """Raise RankLost when a follower disconnected or failed; drain what arrived."""
        while self.sock.poll(0):
            self._receive(0)
        if _disconnected(self.monitor):
            raise RankLost("a tensor-parallel follower rank disconnected (it died or hung)")

    def stop(self) -> None:
        """Tell the followers to exit; close the sockets."""
        frames = self._send_codec.encode(RankStop())
        for rank in self._peers:
            try:
                self._send(rank, frames)
            except RankLost:
                pass
        self.monitor.close(linger=0)
        self.sock.close(linger=100)  # RankStop reaches the followers before the sockets go

    def _send(self, rank: int, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart([self._peers[rank], *frames], flags=zmq.NOBLOCK)
        except (zmq.ZMQError, KeyError) as exc:
            raise RankLost(f"tensor-parallel rank {rank} is unreachable ({exc})") from None

    def _receive(self, timeout: float) -> None:
        if not self.sock.poll(int(timeout * 1000)):
            if _disconnected(self.monitor):
                raise RankLost("a tensor-parallel follower rank disconnected (it died or hung)")
            return
        identity, *frames = self.sock.recv_multipart()
        message = self._recv_codec.decode(frames)
        if isinstance(message, RankHello):
            self._peers[message.rank] = identity
            self.pids[message.rank] = message.pid
            log.info("tensor-parallel rank %d (pid %d) connected", message.rank, message.pid)
        elif isinstance(message, RankReady):
            self.ready[message.rank] = message
        elif isinstance(message, RankStepDone):
            self._done[message.rank] = message.step
        elif isinstance(message, RankPullDone):
            self._pull_results.append(message)
        elif isinstance(message, RankFailed):
            raise RankLost(f"tensor-parallel rank {message.rank} failed: {message.error}")


class FollowerLink:
    """A follower's end: one DEALER to rank 0."""

    def __init__(self, ctx: zmq.Context, key: bytes, rank: int, addr: str, port: int) -> None:
        self.rank = rank
        self._send_codec: FrameCodec = FrameCodec(key, FollowerMessage, f"rank {rank}")
        self._recv_codec: FrameCodec = FrameCodec(key, LeaderMessage, f"rank {rank}")
        self.sock = _configure(ctx.socket(zmq.DEALER))
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(f"tcp://{addr}:{port}")
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def send(self, message: Any) -> None:
        self.sock.send_multipart(self._send_codec.encode(message))

    def recv(self, timeout_ms: int) -> LeaderMessage | None:
        """The leader's next message, None on timeout; RankLost when the leader disconnected."""
        events = dict(self._poller.poll(timeout_ms))
        if self.sock in events:
            return self._recv_codec.decode(self.sock.recv_multipart())
        if self.monitor in events and _disconnected(self.monitor):
            raise RankLost("rank 0 disconnected (it died or hung)")
        return None

    def close(self) -> None:
        self.monitor.close(linger=0)
        self.sock.close(linger=1000)  # a RankFailed must reach rank 0
