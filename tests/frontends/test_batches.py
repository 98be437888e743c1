"""The Message Batches API over the real (synthetic) EngineCore in-process: HTTP through the
ASGI app, the SQLite store on disk, restarts of the runner on the same file, and the official
``anthropic`` client against a real uvicorn."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import pytest
import pytest_asyncio
import uvicorn
from http_harness import MAX_MODEL_LEN
from inproc_engine import InprocEngineClient, make_synthetic_core

from api.batches import BATCHES_FILE, BatchRunner, BatchStore, EngineBatchExecutor, batch_routes
from api.batches.store import BatchStoreBusyError
from api.serving import FrontendConfig, ServingContext
from frontends.app import build_app

pytestmark = pytest.mark.asyncio

COUNT_KEYS = ("processing", "succeeded", "errored", "canceled", "expired")


class PeakCountingClient(InprocEngineClient):
    """The in-process client, also recording the most generate() calls running at once."""

    peak_in_flight = 0

    async def generate(self, prompt_token_ids, params, arrival_time=None, make_message=None, x_request_id=None):
        async for output in super().generate(prompt_token_ids, params, arrival_time, make_message, x_request_id):
            self.peak_in_flight = max(self.peak_in_flight, self.num_in_flight)
            yield output


class Worker:
    """A launcher's batch side: engine client, store file, runner and the app, restartable."""

    def __init__(self, tiny_model_dir, tokenizer, path, decode_step_seconds: float, **runner_kwargs) -> None:
        self.core = make_synthetic_core(max_model_len=MAX_MODEL_LEN, decode_step_seconds=decode_step_seconds)
        self.client = PeakCountingClient(self.core)
        self.config = FrontendConfig.for_model_dir(tiny_model_dir)
        self.tokenizer = tokenizer
        self.path = path
        self.runner_kwargs = runner_kwargs
        self.model = self.config.served_model_name

    async def start(self) -> None:
        self.runner = BatchRunner(BatchStore(self.path),
                                  EngineBatchExecutor(ServingContext(self.client, self.tokenizer, self.config)),
                                  **self.runner_kwargs)
        self.app = build_app(self.client, self.tokenizer, self.config, extra_routes=batch_routes(self.runner))
        await self.runner.start()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://worker",
                                      timeout=10)

    async def stop_runner(self) -> None:
        await self.http.aclose()
        await self.runner.close()

    async def wait_ended(self, batch_id: str, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            batch = (await self.http.get(f"/v1/messages/batches/{batch_id}")).json()
            if batch["processing_status"] == "ended":
                return batch
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.01)

    async def wait_for(self, predicate, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.002)

    async def results(self, batch_id: str) -> list[dict]:
        response = await self.http.get(f"/v1/messages/batches/{batch_id}/results")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/x-jsonl"
        return [json.loads(line) for line in response.text.splitlines()]

    def assert_engine_idle(self) -> None:
        assert not self.core.has_unfinished()
        assert self.core.block_manager.num_used_blocks == 0
        self.core.check_integrity()


async def _make_worker(tiny_model_dir, tokenizer, tmp_path, decode_step_seconds=0.0, **runner_kwargs):
    worker = Worker(tiny_model_dir, tokenizer, tmp_path / "state" / BATCHES_FILE, decode_step_seconds,
                    **runner_kwargs)
    await worker.client.start()
    await worker.start()
    return worker


@pytest_asyncio.fixture
async def worker(tiny_model_dir, tokenizer, tmp_path):
    w = await _make_worker(tiny_model_dir, tokenizer, tmp_path)
    yield w
    await w.stop_runner()
    await w.client.close()


@pytest_asyncio.fixture
async def slow_worker(tiny_model_dir, tokenizer, tmp_path):
    """2 ms per decode step and at most 2 batch requests in flight: batches take long enough to interrupt."""
    w = await _make_worker(tiny_model_dir, tokenizer, tmp_path, decode_step_seconds=0.002, max_in_flight=2)
    yield w
    await w.stop_runner()
    await w.client.close()


def params(model: str, text: str, max_tokens: int = 8, **extra) -> dict:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}], **extra}


def without_id(message: dict) -> dict:
    """The message without its id, and its usage without the cache split (the second run hits the cache)."""
    assert message["id"].startswith("msg_")
    usage = dict(message["usage"])
    usage["input_tokens"] += usage.pop("cache_read_input_tokens")
    return {key: value for key, value in message.items() if key != "id"} | {"usage": usage}


async def test_create_runs_every_request_like_v1_messages(worker):
    requests = [{"custom_id": f"req-{i}", "params": params(worker.model, f"Question number {i}", 6 + i)}
                for i in range(4)]
    requests.append({"custom_id": "stop", "params": params(worker.model, "Hi", 20, system="Be brief.")})
    response = await worker.http.post("/v1/messages/batches", json={"requests": requests})
    assert response.status_code == 200, response.text
    created = response.json()
    assert set(created) == {"id", "type", "processing_status", "request_counts", "ended_at", "created_at",
                            "expires_at", "cancel_initiated_at", "archived_at", "results_url"}
    assert created["id"].startswith("msgbatch_") and created["type"] == "message_batch"
    assert created["processing_status"] == "in_progress" and created["results_url"] is None
    assert created["request_counts"] == {"processing": 5, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    assert created["created_at"].endswith("Z") and created["ended_at"] is None
    assert created["cancel_initiated_at"] is None and created["archived_at"] is None

    ended = await worker.wait_ended(created["id"])
    assert ended["request_counts"] == {"processing": 0, "succeeded": 5, "errored": 0, "canceled": 0, "expired": 0}
    assert ended["results_url"] == f"/v1/messages/batches/{created['id']}/results"
    assert ended["ended_at"] >= ended["created_at"] and ended["created_at"] == created["created_at"]

    lines = await worker.results(created["id"])
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in requests]
    for request, line in zip(requests, lines):
        assert line["result"]["type"] == "succeeded"
        direct = await worker.http.post("/v1/messages", json=request["params"])
        assert direct.status_code == 200
        assert without_id(line["result"]["message"]) == without_id(direct.json())
    assert lines[0]["result"]["message"]["usage"]["output_tokens"] == 6
    worker.assert_engine_idle()


async def test_invalid_params_become_errored_results(worker):
    requests = [
        {"custom_id": "ok", "params": params(worker.model, "Hello")},
        {"custom_id": "wrong-model", "params": params("no-such-model", "Hello")},
        {"custom_id": "too-long", "params": params(worker.model, "Hello", MAX_MODEL_LEN)},
        {"custom_id": "no-messages", "params": {"model": worker.model, "max_tokens": 4}},
        {"custom_id": "streaming", "params": params(worker.model, "Hello", stream=True)},
    ]
    created = (await worker.http.post("/v1/messages/batches", json={"requests": requests})).json()
    ended = await worker.wait_ended(created["id"])
    assert ended["request_counts"] == {"processing": 0, "succeeded": 1, "errored": 4, "canceled": 0, "expired": 0}
    by_id = {line["custom_id"]: line["result"] for line in await worker.results(created["id"])}
    assert by_id["ok"]["type"] == "succeeded"
    errors = {custom_id: by_id[custom_id]["error"] for custom_id in by_id if custom_id != "ok"}
    for custom_id, error in errors.items():
        assert by_id[custom_id]["type"] == "errored" and error["type"] == "error", custom_id
    assert errors["wrong-model"]["error"]["type"] == "not_found_error"
    assert "'no-such-model' does not exist" in errors["wrong-model"]["error"]["message"]
    direct = await worker.http.post("/v1/messages", json=requests[2]["params"])
    assert direct.status_code == 400 and errors["too-long"] == direct.json()
    assert errors["no-messages"]["error"] == {
        "type": "invalid_request_error", "message": "invalid request body: Object missing required field `messages`"}
    assert errors["streaming"]["error"]["message"] == "stream: batch requests cannot stream"
    worker.assert_engine_idle()


@pytest.mark.parametrize("body, message", [
    ({"requests": []}, "requests must not be empty"),
    ({"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}]},
     "requests[1].custom_id 'a' is not unique in the batch"),
    ({"requests": [{"custom_id": "has space", "params": {}}]},
     "requests[0].custom_id must be 1 to 64 letters, digits, '-' or '_', got 'has space'"),
    ({"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "b", "params": [1]}]},
     "requests[1].params must be an object"),
    ({"requests": [{"params": {}}]},
     "invalid request body: Object missing required field `custom_id` - at `$.requests[0]`"),
    ({}, "invalid request body: Object missing required field `requests`"),
])
async def test_create_rejects_a_bad_envelope(worker, body, message):
    response = await worker.http.post("/v1/messages/batches", json=body)
    assert response.status_code == 400
    assert response.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    listed = (await worker.http.get("/v1/messages/batches")).json()
    assert listed == {"data": [], "has_more": False, "first_id": None, "last_id": None}


async def test_unknown_batch_is_404_everywhere(worker):
    not_found = {"type": "error", "error": {"type": "not_found_error", "message": "no message batch 'msgbatch_x'"}}
    for method, path in [("GET", ""), ("GET", "/results"), ("POST", "/cancel"), ("DELETE", "")]:
        response = await worker.http.request(method, f"/v1/messages/batches/msgbatch_x{path}")
        assert (response.status_code, response.json()) == (404, not_found), (method, path)


async def test_results_and_delete_need_an_ended_batch(slow_worker):
    w = slow_worker
    created = (await w.http.post("/v1/messages/batches", json={"requests": [
        {"custom_id": "a", "params": params(w.model, "Hello", 100)}]})).json()
    batch_id = created["id"]
    early = await w.http.get(f"/v1/messages/batches/{batch_id}/results")
    assert early.status_code == 400
    assert early.json()["error"]["message"] == (
        f"message batch {batch_id!r} is still in_progress; its results are available once it has ended")
    refused = await w.http.delete(f"/v1/messages/batches/{batch_id}")
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    await w.wait_ended(batch_id)
    deleted = await w.http.delete(f"/v1/messages/batches/{batch_id}")
    assert deleted.json() == {"id": batch_id, "type": "message_batch_deleted"}
    assert (await w.http.get(f"/v1/messages/batches/{batch_id}")).status_code == 404
    assert w.runner.store.results(batch_id, None, 10) == []  # its requests are gone from the file too


async def test_list_pages_newest_first(worker):
    ids = []
    for i in range(5):
        body = {"requests": [{"custom_id": "only", "params": params(worker.model, f"n{i}", 2)}]}
        ids.append((await worker.http.post("/v1/messages/batches", json=body)).json()["id"])
    newest_first = ids[::-1]

    async def page(**query) -> dict:
        response = await worker.http.get("/v1/messages/batches", params=query)
        assert response.status_code == 200, response.text
        return response.json()

    first = await page(limit=2)
    assert [b["id"] for b in first["data"]] == newest_first[:2]
    assert (first["has_more"], first["first_id"], first["last_id"]) == (True, newest_first[0], newest_first[1])
    second = await page(limit=2, after_id=first["last_id"])
    assert [b["id"] for b in second["data"]] == newest_first[2:4] and second["has_more"] is True
    third = await page(limit=2, after_id=second["last_id"])
    assert [b["id"] for b in third["data"]] == newest_first[4:] and third["has_more"] is False
    back = await page(limit=2, before_id=third["first_id"])
    assert [b["id"] for b in back["data"]] == newest_first[2:4] and back["has_more"] is True
    back_to_top = await page(limit=3, before_id=newest_first[2])
    assert [b["id"] for b in back_to_top["data"]] == newest_first[:2] and back_to_top["has_more"] is False
    assert [b["id"] for b in (await page())["data"]] == newest_first
    for query, message in [({"limit": 0}, "limit must be between 1 and 1000, got 0"),
                           ({"after_id": "msgbatch_nope"}, "after_id: no message batch 'msgbatch_nope'")]:
        response = await worker.http.get("/v1/messages/batches", params=query)
        assert response.status_code == 400 and response.json()["error"]["message"] == message
    for batch_id in ids:
        await worker.wait_ended(batch_id)


async def test_concurrency_is_bounded(tiny_model_dir, tokenizer, tmp_path):
    w = await _make_worker(tiny_model_dir, tokenizer, tmp_path, decode_step_seconds=0.001, max_in_flight=3)
    try:
        requests = [{"custom_id": f"r{i}", "params": params(w.model, f"q{i}", 20)} for i in range(10)]
        created = (await w.http.post("/v1/messages/batches", json={"requests": requests})).json()
        ended = await w.wait_ended(created["id"])
        assert ended["request_counts"]["succeeded"] == 10
        assert w.client.peak_in_flight == 3
    finally:
        await w.stop_runner()
        await w.client.close()


async def test_cancel_mid_batch_aborts_running_requests(slow_worker):
    w = slow_worker
    requests = [{"custom_id": f"r{i}", "params": params(w.model, f"q{i}", 200)} for i in range(8)]
    created = (await w.http.post("/v1/messages/batches", json={"requests": requests})).json()
    await w.wait_for(lambda: w.client.num_in_flight == 2 and w.core.has_unfinished())
    response = await w.http.post(f"/v1/messages/batches/{created['id']}/cancel")
    assert response.status_code == 200
    canceling = response.json()
    assert canceling["processing_status"] in ("canceling", "ended")
    assert canceling["cancel_initiated_at"] is not None
    ended = await w.wait_ended(created["id"])
    assert ended["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 8, "expired": 0}
    assert [line["result"] for line in await w.results(created["id"])] == [{"type": "canceled"}] * 8
    assert w.client.num_aborts == 2  # the two running requests were aborted in the engine
    await w.client.wait_idle()
    w.assert_engine_idle()
    again = await w.http.post(f"/v1/messages/batches/{created['id']}/cancel")
    assert again.json() == ended  # canceling an ended batch changes nothing


async def test_a_queued_batch_cancels_at_once(slow_worker):
    w = slow_worker
    busy = {"requests": [{"custom_id": f"long{i}", "params": params(w.model, "busy", 60)} for i in range(3)]}
    first = (await w.http.post("/v1/messages/batches", json=busy)).json()
    await w.wait_for(lambda: w.runner.num_in_flight == 2)  # the dispatcher now waits for a slot in `first`
    queued = (await w.http.post("/v1/messages/batches", json={"requests": [
        {"custom_id": "never", "params": params(w.model, "x", 4)}]})).json()
    canceled = (await w.http.post(f"/v1/messages/batches/{queued['id']}/cancel")).json()
    assert canceled["processing_status"] == "ended"
    assert canceled["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 1, "expired": 0}
    assert (await w.wait_ended(first["id"]))["request_counts"]["succeeded"] == 3


async def test_a_dead_engine_leaves_requests_pending_for_the_restart(slow_worker):
    w = slow_worker
    w.client.healthy = False
    requests = [{"custom_id": f"r{i}", "params": params(w.model, f"q{i}", 4)} for i in range(3)]
    created = (await w.http.post("/v1/messages/batches", json={"requests": requests})).json()
    await asyncio.sleep(0.2)
    waiting = (await w.http.get(f"/v1/messages/batches/{created['id']}")).json()
    assert (waiting["processing_status"], waiting["request_counts"]["processing"]) == ("in_progress", 3)
    await w.stop_runner()
    w.client.healthy = True
    await w.start()
    assert (await w.wait_ended(created["id"]))["request_counts"]["succeeded"] == 3


async def test_a_second_store_on_the_same_file_is_refused(worker):
    await asyncio.to_thread(worker.runner.store.get, "msgbatch_x")
    with pytest.raises(BatchStoreBusyError, match="is in use by another process: one worker per state directory"):
        BatchStore(worker.path)


async def test_batches_do_not_import_torch():
    code = "import sys, api.batches\nprint(sorted(m for m in ('torch', 'pydantic') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr


async def test_expired_requests(tiny_model_dir, tokenizer, tmp_path):
    w = await _make_worker(tiny_model_dir, tokenizer, tmp_path, ttl_seconds=0.0)
    try:
        requests = [{"custom_id": f"r{i}", "params": params(w.model, "x", 4)} for i in range(3)]
        created = (await w.http.post("/v1/messages/batches", json={"requests": requests})).json()
        assert created["expires_at"] == created["created_at"]
        ended = await w.wait_ended(created["id"])
        assert ended["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 3}
        assert [line["result"] for line in await w.results(created["id"])] == [{"type": "expired"}] * 3
    finally:
        await w.stop_runner()
        await w.client.close()


async def test_restart_keeps_batches_and_finishes_interrupted_ones(slow_worker):
    w = slow_worker
    done = (await w.http.post("/v1/messages/batches", json={"requests": [
        {"custom_id": "early", "params": params(w.model, "early", 3)}]})).json()
    await w.wait_ended(done["id"])
    done_results = await w.results(done["id"])
    requests = [{"custom_id": f"r{i}", "params": params(w.model, f"q{i}", 30 + 30 * (i % 2))} for i in range(6)]
    created = (await w.http.post("/v1/messages/batches", json={"requests": requests})).json()

    def some_done_some_running() -> bool:
        batch = w.runner.store.get(created["id"])
        return batch.request_counts.succeeded >= 1 and w.runner.num_in_flight == 2

    await w.wait_for(some_done_some_running)
    await w.stop_runner()  # the "crash": running requests are aborted and stay pending in the file
    await w.client.wait_idle()
    w.assert_engine_idle()
    store = BatchStore(w.path)
    interrupted = store.get(created["id"])
    before = {row.custom_id: row.result for row in store.results(created["id"], None, 100)}
    store.close()
    assert interrupted.processing_status == "in_progress"
    assert 1 <= interrupted.request_counts.succeeded <= 4 and interrupted.request_counts.processing >= 2

    await w.start()  # a new store and runner on the same file
    listed = (await w.http.get("/v1/messages/batches")).json()
    assert [b["id"] for b in listed["data"]] == [created["id"], done["id"]]
    ended = await w.wait_ended(created["id"])
    assert ended["request_counts"]["succeeded"] == 6
    assert await w.results(done["id"]) == done_results
    lines = await w.results(created["id"])
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(6)]
    for request, line in zip(requests, lines):
        if line["custom_id"] in before:  # finished before the restart: kept byte for byte
            assert json.loads(before[line["custom_id"]]) == line["result"]
        direct = await w.http.post("/v1/messages", json=request["params"])
        assert without_id(line["result"]["message"]) == without_id(direct.json())


async def test_official_anthropic_client(worker):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(worker.app, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    client = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", api_key="unused",
                                      max_retries=0)
    try:
        batch = await client.messages.batches.create(requests=[
            {"custom_id": "one", "params": params(worker.model, "Hello there", 5)},
            {"custom_id": "two", "params": params("other-model", "Hello", 5)},
        ])
        assert batch.type == "message_batch" and batch.processing_status == "in_progress"
        while batch.processing_status != "ended":
            await asyncio.sleep(0.01)
            batch = await client.messages.batches.retrieve(batch.id)
        assert (batch.request_counts.succeeded, batch.request_counts.errored) == (1, 1)
        results = [entry async for entry in await client.messages.batches.results(batch.id)]
        assert [r.custom_id for r in results] == ["one", "two"]
        assert results[0].result.type == "succeeded" and results[0].result.message.usage.output_tokens == 5
        assert results[1].result.type == "errored"
        assert results[1].result.error.error.type == "not_found_error"
        listed = [b.id async for b in client.messages.batches.list(limit=1)]
        assert listed == [batch.id]
        deleted = await client.messages.batches.delete(batch.id)
        assert deleted.type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.batches.retrieve(batch.id)
    finally:
        await client.close()
        server.should_exit = True
        await serving
        sock.close()
