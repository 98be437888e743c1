"""Message Batches through a real K=2 worker: forwarded to the launcher, persisted across restarts."""

from __future__ import annotations

import time

import anthropic
import httpx
from worker_process import start_worker, stop_worker


def _wait_ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} did not end within {timeout} s")


def test_batches_are_launcher_owned_and_survive_a_restart(tiny_model_dir, tmp_path):
    state_dir = tmp_path / "state"
    url, proc = start_worker(tiny_model_dir, 2, extra_args=["--state-dir", str(state_dir)])
    try:
        client = anthropic.Anthropic(base_url=url, api_key="unused")
        requests = [
            {"custom_id": f"r{i}", "params": {"model": "tiny-test", "max_tokens": 4 + i,
                                               "messages": [{"role": "user", "content": f"hello {i}"}]}}
            for i in range(6)
        ]
        batch = client.messages.batches.create(requests=requests, extra_headers={"x-request-id": "the-creator"})
        ended = _wait_ended(client, batch.id)
        assert ended.request_counts.succeeded == 6
        results = {r.custom_id: r for r in client.messages.batches.results(batch.id)}
        assert sorted(results) == [f"r{i}" for i in range(6)]
        assert [results[f"r{i}"].result.message.usage.output_tokens for i in range(6)] == [4, 5, 6, 7, 8, 9]
        # Whichever frontend answers, the launcher's store answers: every poll sees the batch.
        served_by = set()
        for _ in range(16):
            response = httpx.get(f"{url}/v1/messages/batches/{batch.id}")
            assert response.status_code == 200 and response.json()["id"] == batch.id
            served_by.add(response.headers["x-disagg-frontend"])
        assert served_by == {"0", "1"}
        # Each batch request's perf record names it, not the HTTP request that created the batch.
        ids = {r["x_request_id"] for r in httpx.get(f"{url}/perf_metrics").json()}
        assert {f"{batch.id}[{i}]" for i in range(6)} <= ids and "the-creator" not in ids
    finally:
        assert stop_worker(proc) == 0

    url, proc = start_worker(tiny_model_dir, 2, extra_args=["--state-dir", str(state_dir)])
    try:
        client = anthropic.Anthropic(base_url=url, api_key="unused")
        assert [b.id for b in client.messages.batches.list()] == [batch.id]
        again = {r.custom_id: r.result.message.content[0].text for r in client.messages.batches.results(batch.id)}
        assert again == {k: v.result.message.content[0].text for k, v in results.items()}
    finally:
        assert stop_worker(proc) == 0
