"""Overload is refused early, not queued forever (``api.admission``), over real processes.

Two workers (synthetic engine, 30 ms decode steps, 2 sequences a batch, a queue bound of 2
requests, no concurrent-request limit: only the queue bound refuses) behind one orchestrator
process. A burst of 10x what they run at once: the requests admitted finish about as fast as on
an idle deployment, the others are refused at once (in milliseconds of the orchestrator's time
each; on a loaded 2-core machine a 40-request burst through one orchestrator process takes up to
a few hundred ms to pass, still far less than one admitted request's 1.2 s) with 429 (OpenAI) or
529 ``overloaded_error`` (Anthropic) and Retry-After, after the orchestrator tried both workers;
every refusal is counted. Then the orchestrator's own queue bound, and ``priority`` ordering one
worker's queue end to end.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time

import httpx
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import start_worker, stop_worker

MAX_NUM_SEQS = 2
CAPACITY = 2 * MAX_NUM_SEQS  # what the two workers run at once
MAX_TOKENS = 40  # ~1.2 s a request at 30 ms a step: what a refused request would wait for a slot
COMPLETION = {"model": "tiny-test", "prompt": "a burst", "max_tokens": MAX_TOKENS, "ignore_eos": True}
MESSAGE = {"model": "tiny-test", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "a burst"}]}


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    workers = [start_worker(tiny_model_dir, 1, extra_args=[
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-concurrent-requests", "0", "--max-queued-requests", "2",
        "--synthetic-decode-step-seconds", "0.03"]) for _ in range(2)]
    url, orchestrator = start_orchestrator(tmp, tiny_model_dir, [("both", w) for w, _ in workers], processes=1,
                                           max_retries=0, health={"interval_seconds": 60.0})
    yield url, [w for w, _ in workers]
    assert stop_orchestrator(orchestrator) == 0
    for _, proc in workers:
        stop_worker(proc)


def _request(port: int, anthropic: bool) -> bytes:
    body = json.dumps(MESSAGE if anthropic else COMPLETION).encode()
    path = b"/v1/messages" if anthropic else b"/v1/completions"
    return (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (path, port, len(body), body))


async def _post(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], port: int, anthropic: bool
                ) -> tuple[int, float, str | None, dict]:
    """(status, seconds from the request's write to its answer, Retry-After, body). Raw HTTP/1.1 on a
    connection opened before: the client's own cost is not in the figure."""
    reader, writer = connection
    start = time.monotonic()
    writer.write(_request(port, anthropic))
    answer = await reader.read(-1)
    seconds = time.monotonic() - start
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    retry_after = re.search(rb"^retry-after: (\S+)\r?$", head.lower(), re.MULTILINE)
    return (int(head.split(b" ", 2)[1]), seconds, None if retry_after is None else retry_after.group(1).decode(),
            json.loads(payload))


async def _run(url: str, num_requests: int, concurrent: bool) -> list[tuple[int, float, str | None, dict]]:
    """Request i is Anthropic's when i % 4 == 3, else a text completion."""
    port = int(url.rsplit(":", 1)[1])
    if not concurrent:
        return [await _post(await asyncio.open_connection("127.0.0.1", port), port, i % 4 == 3)
                for i in range(num_requests)]
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(num_requests)]
    return await asyncio.gather(*(_post(c, port, i % 4 == 3) for i, c in enumerate(connections)))


def _counter(text: str, name: str, limit: str) -> float:
    match = re.search(rf'^{name}{{limit="{limit}"}} (\S+)$', text, re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


@pytest.mark.slow  # tens of seconds; its refusal times need a machine not loaded many times over
def test_a_burst_of_ten_times_capacity_keeps_the_admitted_fast_and_refuses_the_rest_at_once(deployment):
    url, worker_urls = deployment
    unloaded = asyncio.run(_run(url, 8, concurrent=False))
    assert {status for status, *_ in unloaded} == {200}
    unloaded_p50 = statistics.median(seconds for _, seconds, _, _ in unloaded)

    results = asyncio.run(_run(url, 10 * CAPACITY, concurrent=True))
    admitted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert len(admitted) + len(refused) == 10 * CAPACITY and len(refused) >= 5 * CAPACITY, [r[0] for r in results]
    assert len(admitted) >= 2  # at least one queued at each worker
    for _, _, _, answer in admitted:
        assert answer["usage"].get("completion_tokens", answer["usage"].get("output_tokens")) == MAX_TOKENS
    admitted_p50 = statistics.median(seconds for _, seconds, _, _ in admitted)
    assert admitted_p50 <= 2 * unloaded_p50 + 0.5, (admitted_p50, unloaded_p50)
    refusal_seconds = sorted(seconds for _, seconds, _, _ in refused)
    print(f"unloaded p50 {unloaded_p50:.3f} s; burst of {len(results)}: {len(admitted)} admitted, p50 "
          f"{admitted_p50:.3f} s; {len(refused)} refused, p50 {statistics.median(refusal_seconds) * 1e3:.0f} ms, "
          f"max {refusal_seconds[-1] * 1e3:.0f} ms")
    # Never waiting for a slot: a refusal comes before any admitted request could have ended.
    assert statistics.median(refusal_seconds) < 0.5 and refusal_seconds[-1] < min(r[1] for r in admitted), (
        refusal_seconds, admitted_p50)
    for status, _, retry_after, answer in refused:
        assert retry_after == "1"
        if "type" in answer:  # Anthropic's shape
            assert status == 529 and answer["error"]["type"] == "overloaded_error", answer
        else:
            assert status == 429 and answer["error"]["type"] == "rate_limit_error", answer
            assert "every generation worker" in answer["error"]["message"]

    scrape = httpx.get(f"{url}/metrics").text
    assert _counter(scrape, "disagg_orchestrator_requests_refused_total", "workers") == len(refused)
    refused_at_workers = sum(_counter(httpx.get(f"{w}/prometheus/metrics").text, "disagg_requests_refused_total",
                                      "queued_requests") for w in worker_urls)
    # Each refused request tried both workers; an admitted one may have been refused by one first.
    assert 2 * len(refused) <= refused_at_workers <= 2 * len(refused) + len(admitted)
    info = httpx.get(f"{url}/cluster_info").json()
    assert all(w["healthy"] for w in info["workers"]), info  # busy is not broken


def test_the_orchestrator_refuses_past_its_own_queue_bound(tiny_model_dir, tmp_path):
    """A bound of 2 queued requests for the whole orchestrator: while two requests wait for their
    first token (one slow worker: 2 s prefills), a third is refused at once, with no leg sent."""
    worker_url, worker = start_worker(tiny_model_dir, 1, extra_args=[
        "--synthetic-prefill-seconds-per-token", "0.5", "--max-concurrent-requests", "0"])
    url, orchestrator = start_orchestrator(tmp_path, tiny_model_dir, [("both", worker_url)], processes=1,
                                           max_queued_requests=2, health={"interval_seconds": 60.0})
    try:
        async def drill():
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"model": "tiny-test", "prompt": "slow prompt", "max_tokens": 1}
                held = [asyncio.create_task(http.post(f"{url}/v1/completions", json=body)) for _ in range(2)]
                await asyncio.sleep(0.5)
                start = time.monotonic()
                refused = await http.post(f"{url}/v1/messages", json={**MESSAGE, "max_tokens": 1})
                return refused, time.monotonic() - start, await asyncio.gather(*held)

        refused, seconds, held = asyncio.run(drill())
        assert refused.status_code == 529 and refused.headers["retry-after"] == "1" and seconds < 0.5
        assert "the orchestrator is overloaded (2 requests queued" in refused.json()["error"]["message"]
        assert [r.status_code for r in held] == [200, 200]
        scrape = httpx.get(f"{url}/metrics").text
        assert _counter(scrape, "disagg_orchestrator_requests_refused_total", "queued_requests") == 1
        legs = re.search(r'^disagg_orchestrator_legs_total{phase="gen"} (\S+)$', scrape, re.MULTILINE)
        assert legs is not None and float(legs.group(1)) == 2  # the refused request reached no worker
    finally:
        assert stop_orchestrator(orchestrator) == 0
        stop_worker(worker)


def test_priority_orders_a_workers_queue_end_to_end(tiny_model_dir, tmp_path):
    """One sequence at a time: while a long request runs, three arrive with priorities 5, 0, -1
    (in that order); they start, and so finish, most urgent first."""
    worker_url, worker = start_worker(tiny_model_dir, 1, extra_args=[
        "--max-num-seqs", "1", "--synthetic-decode-step-seconds", "0.05"])
    url, orchestrator = start_orchestrator(tmp_path, tiny_model_dir, [("both", worker_url)], processes=1)
    try:
        async def drill() -> list[int]:
            finished: list[int] = []
            async with httpx.AsyncClient(timeout=60) as http:
                async def post(priority: int, max_tokens: int, chat: bool) -> None:
                    body = ({"model": "tiny-test", "messages": [{"role": "user", "content": "p"}]} if chat else
                            {"model": "tiny-test", "prompt": "p"})
                    path = "/v1/chat/completions" if chat else "/v1/completions"
                    response = await http.post(f"{url}{path}", json={**body, "max_tokens": max_tokens,
                                                                    "ignore_eos": True, "priority": priority})
                    assert response.status_code == 200, response.text
                    finished.append(priority)

                running = asyncio.create_task(post(100, 30, chat=False))  # ~1.5 s: holds the one slot
                await asyncio.sleep(0.3)
                queued = []
                for priority, chat in ((5, False), (0, True), (-1, False)):
                    queued.append(asyncio.create_task(post(priority, 3, chat)))
                    await asyncio.sleep(0.1)
                await asyncio.gather(running, *queued)
            return finished

        assert asyncio.run(drill()) == [100, -1, 0, 5]
        bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "p", "priority": "high"})
        assert bad.status_code == 400 and "priority" in bad.text
    finally:
        assert stop_orchestrator(orchestrator) == 0
        stop_worker(worker)
