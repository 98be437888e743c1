"""Per-request perf records: built by every frontend, kept by the launcher.

A record is a request's timeline: frontend arrival, tokenization done (sent
to the engine), the engine's arrival / first scheduled / first token times
(``EngineTiming`` on the finishing output), the last token and the finish as
the frontend saw them, and token counts. Every frontend builds its records in
``EngineClient.generate`` and hands them to a ``PerfRecorder``, which observes
them (Prometheus) and ships them in batches: frontend 0 straight into the
launcher's ``PerfStore``, attached frontends over ``perf.sock`` (HMAC-checked
``PerfRecordBatch``, received by ``PerfReceiver``). ``GET /perf_metrics``
drains the store: each record is returned once, by whichever frontend answers.
The store is bounded by count and by age (``--max-perf-records``,
``--perf-record-seconds``): when nobody reads it, the oldest records go first,
so a launcher under steady load without a reader holds at most a few MB of
them instead of growing for hours.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from workers.ipc import FrameCodec, send_nowait
from workers.protocol import PerfRecord, PerfRecordBatch, RequestOutput

__all__ = ["build_record", "record_to_dict", "PerfRecorder", "PerfStore", "PerfSender", "PerfReceiver"]

log = logging.getLogger("disagg.perf")

FLUSH_SECONDS = 0.05  # how long a record may wait for others to share its message
MAX_BATCH = 256
MAX_STORED_RECORDS = 10_000  # ~3 MB of records; a reader polling every minute keeps up with 150 requests/s
MAX_RECORD_AGE_SECONDS = 600.0  # a record nobody read in ten minutes has no reader

def build_record(request_id: int, frontend_id: int, arrival: float, tokenized: float, num_prompt_tokens: int,
                 num_output_tokens: int, last_token: float | None, last: RequestOutput | None,
                 num_cached_tokens: int = 0, x_request_id: str | None = None) -> PerfRecord:
    """The record of a request that just ended; ``last`` is the last output received (None: none).
    ``num_cached_tokens``: the prefix-cache hits, which the engine reports on the first output only.
    ``x_request_id``: the request's x-request-id header (the orchestrator joins its record on it)."""
    timing = last.timing if last is not None else None
    kv = last.kv_transfer if last is not None else None
    recomputed = kv is not None and kv.recomputed
    if recomputed:
        kv = None  # no transfer to report: its figures would skew the transfer histograms
    return PerfRecord(
        request_id=request_id,
        frontend_id=frontend_id,
        frontend_arrival=arrival,
        tokenized=tokenized,
        engine_arrival=timing.arrival if timing else None,
        first_scheduled=timing.first_scheduled if timing else None,
        first_token=timing.first_token if timing else None,
        last_token=last_token,
        finished=time.time(),
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        num_cached_tokens=num_cached_tokens,
        finish_reason=last.finish_reason if last is not None else None,
        kv_transfer_seconds=kv.seconds if kv else None,
        kv_transfer_bytes=kv.num_bytes if kv else 0,
        kv_transfer_blocks=kv.num_blocks if kv else 0,
        kv_transfer_bytes_per_second=kv.bytes_per_second if kv else None,
        kv_recomputed=recomputed,
        x_request_id=x_request_id,
    )


def record_to_dict(record: PerfRecord) -> dict[str, Any]:
    """JSON object form (the wire form is an array)."""
    return {name: getattr(record, name) for name in record.__struct_fields__}


class PerfStore:
    """The launcher's records from all frontends, drained on read; at most ``max_records``, none
    finished more than ``max_age_seconds`` ago (None: the defaults)."""

    def __init__(self, max_records: int | None = None, max_age_seconds: float | None = None) -> None:
        self._records: deque[PerfRecord] = deque(maxlen=max_records or MAX_STORED_RECORDS)
        self.max_age_seconds = max_age_seconds or MAX_RECORD_AGE_SECONDS
        self.num_received = 0

    def extend(self, records: Sequence[PerfRecord]) -> None:
        self._records.extend(records)
        self.num_received += len(records)
        self.drop_expired(time.time())

    def drop_expired(self, now: float) -> None:
        # Records arrive about in finish order: the oldest are on the left.
        horizon = now - self.max_age_seconds
        records = self._records
        while records and records[0].finished < horizon:
            records.popleft()

    def __len__(self) -> int:
        return len(self._records)

    def drain(self) -> list[PerfRecord]:
        records = list(self._records)
        self._records.clear()
        return records


class PerfRecorder:
    """A frontend's outlet for finished requests: observe each at once, ship in batches."""

    def __init__(self, ship: Callable[[list[PerfRecord]], None],
                 observe: Callable[[PerfRecord], None] | None = None) -> None:
        self._ship = ship
        self._observe = observe
        self._batch: list[PerfRecord] = []
        self._flush_handle: asyncio.TimerHandle | None = None

    def add(self, record: PerfRecord) -> None:
        if self._observe is not None:
            self._observe(record)
        self._batch.append(record)
        if len(self._batch) >= MAX_BATCH:
            self.flush()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._batch:
            batch, self._batch = self._batch, []
            self._ship(batch)


class PerfSender:
    """An attached frontend's PUSH to the launcher's perf.sock (never blocks).

    The socket exists between ``open()`` and ``close()`` (the app's lifespan): a
    zmq context left to the garbage collector with a live socket hangs in ``term()``."""

    def __init__(self, address: str, key: bytes, frontend_id: int) -> None:
        self._address = address
        self._codec: FrameCodec[PerfRecordBatch] = FrameCodec(key, PerfRecordBatch, f"frontend {frontend_id} perf")
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self.num_dropped = 0

    def open(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 1000)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.connect(self._address)

    def send(self, records: list[PerfRecord]) -> None:
        if self._sock is None or not send_nowait(self._sock, self._codec, PerfRecordBatch(records)):
            self.num_dropped += len(records)  # not open, or the launcher is not reading: best effort

    def close(self) -> None:
        if self._ctx is not None and self._sock is not None:  # open() sets both
            self._sock.close()
            self._ctx.term()
            self._ctx = self._sock = None


class PerfReceiver:
    """The launcher's PULL on perf.sock, feeding ``store`` from a task."""

    def __init__(self, address: str, key: bytes, store: PerfStore) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._codec: FrameCodec[PerfRecordBatch] = FrameCodec(key, PerfRecordBatch, "launcher perf")
        self._store = store
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="perf-receiver")

    async def _run(self) -> None:
        while True:
            batch = self._codec.decode(await self._sock.recv_multipart())
            if batch is not None:
                self._store.extend(batch.records)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()


def encode_records(records: list[PerfRecord]) -> bytes:
    return msgspec.json.encode([record_to_dict(r) for r in records])
