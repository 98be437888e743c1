"""The engine process alone at full concurrency: CPU per request over K lanes, no HTTP.

``benchmarks/hot_paths.py`` runs this for the engine figure (issue 17, item 2):
a real engine process (``WorkerGroup.start_engine``, synthetic, zero step
cost) and, in this process, K raw frontends (each a lane PULL bound and an
ingress PUSH: what ``frontends.engine_client`` does, without the HTTP) that
keep ``concurrency`` requests of ``max_tokens`` tokens in flight, a new one
for each that finishes. Through a worker's HTTP frontends on a small machine
the frontends, not the engine, set the pace, and the engine's batches (and
so its CPU per request) depend on how far behind they are; here the engine
is the bottleneck, which is what its ceiling means.

Engine CPU is utime + stime of its process (/proc) over the window, divided
by the requests that finished in it; the driver's own CPU is reported too.
Run alone, it prints the figure at each concurrency asked for: at a small one
(say 32) a step holds few requests, as through HTTP frontends on a small
machine, and what a step costs whatever its size (a poll, a message per lane)
is shared by fewer of them.

    python benchmarks/engine_lanes.py [--lanes 4] [--concurrency 512,32] [--duration 4] [--repeats 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time
from dataclasses import dataclass

import zmq

from workers.client_ids import make_client_id
from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SyntheticConfig
from workers.ipc import FrameCodec
from workers.launcher import WorkerGroup
from workers.protocol import AddRequest, EngineRequest, FrontendHello, IngressMessage, OutputBatch
from workers.sampling_params import SamplingParams

__all__ = ["EngineLoadResult", "measure_engine_lanes"]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMPT = list(range(1, 33))


@dataclass
class EngineLoadResult:
    num_lanes: int
    concurrency: int
    window_s: float
    requests: int
    engine_cpu_s: float
    driver_cpu_s: float
    outputs_per_request: float
    outputs_per_message: float = 0.0  # RequestOutputs per lane message: the engine's batch per lane and step

    @property
    def engine_ms_per_request(self) -> float:
        return self.engine_cpu_s / max(self.requests, 1) * 1e3


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Lanes:
    """K raw frontends over one poller: submit requests, count finished ones."""

    def __init__(self, group: WorkerGroup, num_lanes: int, ctx: zmq.Context, params: SamplingParams) -> None:
        self.params = params
        self.codec: FrameCodec = FrameCodec(group.key, IngressMessage, "bench ingress")
        self.lane_codec: FrameCodec = FrameCodec(group.key, OutputBatch, "bench lane")
        self.lanes, self.ingress, self.next_local = [], [], [0] * num_lanes
        self.poller = zmq.Poller()
        for lane_id in range(num_lanes):
            lane = ctx.socket(zmq.PULL)
            lane.setsockopt(zmq.LINGER, 0)
            lane.bind(group.paths.lane(lane_id))
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(group.paths.ingress)
            push.send_multipart(self.codec.encode(FrontendHello(lane_id)))
            self.poller.register(lane, zmq.POLLIN)
            self.lanes.append(lane)
            self.ingress.append(push)
        self.finished = 0
        self.outputs = 0
        self.messages = 0  # non-empty lane batches (heartbeats are empty)

    def submit(self, lane_id: int) -> None:
        self.next_local[lane_id] += 1
        request = EngineRequest(make_client_id(lane_id, self.next_local[lane_id]), PROMPT, self.params, time.time())
        self.ingress[lane_id].send_multipart(self.codec.encode(AddRequest(request)))

    def pump(self, until: float, refill: bool = True) -> None:
        """Read every lane until ``until``; each finished request is replaced on its lane."""
        while time.monotonic() < until:
            for lane, _ in self.poller.poll(100):
                lane_id = self.lanes.index(lane)
                while True:
                    try:
                        frames = lane.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    batch = self.lane_codec.decode(frames)
                    if batch is None:
                        continue
                    self.messages += bool(batch.outputs)
                    for output in batch.outputs:
                        self.outputs += 1
                        if output.finish_reason is not None:
                            self.finished += 1
                            if refill:
                                self.submit(lane_id)


def measure_engine_lanes(num_lanes: int = 4, concurrency: int = 512, max_tokens: int = 16, warmup_s: float = 1.0,
                         duration_s: float = 4.0, stream_interval: int = 1) -> EngineLoadResult:
    scheduler = SchedulerConfig(max_num_seqs=max(concurrency, 1), max_num_batched_tokens=max(2048, 64 * concurrency))
    if stream_interval != 1:  # (a tree before stream_interval measures at 1)
        scheduler = dataclasses.replace(scheduler, stream_interval=stream_interval)
    config = EngineConfig(kind="synthetic", cache=CacheConfig(block_size=16, num_blocks=16 * concurrency),
                          scheduler=scheduler, synthetic=SyntheticConfig(vocab_size=512, max_model_len=4096))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ctx = zmq.Context()
    group = WorkerGroup(config, num_lanes, "127.0.0.1", 1, grace_seconds=1.0, log_level="warning")
    try:
        group.start_engine(timeout=60.0)
        engine_pid = group.engine.popen.pid
        lanes = _Lanes(group, num_lanes, ctx, params)
        time.sleep(0.2)  # the hellos' replies: lanes connected both ways
        for number in range(concurrency):
            lanes.submit(number % num_lanes)
        lanes.pump(time.monotonic() + warmup_s)
        engine0, driver0, finished0, outputs0 = _cpu_seconds(engine_pid), _own_cpu(), lanes.finished, lanes.outputs
        messages0 = lanes.messages
        started = time.monotonic()
        lanes.pump(started + duration_s)
        window = time.monotonic() - started
        engine_cpu, driver_cpu = _cpu_seconds(engine_pid) - engine0, _own_cpu() - driver0
        requests = lanes.finished - finished0
        outputs = lanes.outputs - outputs0
        return EngineLoadResult(num_lanes, concurrency, window, requests, engine_cpu, driver_cpu,
                                outputs / max(requests, 1), outputs / max(lanes.messages - messages0, 1))
    finally:
        group.shutdown()
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[512])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    for _ in range(args.repeats):
        for concurrency in args.concurrency:
            r = measure_engine_lanes(args.lanes, concurrency, args.max_tokens, args.warmup, args.duration)
            print(f"engine lanes K={r.num_lanes} c={r.concurrency}: {r.engine_ms_per_request:.4f} ms CPU/req "
                  f"({r.requests / r.window_s:.0f} req/s, {r.engine_cpu_s / r.window_s:.2f} cores), driver "
                  f"{r.driver_cpu_s / max(r.requests, 1) * 1e3:.4f} ms/req, outputs/req {r.outputs_per_request:.2f}, "
                  f"outputs per lane message {r.outputs_per_message:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
