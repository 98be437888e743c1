"""The engine process through its real sockets (synthetic engine, no frontends)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from workers.client_ids import make_client_id
from workers.config import EngineConfig, SyntheticConfig
from workers.ipc import FrameCodec
from workers.launcher import LaunchError, WorkerGroup
from workers.protocol import (
    AbortRequests,
    AddRequest,
    EngineHealth,
    EngineRequest,
    FinishReason,
    HealthPing,
    IngressMessage,
    OutputBatch,
    RejectReason,
    RequestOutput,
)
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class RawFrontend:
    """A frontend's two sockets, without the frontend: lane PULL bound, ingress PUSH connected."""

    def __init__(self, group: WorkerGroup, frontend_id: int, ctx: zmq.Context) -> None:
        self.lane = ctx.socket(zmq.PULL)
        self.lane.setsockopt(zmq.LINGER, 0)
        self.lane.bind(group.paths.lane(frontend_id))
        self.ingress = ctx.socket(zmq.PUSH)
        self.ingress.setsockopt(zmq.LINGER, 0)
        self.ingress.connect(group.paths.ingress)
        self.codec: FrameCodec = FrameCodec(group.key, IngressMessage, "test ingress")
        self.lane_codec: FrameCodec = FrameCodec(group.key, OutputBatch, "test lane")

    def add(self, request_id: int, params: SamplingParams = GREEDY) -> None:
        self.ingress.send_multipart(self.codec.encode(AddRequest(EngineRequest(request_id, [1, 2, 3], params))))

    def collect(self, request_ids: set[int], timeout: float = 10.0) -> dict[int, list[RequestOutput]]:
        """Outputs until every id in ``request_ids`` finished (heartbeats skipped)."""
        outputs: dict[int, list[RequestOutput]] = {}
        unfinished = set(request_ids)
        deadline = time.monotonic() + timeout
        while unfinished:
            assert self.lane.poll(max(0.0, deadline - time.monotonic()) * 1000), f"no output for {unfinished}"
            batch = self.lane_codec.decode(self.lane.recv_multipart())
            for output in batch.outputs:
                outputs.setdefault(output.request_id, []).append(output)
                if output.finish_reason is not None:
                    unfinished.discard(output.request_id)
        return outputs


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def start_group(num_lanes: int, **kwargs) -> WorkerGroup:
    group = WorkerGroup(EngineConfig(kind="synthetic"), num_lanes, "127.0.0.1", 1, grace_seconds=1.0, **kwargs)
    group.start_engine(timeout=30.0)
    return group


def health(group: WorkerGroup) -> EngineHealth:
    reply = group.control(HealthPing())
    assert isinstance(reply, EngineHealth)
    return reply


def test_forged_frames_are_dropped_and_counted_while_the_engine_keeps_serving(zmq_ctx):
    with start_group(1) as group:
        frontend = RawFrontend(group, 0, zmq_ctx)
        forger: FrameCodec = FrameCodec(b"f" * 32, IngressMessage, "forger")
        forged = AddRequest(EngineRequest(100, [1, 2], GREEDY))
        frontend.ingress.send_multipart(forger.encode(forged))
        frontend.ingress.send_multipart([b"not a mac", b"\x93\x01\x02\x03"])
        # Wrong frame counts, one of them a genuine message with a frame too many: each is one message.
        frontend.ingress.send_multipart([b"one frame"])
        genuine = AddRequest(EngineRequest(101, [1, 2], GREEDY))
        frontend.ingress.send_multipart([*FrameCodec(group.key, IngressMessage, "t").encode(genuine), b"extra"])
        frontend.add(1)
        outputs = frontend.collect({1})
        assert set(outputs) == {1}  # nothing for the forged request 100 nor the three-frame 101
        assert sum(len(o.new_token_ids) for o in outputs[1]) == 4
        assert outputs[1][-1].finish_reason == "length"
        status = health(group)
        assert status.num_rejected_frames == 4
        assert status.num_unfinished == 0


def test_outputs_go_to_their_frontends_lane_and_unroutable_ids_to_lane_zero(zmq_ctx):
    with start_group(2) as group:
        lane0, lane1 = RawFrontend(group, 0, zmq_ctx), RawFrontend(group, 1, zmq_ctx)
        own0, own1, unroutable = make_client_id(0, 1), make_client_id(1, 1), make_client_id(5, 1)
        lane0.add(own0)
        lane1.add(own1)
        lane1.add(unroutable)  # frontend 5 has no lane in a 2-frontend worker
        lane1.add(-3)  # a negative id (msgspec decodes any int) has no frontend either
        assert set(lane0.collect({own0, unroutable, -3})) == {own0, unroutable, -3}
        assert set(lane1.collect({own1})) == {own1}
        assert health(group).num_unfinished == 0  # each finished request left its lane's live set


def test_a_full_lane_drops_its_outputs_and_aborts_its_requests(zmq_ctx):
    # Frontend 1 never binds its lane (it died before it came up): with a
    # high-water mark of 50 the engine's 51st send to it fails at once.
    slow = SyntheticConfig(decode_step_base_seconds=0.01)
    group = WorkerGroup(EngineConfig(kind="synthetic", synthetic=slow), 2, "127.0.0.1", 1, grace_seconds=1.0,
                        lane_sndhwm=50)
    with group:
        group.start_engine(timeout=30.0)
        lane0 = RawFrontend(group, 0, zmq_ctx)
        lane0.ingress.send_multipart(lane0.codec.encode(
            AddRequest(EngineRequest(make_client_id(1, 0), [1, 2, 3], SamplingParams(max_tokens=1000)))))
        deadline = time.monotonic() + 10.0
        while (status := health(group)).num_lane_aborts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status.num_lane_aborts == 1
        assert status.num_lane_drops >= 1
        while health(group).num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health(group).num_unfinished == 0
        lane0.add(7)  # the engine still serves everyone else
        assert lane0.collect({7})[7][-1].finish_reason == "length"


def test_an_engine_that_fails_to_start_names_the_error_and_leaves_nothing(tmp_path):
    group = WorkerGroup(EngineConfig(kind="torch", model=str(tmp_path / "missing")), 1, "127.0.0.1", 1)
    with pytest.raises(LaunchError, match="the engine failed to start") as failure:
        with group:
            group.start_engine(timeout=60.0)
    assert "missing" in str(failure.value)
    assert not group.paths.dir.exists()
    assert group.engine is not None and group.engine.popen.returncode == 1


def test_control_drains_stats_and_kv_events_once(zmq_ctx):
    from workers.engine.kv_events import KVEvent
    from workers.engine.stats import IterationStats
    from workers.protocol import DrainKVEvents, DrainReply, DrainStats

    with start_group(1) as group:
        frontend = RawFrontend(group, 0, zmq_ctx)
        frontend.add(1, SamplingParams(max_tokens=40, temperature=0.0))  # 43 tokens: 2 full blocks
        frontend.collect({1})
        first, second = group.control(DrainStats()), group.control(DrainStats())
        assert isinstance(first, DrainReply) and isinstance(second, DrainReply)
        stats = msgspec.msgpack.decode(first.items, type=list[IterationStats])
        assert sum(s.num_decode_tokens + s.num_prefill_tokens for s in stats) >= 40
        assert msgspec.msgpack.decode(second.items, type=list[IterationStats]) == []
        events = group.control(DrainKVEvents())
        assert isinstance(events, DrainReply)
        decoded = msgspec.msgpack.decode(events.items, type=list[KVEvent])
        assert len(decoded) >= 1
        assert [e.event_id for e in decoded] == list(range(len(decoded)))


def test_an_exception_adding_a_request_is_the_engines_own_error_and_the_engine_serves_on(zmq_ctx, capfd):
    """A request the core cannot add (here: its id is already in the engine, a frontend's bug) ends with
    ``RejectReason.INTERNAL``, which a frontend answers 500 (retried elsewhere), not the client's 400;
    the engine logs its traceback."""
    slow = SyntheticConfig(decode_step_base_seconds=0.01)
    group = WorkerGroup(EngineConfig(kind="synthetic", synthetic=slow), 1, "127.0.0.1", 1, grace_seconds=1.0)
    with group:
        group.start_engine(timeout=30.0)
        frontend = RawFrontend(group, 0, zmq_ctx)
        frontend.add(1, SamplingParams(max_tokens=1000))
        frontend.add(1)  # the same id again, while the first runs
        [rejected] = [o for o in frontend.collect({1})[1] if o.finish_reason is not None]
        assert (rejected.finish_reason, rejected.reject_reason) == (FinishReason.ABORT, RejectReason.INTERNAL)
        assert not rejected.reject_reason.is_client_error
        assert rejected.error == "ValueError: request id 1 is already in the engine"
        logged = capfd.readouterr().err
        assert "request 1 failed to start" in logged and "Traceback (most recent call last)" in logged
        frontend.ingress.send_multipart(frontend.codec.encode(AbortRequests([1])))
        frontend.add(2, SamplingParams(max_tokens=0))  # the request's own fault: a known rejection
        assert frontend.collect({2})[2][-1].reject_reason is RejectReason.INVALID_SAMPLING_PARAMS
        frontend.add(7)
        assert frontend.collect({7})[7][-1].finish_reason == "length"
