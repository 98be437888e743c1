"""Perf records: batching on the frontend, a bounded drain-on-read store on the launcher, perf.sock."""

from __future__ import annotations

import asyncio
import time

import pytest

from frontends.perf_records import FLUSH_SECONDS, MAX_BATCH, PerfReceiver, PerfRecorder, PerfSender, PerfStore
from workers.ipc import IpcPaths
from workers.protocol import PerfRecord


def record(i: int, finished: float | None = None) -> PerfRecord:
    finished = time.time() if finished is None else finished
    return PerfRecord(i, 1, finished - 0.6, finished - 0.5, finished - 0.4, finished - 0.3, finished - 0.2,
                      finished - 0.1, finished, 10, 5, 0, "stop")


def test_the_store_is_bounded_and_drained_on_read():
    store = PerfStore(max_records=3)
    store.extend([record(i) for i in range(5)])
    assert [r.request_id for r in store.drain()] == [2, 3, 4]  # the oldest went first
    assert store.drain() == []
    assert store.num_received == 5


def test_unread_records_past_their_age_are_dropped():
    store = PerfStore(max_records=100, max_age_seconds=60)
    now = time.time()
    store.extend([record(0, now - 120), record(1, now - 61), record(2, now - 30)])
    assert len(store) == 1
    store.extend([record(3, now)])
    store.drop_expired(now + 45)  # record 2 is 75 s old by then
    assert [r.request_id for r in store.drain()] == [3]
    assert store.num_received == 4


@pytest.mark.asyncio
async def test_the_recorder_observes_at_once_and_ships_in_batches():
    shipped: list[list[int]] = []
    observed: list[int] = []
    recorder = PerfRecorder(lambda b: shipped.append([r.request_id for r in b]), lambda r: observed.append(r.request_id))
    for i in range(3):
        recorder.add(record(i))
    assert observed == [0, 1, 2] and shipped == []
    await asyncio.sleep(FLUSH_SECONDS * 3)
    assert shipped == [[0, 1, 2]]
    for i in range(MAX_BATCH):
        recorder.add(record(i))
    assert shipped[1] == list(range(MAX_BATCH))  # a full batch goes at once


@pytest.mark.asyncio
async def test_records_cross_perf_sock_and_forged_ones_do_not(tmp_path):
    paths = IpcPaths(tmp_path)
    store = PerfStore()
    receiver = PerfReceiver(paths.perf, b"k" * 32, store)
    receiver.start()
    good, forged = PerfSender(paths.perf, b"k" * 32, 1), PerfSender(paths.perf, b"x" * 32, 1)
    good.open()
    forged.open()
    try:
        forged.send([record(99)])
        good.send([record(1), record(2)])
        for _ in range(100):
            if store.num_received:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
    finally:
        good.close()
        forged.close()
        await receiver.close()
    assert [r.request_id for r in store.drain()] == [1, 2]
