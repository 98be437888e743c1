"""The engine process: a thin shell that moves messages around ``EngineCore``.

As vLLM's ``EngineCoreProc.run_busy_loop``: drain the inputs (block in poll
when there is no work, never spin), add and abort requests, ``step()``, send
each lane at most one ``OutputBatch`` per step. Sockets (docs/architecture.md, "Sockets inside a worker"):

    ingress.sock   bound PULL    requests and aborts from every frontend
    lane-<i>.sock  PUSH-connect  outputs to frontend i (client id >> 48)
    control.sock   bound ROUTER  health, shutdown, drains, profiler (launcher only)
    status.sock    PUSH-connect  one EngineReady / EngineFailed to the launcher

A tensor-parallel engine (``EngineProcSpec.ranks``) is this process as rank 0
plus followers (``workers.rank_follower``) on ``rank_link``: each step goes to
them first (``LeaderExecutor``); a follower lost ends the loop with a log line
and exit code 1, and the launcher takes the worker down.

Sends never block: a lane whose queue is full (a dead or stuck frontend) has
that step's batch dropped and all of its requests aborted, logged and counted.
A heartbeat thread with its own sockets sends an empty batch on every lane
each second, so frontends can tell a slow step from a dead engine.

Run as ``python -m workers.engine_proc --spec FILE``: FILE (mode 0600, deleted
once read) holds an ``EngineProcSpec`` with the key; the key is never on a
command line.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from common.log_format import LOG_FORMATS, configure_logging
from workers.allocator import MemoryTrimmer, release_memory
from workers.client_ids import FRONTEND_SHIFT, lane_of
from workers.config import EngineConfig
from workers.engine_lanes import Heartbeat, connect_lane
from workers.ipc import (
    INGRESS_HWM,
    LANE_SNDHWM,
    FrameCodec,
    IpcPaths,
    send_nowait,
)
from workers.kv_transfer import DisaggEngineSpec, KVTransferAgent
from workers.protocol import (
    AbortRequests,
    AddContextRequest,
    AddRemoteRequest,
    AddRequest,
    AddResumedRequest,
    ControlAck,
    ControlReply,
    ControlRequest,
    DrainKVEvents,
    DrainReply,
    DrainStats,
    EngineFailed,
    EngineHealth,
    EngineInfo,
    EngineReady,
    EngineTiming,
    FinishReason,
    FrontendHello,
    HealthPing,
    IngressMessage,
    OutputBatch,
    RejectReason,
    RequestOutput,
    Shutdown,
    SnapshotKVCache,
    StartProfile,
    StatusMessage,
    StopProfile,
)
from workers.rank_env import RankEnv
from workers.rank_link import LeaderLink, RankLost

if TYPE_CHECKING:  # the core's modules load in ``build_core``, after the shell has started
    from workers.engine.core import EngineCore
    from workers.engine.request import Request

__all__ = ["EngineProcSpec", "EngineProc", "run_engine", "main"]

log = logging.getLogger("disagg.engine")

IDLE_POLL_MS = 250  # idle wake-up to notice a SIGTERM; a blocking wait, not a spin
ONBOARD_POLL_MS = 1  # while a block copy from the host or disk tier runs: collect it within a millisecond
MAX_INPUTS_PER_LOOP = 4096  # bound one drain so a flood of requests cannot starve step()
GC_GEN0_THRESHOLD = 20_000  # allocations between young collections (Python's default: 700)


class EngineProcSpec(msgspec.Struct, frozen=True):
    ipc_dir: str
    key_hex: str
    num_lanes: int
    config: EngineConfig
    lane_sndhwm: int = LANE_SNDHWM
    disagg: DisaggEngineSpec | None = None  # None: no KV-transfer agent (an aggregated worker)
    ranks: RankEnv | None = None  # rank 0 of a tensor-parallel group; None: one rank
    rank_key_hex: str | None = None  # the followers' link key (default: the worker key)
    rank_start_timeout: float = 600.0  # followers connected, shards loaded


class EngineProc:
    """The busy loop. Owns the core and the engine's sockets."""

    def __init__(self, core: EngineCore, paths: IpcPaths, key: bytes, num_lanes: int, ctx: zmq.Context,
                 launcher_pid: int | None = None, lane_sndhwm: int = LANE_SNDHWM,
                 kv_agent: KVTransferAgent | None = None, rank_link: LeaderLink | None = None) -> None:
        self.core = core
        self.rank_link = rank_link
        self.kv_agent = kv_agent
        self.num_lanes = num_lanes
        self.should_stop = False
        self.launcher_gone = False  # the launcher died without cleaning up: the engine does
        self.num_steps = 0
        self.num_lane_drops = 0
        self.num_lane_aborts = 0
        self._ingress_codec: FrameCodec = FrameCodec(key, IngressMessage, "engine ingress")
        self._control_codec: FrameCodec = FrameCodec(key, ControlRequest, "engine control")
        self._lane_codec: FrameCodec = FrameCodec(key, OutputBatch, "engine lanes")
        self._reply_codec: FrameCodec = FrameCodec(key, ControlReply, "engine control replies")
        self._ingress = ctx.socket(zmq.PULL)
        self._ingress.setsockopt(zmq.RCVHWM, INGRESS_HWM)
        self._ingress.setsockopt(zmq.LINGER, 0)
        self._ingress.bind(paths.ingress)
        self._control = ctx.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(paths.control)
        self._lanes = [connect_lane(ctx, paths, i, lane_sndhwm) for i in range(num_lanes)]
        self._live: list[set[int]] = [set() for _ in range(num_lanes)]  # unfinished ids per lane
        # request id -> (engine-side Request, arrival time): the finishing output carries its timing
        self._timings: dict[int, tuple[Request, float]] = {}
        self._pending: list[RequestOutput] = []  # rejections to send with the next batch
        self._poller = zmq.Poller()
        self._poller.register(self._ingress, zmq.POLLIN)
        self._poller.register(self._control, zmq.POLLIN)
        if kv_agent is not None:
            kv_agent.register(self._poller)  # KV-transfer traffic wakes the loop too
        if rank_link is not None:  # a follower's message or lost connection wakes it too
            self._poller.register(rank_link.sock, zmq.POLLIN)
            self._poller.register(rank_link.monitor, zmq.POLLIN)
        self._heartbeat = Heartbeat(ctx, paths, key, num_lanes, launcher_pid, self._on_launcher_gone)

    def _on_launcher_gone(self) -> None:
        log.error("the launcher is gone: stopping the engine")
        self.launcher_gone = True
        self.should_stop = True

    @property
    def num_rejected_frames(self) -> int:
        return self._ingress_codec.num_rejected + self._control_codec.num_rejected

    def run(self) -> int:
        self._heartbeat.start()
        trimmer = MemoryTrimmer()  # freed heap pages back to the system every half-minute (workers.allocator)
        try:
            while not self.should_stop:
                trimmer.tick()
                core = self.core
                busy = bool(self._pending) or (core.has_work() and not core.stalled)
                busy = busy or (self.kv_agent is not None and self.kv_agent.has_work())
                self._poll_inputs(timeout_ms=0 if busy else self._idle_timeout_ms())
                if self.rank_link is not None:
                    self.rank_link.check()
                if self.kv_agent is not None:
                    self.kv_agent.tick()
                if not self.should_stop and (self._pending or self.core.has_work()):
                    self._step()
        finally:
            self._heartbeat.stop()
            for sock in (self._ingress, self._control, *self._lanes):
                sock.close(linger=0)
            if self.kv_agent is not None:
                self.kv_agent.close()
            if self.rank_link is not None:
                self.rank_link.stop()
            self.core.close()
        log.info("engine loop stopped after %d steps", self.num_steps)
        return 0

    def _idle_timeout_ms(self) -> int:
        """How long to block in poll with nothing to step. A stalled core (requests wait for
        blocks) wakes at the earliest parked expiry, which frees blocks without any input;
        acks, inputs and KV traffic wake the poll themselves. Any wake-up is followed by a step."""
        if self.core.onboarding:
            return ONBOARD_POLL_MS  # a tier copy finishes on its thread, with no input to wake the poll
        if not self.core.stalled:
            return IDLE_POLL_MS
        deadline = self.core.next_parked_deadline()
        if deadline is None:
            return IDLE_POLL_MS
        return max(0, min(IDLE_POLL_MS, math.ceil((deadline - time.time()) * 1000)))

    def _poll_inputs(self, timeout_ms: int) -> None:
        events = dict(self._poller.poll(timeout_ms))
        if self._ingress in events:
            # recv_multipart's loop, with the socket's methods bound once a drain: one message per
            # request, and its keyword arguments cost a fifth of the receive.
            recv, more = self._ingress.recv, self._ingress.getsockopt
            for _ in range(MAX_INPUTS_PER_LOOP):
                try:
                    frames = [recv(zmq.NOBLOCK)]
                except zmq.Again:
                    break
                while more(zmq.RCVMORE):
                    frames.append(recv(zmq.NOBLOCK))
                message = self._ingress_codec.decode(frames)
                if message is not None:
                    self._handle_input(message)
        if self._control in events:
            while True:
                try:
                    identity, *frames = self._control.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                request = self._control_codec.decode(frames)
                if request is not None:
                    reply = self._handle_control(request)
                    self._control.send_multipart([identity, *self._reply_codec.encode(reply)], flags=zmq.NOBLOCK)

    def _handle_input(self, message: IngressMessage) -> None:
        if isinstance(message, (AddRequest, AddContextRequest, AddRemoteRequest, AddResumedRequest)):
            request = message.request
            lane = request.request_id >> FRONTEND_SHIFT  # lane_of and _add_to_core's common case, inlined: per request
            if not 0 <= lane < self.num_lanes:
                lane = 0
            arrival = time.time()
            try:
                if type(message) is AddRequest:
                    engine_request = self.core.add_request(request)
                else:
                    engine_request = self._add_to_core(message)
            except Exception as exc:  # a failing request must not take the engine down
                # Known faults of a request are rejections the core reports itself (RejectReason):
                # an exception here is the engine's own, answered 500 (retried on another worker).
                log.exception("request %d failed to start: %s", request.request_id, exc,
                              extra={"request_id": request.x_request_id})
                self._pending.append(RequestOutput(request.request_id, [], FinishReason.ABORT,
                                                   error=f"{type(exc).__name__}: {exc}",
                                                   timing=EngineTiming(arrival, None, None, time.time()),
                                                   reject_reason=RejectReason.INTERNAL))
                return
            self._live[lane].add(request.request_id)
            self._timings[request.request_id] = (engine_request, arrival)
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                if request_id in self._live[lane_of(request_id, self.num_lanes)]:
                    if self.kv_agent is not None:
                        self.kv_agent.abort(request_id)  # a pull in flight: free the ctx side too
                    self.core.abort(request_id)
        elif isinstance(message, FrontendHello):
            if 0 <= message.frontend_id < self.num_lanes:
                self._abort_lane(message.frontend_id)
                send_nowait(self._lanes[message.frontend_id], self._lane_codec, OutputBatch([], time.time()))

    def _step(self) -> None:
        outputs = self._pending + (self.core.step() if self.core.has_work() else [])
        self._pending = []
        if self.kv_agent is not None:
            self.kv_agent.on_outputs(outputs)
        self.num_steps += 1
        num_lanes = self.num_lanes
        batches: list[list[RequestOutput]] = [[] for _ in range(num_lanes)]
        appends = [batch.append for batch in batches]  # (bound once a step, not looked up per output)
        for output in outputs:
            lane = output.request_id >> FRONTEND_SHIFT  # workers.client_ids.lane_of, inlined: per output
            if lane >= num_lanes or lane < 0:  # a negative id too: ingress put it in lane 0's live set
                lane = 0
            appends[lane](output)
            if output.finish_reason is not None:
                self._live[lane].discard(output.request_id)
                self._stamp_timing(output)
        now = time.time()
        for lane, batch in enumerate(batches):
            if batch and not send_nowait(self._lanes[lane], self._lane_codec, OutputBatch(batch, now)):
                self._drop_lane(lane, len(batch))

    def _add_to_core(self, message: AddRequest | AddContextRequest | AddRemoteRequest | AddResumedRequest
                     ) -> Request:
        if isinstance(message, AddRequest):
            return self.core.add_request(message.request)
        if isinstance(message, AddResumedRequest):  # prefilled here: no KV transfer involved
            return self.core.add_request(message.request, output_token_ids=message.output_token_ids)
        if self.kv_agent is None:
            raise ValueError("this worker has no KV-transfer agent: start it with a cluster key to serve "
                             "disaggregated requests")
        if isinstance(message, AddContextRequest):
            return self.kv_agent.add_context(message)
        return self.kv_agent.add_remote(message)

    def _stamp_timing(self, output: RequestOutput) -> None:
        entry = self._timings.pop(output.request_id, None)
        if entry is not None and output.timing is None:
            request, arrival = entry
            output.timing = self.core.timing(request, arrival)

    def _abort_lane(self, lane: int) -> None:
        """A (re)started frontend said hello: whatever its lane still runs belongs to a
        predecessor that crashed; free it now instead of decoding for nobody."""
        orphans = self._live[lane]
        if orphans:
            log.warning("frontend %d (re)started: aborting %d requests of its predecessor", lane, len(orphans))
            self._live[lane] = set()
            for request_id in orphans:
                self.core.abort(request_id)
                self._timings.pop(request_id, None)

    def _drop_lane(self, lane: int, num_outputs: int) -> None:
        """Frontend ``lane`` is not reading: drop its batch and abort its requests."""
        self.num_lane_drops += 1
        aborted = self._live[lane]
        self._live[lane] = set()
        for request_id in aborted:
            self.core.abort(request_id)
            self._timings.pop(request_id, None)
        self.num_lane_aborts += len(aborted)
        log.warning(
            "lane %d is full (frontend dead or stuck): dropped %d outputs, aborted %d requests "
            "(%d drops, %d aborts so far)", lane, num_outputs, len(aborted), self.num_lane_drops, self.num_lane_aborts,
        )

    def _handle_control(self, request: ControlRequest) -> ControlReply:
        try:
            if isinstance(request, HealthPing):
                return self._health()
            if isinstance(request, Shutdown):
                self.should_stop = True
            elif isinstance(request, DrainStats):
                return DrainReply(msgspec.Raw(msgspec.msgpack.encode(self.core.drain_stats())))
            elif isinstance(request, DrainKVEvents):
                return DrainReply(msgspec.Raw(msgspec.msgpack.encode(self.core.drain_kv_events())))
            elif isinstance(request, SnapshotKVCache):
                return DrainReply(msgspec.Raw(msgspec.msgpack.encode(self.core.kv_snapshot())))
            elif isinstance(request, StartProfile):
                self.core.start_profile(request.dir)
            elif isinstance(request, StopProfile):
                trace = self.core.stop_profile()
                return ControlAck(detail=None if trace is None else str(trace))
        except Exception as exc:  # noqa: BLE001 - answered in the ControlAck, never an engine crash
            log.warning("control request %s failed: %s: %s", type(request).__name__, type(exc).__name__, exc)
            return ControlAck(error=f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__)
        return ControlAck()

    def _health(self) -> EngineHealth:
        load = self.core.load()
        return EngineHealth(
            sum(len(s) for s in self._live), self.num_steps, self.num_rejected_frames,
            self.num_lane_drops, self.num_lane_aborts, time.time(),
            num_running=load.num_running, num_waiting=load.num_waiting,
            kv_blocks_used=load.kv_blocks_used, kv_blocks_total=load.kv_blocks_total,
            tiers=self.core.tiers.stats() if self.core.tiers is not None else None,
            num_draft_tokens=load.num_draft_tokens, num_accepted_tokens=load.num_accepted_tokens,
        )


def build_core(config: EngineConfig, rank_link: LeaderLink | None = None,
               ranks: RankEnv | None = None, rank_start_timeout: float = 600.0) -> tuple[EngineCore, EngineInfo]:
    """The EngineCore for ``config`` and the handshake info frontends need; as rank 0 of
    ``ranks`` once every follower is ready."""
    from workers.engine.core import EngineCore
    from workers.engine.factory import build_executor, build_leader_executor

    if rank_link is None or ranks is None:
        executor = build_executor(config)
    else:
        executor = build_leader_executor(config, rank_link, ranks, rank_start_timeout)
    core = EngineCore(config, executor)
    info = EngineInfo(
        kind=config.kind,
        max_model_len=int(core.max_model_len),
        vocab_size=int(executor.vocab_size),
        eos_token_ids=sorted(int(t) for t in executor.eos_token_ids),
        block_size=int(executor.block_size),
        num_blocks=int(executor.num_blocks),
        hash_seed=int(config.cache.hash_seed),
    )
    return core, info


def run_engine(spec: EngineProcSpec, launcher_pid: int | None = None) -> int:
    """Build the core, report readiness on status.sock, run the loop until shutdown."""
    paths = IpcPaths(Path(spec.ipc_dir))
    key = bytes.fromhex(spec.key_hex)
    ctx = zmq.Context()
    status = ctx.socket(zmq.PUSH)
    status.setsockopt(zmq.LINGER, 5000)  # the ready report must reach the launcher
    status.connect(paths.status)
    status_codec: FrameCodec = FrameCodec(key, StatusMessage, "engine status")
    proc: EngineProc | None = None
    # Before the loop runs, SIGTERM ends the process (143: killed by SIGTERM); after, it stops the loop.
    signal.signal(signal.SIGTERM, lambda *_: setattr(proc, "should_stop", True) if proc else sys.exit(143))
    rank_link = None
    try:
        if spec.ranks is not None:
            rank_key = bytes.fromhex(spec.rank_key_hex or spec.key_hex)
            rank_link = LeaderLink(ctx, rank_key, spec.ranks.world_size, spec.ranks.master_addr,
                                   spec.ranks.master_port)
        core, info = build_core(spec.config.validate(), rank_link, spec.ranks, spec.rank_start_timeout)
        kv_agent = None
        if spec.disagg is not None:
            kv_agent = spec.disagg.build_agent(core, ctx)
            kv_endpoint = kv_agent.endpoint
            # Pulls across tensor-parallel layouts, head by head (DeepSeek-V4's runner: its one shared
            # KV head, the whole state, on every rank).
            if spec.config.kind == "torch" and hasattr(core.executor, "import_heads"):
                from workers.kv_rank_pulls import attach_rank_pulls

                kv_endpoint = attach_rank_pulls(kv_agent, core.executor, ctx, bytes.fromhex(spec.disagg.cluster_key_hex),
                                                spec.disagg.pull_timeout_seconds, rank_link)
            info = msgspec.structs.replace(info, role=spec.disagg.role, kv_endpoint=kv_endpoint)
            log.info("KV-transfer agent (%s role) on %s", spec.disagg.role, kv_agent.endpoint)
        proc = EngineProc(core, paths, key, spec.num_lanes, ctx, launcher_pid, spec.lane_sndhwm, kv_agent,
                          rank_link)
    except Exception as exc:
        log.exception("engine failed to start")
        if rank_link is not None:
            rank_link.stop()
        tail = "".join(traceback.format_exception(exc)[-3:]).strip()
        status.send_multipart(status_codec.encode(EngineFailed(tail)))
        status.close()
        ctx.term()
        return 1
    # What exists now (the model, the block pool, the synthetic KV) lives as long as the process:
    # out of the collector's sight, so that a full collection does not walk it again and again
    # (vLLM does the same); the loop's garbage is short-lived and cycle-free, so collections
    # can also be rarer.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 10, 10)
    release_memory()  # what loading the model freed (a GGUF's dequantized copies: ~180 MB for SmolLM2-135M)
    status.send_multipart(status_codec.encode(EngineReady(info, os.getpid())))
    status.close()
    log.info("engine ready: %s", info)
    try:
        return proc.run()
    except RankLost as exc:
        log.error("stopping the engine: %s", exc)
        return 1
    finally:
        ctx.term()
        if proc.launcher_gone:
            shutil.rmtree(paths.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.engine_proc", description="the disagg engine process")
    parser.add_argument("--spec", required=True, help="EngineProcSpec JSON file (mode 0600; deleted once read)")
    parser.add_argument("--launcher-pid", type=int, default=None, help="stop when this parent process is gone")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format, "engine", "%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    spec_path = Path(args.spec)
    spec = msgspec.json.decode(spec_path.read_bytes(), type=EngineProcSpec)
    spec_path.unlink()
    return run_engine(spec, args.launcher_pid)


if __name__ == "__main__":
    raise SystemExit(main())
