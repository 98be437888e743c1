"""The lane reader reads the clock once per lane message, not once per output: every output of a
batch is noted with the batch's arrival, and the perf records say so."""

from __future__ import annotations

import itertools

from api.admission import QueueBound
from frontends import engine_client
from frontends.engine_client import EngineClient
from workers.client_ids import ClientIdAllocator
from workers.ipc import FrameCodec
from workers.protocol import OutputBatch, PerfRecord, RequestOutput
from workers.sampling_params import SamplingParams

KEY = b"k" * 32


def bare_client(records: list[PerfRecord]) -> EngineClient:
    """An ``EngineClient`` with its lane decoder and request table, no sockets (sends succeed)."""
    client = object.__new__(EngineClient)
    client.frontend_id = 3
    client._ids = ClientIdAllocator(3)
    client._ingress = None
    client._ingress_codec = FrameCodec(KEY, OutputBatch, "test ingress")
    client._lane_codec = FrameCodec(KEY, OutputBatch, "test lane")
    client._queues = {}
    client.queue = QueueBound(None, None, "this worker")
    client._started, client.dead_reason, client.unresponsive_reason = True, None, None
    client._last_heard = client._received_at = 0.0
    client.on_request_done = records.append
    return client


def test_one_clock_read_per_lane_message(monkeypatch):
    clock = itertools.count(1000.0)
    reads: list[float] = []

    def counted_time() -> float:
        reads.append(next(clock))
        return reads[-1]

    monkeypatch.setattr(engine_client, "send_nowait", lambda *args: True)
    monkeypatch.setattr(engine_client.time, "time", counted_time)
    records: list[PerfRecord] = []
    client = bare_client(records)
    seen: list[RequestOutput] = []
    params = SamplingParams(max_tokens=2)
    handles = [client.open_stream([1, 2, 3], params, seen.append, arrival_time=1.0) for _ in range(8)]
    request_ids = list(client._queues)
    lane = FrameCodec(KEY, OutputBatch, "engine")
    reads.clear()
    client._deliver(lane.encode(OutputBatch([RequestOutput(i, [5]) for i in request_ids], 0.0)))
    assert len(reads) == 1 and len(seen) == 8
    client._deliver(lane.encode(OutputBatch([RequestOutput(i, [6], "length") for i in request_ids], 0.0)))
    assert len(reads) == 2 and len(seen) == 16
    for handle in handles:
        handle.close()  # finished: recorded, no abort
    assert [r.last_token for r in records] == [reads[1]] * 8
    assert all(r.num_output_tokens == 2 for r in records)
