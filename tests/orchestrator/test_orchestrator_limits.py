"""The orchestrator's own bounds, over real sockets: concurrent requests per process, one request
at a time per connection (HTTP/1.1 pipelining), and its access log.

One worker (synthetic engine, no limit of its own, 50 ms decode steps) behind one orchestrator
process whose limit is 2 and whose access log is on.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from orchestrator_process import orchestrator_log, start_orchestrator, stop_orchestrator
from worker_process import start_worker, stop_worker

LIMIT = 2
SLOW_TOKENS = 40  # 40 x 50 ms: the admitted requests still run while the others arrive


@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orch-limits")
    worker_url, worker = start_worker(tiny_model_dir, 1, extra_args=[
        "--max-concurrent-requests", "0", "--synthetic-decode-step-seconds", "0.05"])
    url, proc = start_orchestrator(tmp, tiny_model_dir, [("both", worker_url)], processes=1,
                                   max_concurrent_requests=LIMIT, access_log=True, log_level="info")
    yield url, proc
    assert stop_orchestrator(proc) == 0
    stop_worker(worker)


def _request(path: str, body: dict, port: int, keep_alive: bool = False) -> bytes:
    payload = json.dumps(body).encode()
    connection = b"keep-alive" if keep_alive else b"close"
    return (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: %s\r\n\r\n%s" % (path.encode(), port, len(payload), connection, payload))


async def _post(port: int, path: str, body: dict) -> tuple[int, float, bytes, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(_request(path, body, port))
    answer = await reader.read(-1)
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), time.monotonic() - start, head.lower(), payload


def test_requests_over_the_process_limit_get_429_at_once_and_the_admitted_complete(limited):
    url, _ = limited
    port = int(url.rsplit(":", 1)[1])
    slow = {"model": "tiny-test", "prompt": "hello", "max_tokens": SLOW_TOKENS, "ignore_eos": True}

    async def drill():
        admitted = [asyncio.create_task(_post(port, "/v1/completions", slow)) for _ in range(LIMIT)]
        await asyncio.sleep(0.5)  # both are in flight (each runs ~2 s)
        refused = await asyncio.gather(
            *(_post(port, "/v1/completions", slow) for _ in range(6)),
            # A query string takes the ASGI app, not the fast lane: the same gate counts it.
            _post(port, "/v1/completions?via=app", slow),
            _post(port, "/v1/messages", {"model": "tiny-test", "max_tokens": 5,
                                         "messages": [{"role": "user", "content": "hi"}]}))
        async with httpx.AsyncClient() as client:  # probes are never refused
            health = (await client.get(f"{url}/health")).status_code
        return await asyncio.gather(*admitted), refused, health

    admitted, refused, health = asyncio.run(drill())
    assert health == 200
    for status, seconds, head, _ in refused:
        assert status in (429, 529) and b"retry-after: 1" in head and seconds < 1.0, (status, seconds, head)
    assert [status for status, _, _, _ in refused] == [429] * 7 + [529]  # Anthropic's "overloaded" last
    openai_error = json.loads(refused[0][3])["error"]
    assert openai_error["type"] == "rate_limit_error" and "orchestrator process" in openai_error["message"]
    assert json.loads(refused[-1][3])["error"]["type"] == "overloaded_error"  # Anthropic's shape
    assert json.loads(refused[-1][3])["type"] == "error"
    for status, _, _, payload in admitted:
        assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == SLOW_TOKENS


def test_pipelined_requests_on_one_connection_run_one_at_a_time(limited):
    """Ten requests written at once on one connection: were they served concurrently, the
    limit of 2 would refuse some; one at a time, all ten are answered, in order."""
    url, _ = limited
    port = int(url.rsplit(":", 1)[1])

    async def pipeline():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"".join(_request("/v1/completions", {"model": "tiny-test", "prompt": f"n{i}", "max_tokens": 3,
                                                           "ignore_eos": True}, port, keep_alive=i < 9)
                              for i in range(10)))
        data = await asyncio.wait_for(reader.read(-1), 60)
        writer.close()
        return data

    data = asyncio.run(pipeline())
    statuses = re.findall(rb"HTTP/1.1 (\d{3})", data)
    assert statuses == [b"200"] * 10, statuses


def test_the_access_log_has_one_line_per_request_and_no_traceback_for_client_errors(limited):
    url, proc = limited
    marker = f"/v1/models/access-log-probe-{time.monotonic_ns()}"
    assert httpx.get(f"{url}{marker}").status_code == 404
    bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400
    assert httpx.post(f"{url}/v1/completions", content=b"{not json").status_code == 400
    time.sleep(0.3)
    log = orchestrator_log(proc)
    assert sum(marker in line for line in log.splitlines()) == 1, log[-3000:]
    assert re.search(r'disagg.access: POST /v1/completions 400 .* status=400', log)  # reached the flow
    assert re.search(r'"POST /v1/completions HTTP/1.1" 429', log)  # the gate's refusals of the first test
    assert "Traceback" not in log
