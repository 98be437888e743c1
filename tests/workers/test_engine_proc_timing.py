"""Engine-process additions for launcher-owned state: engine timing on the finishing output,
gauges in the health reply, and a (re)started frontend's hello freeing its predecessor's requests."""

from __future__ import annotations

import time

import pytest
import zmq
from test_engine_proc import RawFrontend, health, start_group

from workers.client_ids import make_client_id
from workers.config import EngineConfig, SyntheticConfig
from workers.launcher import WorkerGroup
from workers.protocol import FrontendHello
from workers.sampling_params import SamplingParams


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_the_finishing_output_carries_the_engine_timing(zmq_ctx):
    with start_group(1) as group:
        frontend = RawFrontend(group, 0, zmq_ctx)
        sent = time.time()
        frontend.add(7)
        outputs = frontend.collect({7})[7]
    assert all(o.timing is None for o in outputs[:-1])
    timing = outputs[-1].timing
    assert sent <= timing.arrival <= timing.first_scheduled <= timing.first_token <= timing.finished <= time.time()


def test_a_hello_aborts_what_the_lane_still_runs(zmq_ctx):
    slow = EngineConfig(kind="synthetic", synthetic=SyntheticConfig(decode_step_base_seconds=0.01))
    group = WorkerGroup(slow, 2, "127.0.0.1", 1, grace_seconds=1.0)
    with group:
        group.start_engine(timeout=30.0)
        old = RawFrontend(group, 1, zmq_ctx)
        for i in range(3):
            old.add(make_client_id(1, i), SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        deadline = time.monotonic() + 5
        while health(group).num_running < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        old.ingress.send_multipart(old.codec.encode(FrontendHello(1)))  # as a respawned frontend 1 would
        deadline = time.monotonic() + 5
        while (status := health(group)).num_unfinished or status.num_running or status.kv_blocks_used:
            assert time.monotonic() < deadline, status
            time.sleep(0.02)
        assert status.kv_blocks_total > 0
