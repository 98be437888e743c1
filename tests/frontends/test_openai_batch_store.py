"""The OpenAI Files and Batches state on disk, in-process: ``FileStore`` (orphans, pages, replacing a
file under its id), ``BatchStore.create`` with settled requests, and ``OpenAIBatches``' restart paths
(a batch left validating, one whose requests ended before its files were written) over a real
SQLite directory, with an executor that answers each line at once (the orchestrator's runs it through
its flow: tests/orchestrator/test_openai_batches.py)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from api.batches import BatchStore
from api.batches.files import FileStore
from api.batches.openai_batches import OpenAIBatches
from api.batches.openai_lines import response_line
from api.batches.openai_schemas import CreateBatchBody, InputLine
from api.batches.openai_store import Stage


def test_file_store_pages_replaces_and_drops_orphans(tmp_path):
    store = FileStore(tmp_path)
    ids = [store.add(f"f{i}.jsonl", "batch" if i % 2 == 0 else "user_data", [b"x" * i], float(i)).id
           for i in range(5)]
    page, more = store.list(2)
    assert [r.id for r in page] == [ids[4], ids[3]] and more
    page, more = store.list(10, after=ids[3], purpose="batch")
    assert [r.id for r in page] == [ids[2], ids[0]] and not more
    assert [r.id for r in store.list(10, newest_first=False)[0]] == ids
    assert store.list(10, after="file-nope") is None
    replaced = store.add("again.jsonl", "batch_output", [b"a", b"bc"], 9.0, file_id=ids[0])
    assert replaced.bytes == 3 and store.read(ids[0]) == b"abc" and len(store.list(10)[0]) == 5
    store.close()

    (tmp_path / "files" / "file-orphan").write_bytes(b"left by a crash")
    (tmp_path / "files" / "file-x.partial").write_bytes(b"cut short")
    store = FileStore(tmp_path)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(ids)
    assert store.delete(ids[1]) and not store.delete(ids[1]) and not (tmp_path / "files" / ids[1]).exists()
    store.close()


def test_batch_store_create_with_settled_requests(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3", id_prefix="batch_")
    record = store.create([("a", b"{}"), ("", b"not json"), ("c", b"{}")], 1.0,
                          settled={1: ("errored", b'{"bad": 1}')}, batch_id="batch_mine")
    assert record.id == "batch_mine" and record.request_counts.processing == 2 and record.request_counts.errored == 1
    assert store.pending_indices("batch_mine") == [0, 2]
    assert [(r.idx, r.state, r.result) for r in store.results("batch_mine", None, 10)] == [(1, "errored", b'{"bad": 1}')]
    store.close()


class AnswerAtOnce:
    """Answers each line with its own body, 200 (a 400 when the body says so)."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def is_ready(self) -> bool:
        return True

    async def execute(self, params: bytes, request_id: str):
        line = msgspec.json.decode(params, type=InputLine)
        self.ran.append(line.custom_id)
        status = 400 if b"reject" in bytes(line.body) else 200
        return response_line(line.custom_id, status, request_id, bytes(line.body))


def _line(custom_id: str, **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": body or {"n": custom_id}}).encode()


async def _until(predicate, timeout: float = 10.0):
    for _ in range(int(timeout / 0.02)):
        if value := await predicate():
            return value
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def _create(batches: OpenAIBatches, content: bytes):
    source = await asyncio.to_thread(batches.files.add, "in.jsonl", "batch", [content], 1.0)
    return await batches.create(msgspec.convert({"input_file_id": source.id, "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"}, CreateBatchBody))


@pytest.mark.asyncio
async def test_lifecycle_and_files(tmp_path):
    executor = AnswerAtOnce()
    batches = OpenAIBatches(tmp_path, executor)
    await batches.start()
    content = b"\n".join([_line("a"), b"{oops", _line("b", reject=True), _line("a")])
    created = await _create(batches, content)
    assert created.status == "validating"

    async def completed():
        batch = await batches.get(created.id)
        return batch if batch.status == "completed" else None

    done = await _until(completed)
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 1, 3)
    assert executor.ran == ["a", "b"]
    output = [json.loads(x) for x in batches.files.read(done.output_file_id).splitlines()]
    errors = [json.loads(x) for x in batches.files.read(done.error_file_id).splitlines()]
    assert [x["custom_id"] for x in output] == ["a"] and output[0]["response"]["body"] == {"n": "a"}
    assert done.usage.total_tokens == 0  # the answer reported no usage
    assert [(x["custom_id"], x["response"] and x["response"]["status_code"]) for x in errors] == [
        (None, None), ("b", 400), ("a", None)]
    assert "line 2" in errors[0]["error"]["message"] and "not unique" in errors[2]["error"]["message"]
    await batches.close()


@pytest.mark.asyncio
async def test_restart_validates_and_finalizes_what_was_left(tmp_path):
    batches = OpenAIBatches(tmp_path, AnswerAtOnce())  # not started: nothing runs, as after a crash
    source = await asyncio.to_thread(batches.files.add, "in.jsonl", "batch", [_line("a") + b"\n" + _line("b")], 1.0)
    left_validating = await asyncio.to_thread(batches.meta.create, "batch_left", "/v1/chat/completions", source.id,
                                              "24h", None, 1.0, 3600.0)
    # A second batch whose requests ended, its files never written (a crash inside the end hook).
    await asyncio.to_thread(batches.meta.create, "batch_ended", "/v1/chat/completions", source.id, "24h", None,
                            1.0, 3600.0)
    store = batches.runner.store
    await asyncio.to_thread(store.create, [("a", _line("a"))], 1.0, 3600.0,
                            {0: response_line("a", 200, "r", b"{}")}, "batch_ended")
    await asyncio.to_thread(store.end_if_done, "batch_ended", 2.0)
    await asyncio.to_thread(batches.meta.set_running, "batch_ended")
    await batches.runner.close()
    batches.files.close()

    batches = OpenAIBatches(tmp_path, AnswerAtOnce())
    await batches.start()
    for batch_id, completed in ((left_validating.id, 2), ("batch_ended", 1)):
        async def done(batch_id=batch_id):
            batch = await batches.get(batch_id)
            return batch if batch.status == "completed" else None

        batch = await _until(done)
        assert batch.request_counts.completed == completed and batch.output_file_id
    assert (await asyncio.to_thread(batches.meta.get, "batch_ended")).stage is Stage.FINALIZED
    await batches.close()


@pytest.mark.asyncio
async def test_cancel_while_validating_ends_cancelled_without_files(tmp_path):
    batches = OpenAIBatches(tmp_path, AnswerAtOnce())
    source = await asyncio.to_thread(batches.files.add, "in.jsonl", "batch", [_line("a")], 1.0)
    row = await asyncio.to_thread(batches.meta.create, "batch_c", "/v1/chat/completions", source.id, "24h", None,
                                  1.0, 3600.0)
    cancelled = await batches.cancel(row.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at and cancelled.output_file_id is None
    await batches.close()


@pytest.mark.asyncio
async def test_a_batch_past_its_window_expires_with_batch_expired_lines(tmp_path):
    executor = AnswerAtOnce()
    batches = OpenAIBatches(tmp_path, executor, ttl_seconds=0.0)  # the window ends as it opens
    await batches.start()
    created = await _create(batches, b"\n".join([_line("a"), _line("b")]))

    async def expired():
        batch = await batches.get(created.id)
        return batch if batch.status == "expired" else None

    batch = await _until(expired)
    assert executor.ran == [] and batch.expired_at and batch.output_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (2, 0, 0)
    errors = [json.loads(x) for x in batches.files.read(batch.error_file_id).splitlines()]
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [("a", "batch_expired"), ("b", "batch_expired")]
    await batches.close()
