"""OpenAI Files and Batches at the orchestrator, with the official ``openai`` client: a ctx worker, a gen
worker (torch engine, tiny model) and a 2-process orchestrator, one deployment for the module.

- files: upload (multipart, purpose batch), list with pagination, retrieve, content, delete; unknown
  ids are 404s in OpenAI's shape; an upload over ``max_upload_bytes`` is a 413 naming the key;
- a batch of chat, completions or Responses lines runs through ctx + gen workers: each output line's
  answer is the one a direct request gets; bad lines and rejected bodies go to the error file while
  the batch completes; status walks validating -> in_progress -> ... -> completed;
- cancel mid-batch ends ``cancelled`` with partial output and ``batch_cancelled`` error lines;
- a batch created while the gen worker is down survives an orchestrator restart and completes.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from disagg_cluster import DisaggCluster
from orchestrator_process import stop_orchestrator, wait_until
from worker_process import stop_worker

MODEL = "tiny-test"
MAX_UPLOAD = 64 * 1024


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    cluster = DisaggCluster(tmp_path_factory.mktemp("openai-batches"), tiny_model_dir, max_upload_bytes=MAX_UPLOAD)
    yield cluster
    cluster.close()


def _jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def _chat_line(custom_id: str, text: str, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 6,
                     "temperature": 0, **extra}}


def _wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 120.0):
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b, timeout)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    assert file_id is not None
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_files_upload_list_retrieve_content_delete(cluster):
    client = cluster.openai()
    content = _jsonl([_chat_line("a", "hello")])
    uploaded = [client.files.create(file=(f"in-{i}.jsonl", content), purpose="batch") for i in range(3)]
    first = uploaded[0]
    assert first.id.startswith("file-") and first.bytes == len(content) and first.purpose == "batch"
    assert first.filename == "in-0.jsonl" and first.object == "file"
    assert client.files.retrieve(first.id) == first
    assert client.files.content(first.id).content == content

    page = client.files.list(limit=2, purpose="batch")  # newest first, then the page after
    assert [f.id for f in page.data] == [uploaded[2].id, uploaded[1].id] and page.has_more
    rest = client.files.list(limit=2, purpose="batch", after=page.data[-1].id)
    assert rest.data[0].id == first.id
    assert [f.id for f in client.files.list(order="asc", purpose="batch")][:3] == [f.id for f in uploaded]

    deleted = client.files.delete(first.id)
    assert deleted.deleted and deleted.id == first.id
    for call in (lambda: client.files.retrieve(first.id), lambda: client.files.content(first.id),
                 lambda: client.files.delete(first.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["message"] == f"No such File object: {first.id}"  # OpenAI's error shape

    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("x.jsonl", content), purpose="fine-tune")
    assert bad.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as big:
        client.files.create(file=("big.jsonl", b"x" * (MAX_UPLOAD + 1)), purpose="batch")
    assert big.value.status_code == 413 and "max_upload_bytes" in big.value.body["message"]
    not_form = httpx.post(f"{cluster.url}/v1/files", json={"purpose": "batch"})
    assert not_form.status_code == 400 and not_form.json()["error"]["param"] == "file"


def test_a_chat_batch_answers_as_direct_requests_and_reports_bad_lines(cluster):
    client = cluster.openai()
    good = [_chat_line(f"q-{i}", f"Batch question {i}") for i in range(3)]
    lines = [*good,
             b'{"custom_id": "broken", "method": "POST", ',  # not JSON
             {**_chat_line("elsewhere", "x"), "url": "/v1/completions"},  # not the batch's endpoint
             _chat_line("q-0", "a second q-0"),  # duplicate custom_id
             _chat_line("rejected", "x", max_tokens=-1)]  # the endpoint answers 400
    source = client.files.create(file=("chat.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    done = _wait_status(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 3, 4)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.output_file_id
    assert done.usage.output_tokens == 3 * 6 and done.usage.total_tokens == done.usage.input_tokens + 18

    output = _lines(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == ["q-0", "q-1", "q-2"]
    for line, request in zip(output, good):
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        direct = client.chat.completions.create(**request["body"])
        answer = line["response"]["body"]
        assert answer["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert answer["usage"]["completion_tokens"] == direct.usage.completion_tokens == 6

    errors = {line["custom_id"]: line for line in _lines(client, done.error_file_id)}
    assert set(errors) == {None, "elsewhere", "q-0", "rejected"}
    assert errors[None]["error"]["code"] == "invalid_request" and "line 4" in errors[None]["error"]["message"]
    assert "url" in errors["elsewhere"]["error"]["message"] and "not unique" in errors["q-0"]["error"]["message"]
    rejected = errors["rejected"]["response"]
    assert rejected["status_code"] == 400 and rejected["body"]["error"]["param"] == "max_tokens"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_completions_and_responses_batches(cluster):
    client = cluster.openai()
    completions = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": MODEL, "prompt": f"Once upon a time {i}", "max_tokens": 5, "temperature": 0}}
                   for i in range(2)]
    responses = [{"custom_id": "r-0", "method": "POST", "url": "/v1/responses",
                  "body": {"model": MODEL, "input": "Say something.", "max_output_tokens": 5, "temperature": 0}}]
    for endpoint, lines in (("/v1/completions", completions), ("/v1/responses", responses)):
        source = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint=endpoint, completion_window="24h")
        done = _wait_status(client, batch.id, ("completed", "failed"))
        assert done.status == "completed" and done.request_counts.completed == len(lines), done
        assert done.error_file_id is None  # no line failed: no error file
        for line, request in zip(_lines(client, done.output_file_id), lines):
            body = line["response"]["body"]
            if endpoint == "/v1/completions":
                assert body["choices"][0]["text"] == client.completions.create(**request["body"]).choices[0].text
            else:
                assert body["object"] == "response"
                assert body["output"][0]["content"][0]["text"] == client.responses.create(
                    **request["body"]).output_text


def test_batch_errors_and_pagination(cluster):
    client = cluster.openai()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError) as unknown:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    assert unknown.value.body["param"] == "input_file_id"
    source = client.files.create(file=("in.jsonl", _jsonl([_chat_line("a", "x")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert window.value.body["param"] == "completion_window"
    empty = client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    failed = _wait_status(client, client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                                                        completion_window="24h").id, ("failed",), 30)
    assert failed.errors.data[0].code == "empty_file" and failed.failed_at
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(failed.id)

    ids = [client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [ids[2], ids[1]] and page.has_more
    assert client.batches.list(limit=2, after=ids[1]).data[0].id == ids[0]
    assert [b.id for b in client.batches.list(limit=1)][:3] == ids[::-1]  # the client pages with after


def test_cancel_mid_batch(cluster):
    client = cluster.openai()
    lines = [_chat_line(f"n-{i}", f"Tell a long story number {i}", max_tokens=48) for i in range(150)]
    source = client.files.create(file=("many.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed > 0, 60)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _wait_status(client, batch.id, ("cancelled",), 60)
    counts = done.request_counts
    assert counts.total == 150 and 0 < counts.completed < 150 and done.cancelled_at
    assert len(_lines(client, done.output_file_id)) == counts.completed
    errors = _lines(client, done.error_file_id)
    assert len(errors) == 150 - counts.completed - counts.failed
    assert all(line["error"]["code"] == "batch_cancelled" for line in errors)


def test_a_batch_survives_an_orchestrator_restart(cluster):
    gen_port = cluster.gen.port
    stop_worker(cluster.gen)
    wait_until(lambda: not httpx.get(f"{cluster.url}/cluster_info").json()["workers"][1]["healthy"], 10)
    client = cluster.openai()
    lines = [_chat_line(f"s-{i}", f"Survivor {i}") for i in range(4)]
    source = client.files.create(file=("survive.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    waiting = _wait_status(client, batch.id, ("in_progress",), 30)
    time.sleep(1.0)
    assert client.batches.retrieve(batch.id).request_counts.failed == 0 == waiting.request_counts.completed

    stop_orchestrator(cluster.orch)  # everything is on disk: the next orchestrator continues the batch
    cluster.url, cluster.orch = cluster.start_orchestrator(wait_healthy=False)  # the gen worker is down
    _, cluster.gen = cluster.start_worker("gen", port=gen_port)
    client = cluster.openai()
    done = _wait_status(client, batch.id, ("completed",))
    assert done.request_counts.completed == 4
    assert sorted(line["custom_id"] for line in _lines(client, done.output_file_id)) == [f"s-{i}" for i in range(4)]
    assert client.files.retrieve(source.id).filename == "survive.jsonl"
