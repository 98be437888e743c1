"""Admission control at a worker (``api.admission``), over real sockets.

1,000 connections are open to a worker whose limit is 64; 200 of them post a
generation request at once. The worker admits 64, answers the rest 429 with
Retry-After at once (before reading their bodies), finishes every admitted
request, and its memory stays bounded. Loopback only, bounded load.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.worker_process import rss_mb, start_worker, stop_worker
from tests.worker_procs import wait_until

LIMIT = 64
STEP_SECONDS = 0.05
MAX_TOKENS = 40  # ~2 s per admitted request: all 200 arrive while the first 64 still run


@pytest.fixture(scope="module")
def limited_worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, 1, extra_args=[
        "--max-concurrent-requests", str(LIMIT), "--synthetic-decode-step-seconds", str(STEP_SECONDS),
        "--max-num-seqs", "256"])
    yield url, proc
    stop_worker(proc)


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> tuple[int, float, bytes, bytes]:
    body = json.dumps({"model": "tiny-test", "prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True}).encode()
    start = time.monotonic()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (port, len(body), body))
    await writer.drain()
    answer = await reader.read(-1)
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), time.monotonic() - start, head.lower(), payload


async def _drill(port: int) -> list[tuple[int, float, bytes, bytes]]:
    connections = []
    for _ in range(1000):
        connections.append(await asyncio.open_connection("127.0.0.1", port))
    try:
        return await asyncio.gather(*(_post(r, w, port) for r, w in connections[:200]))
    finally:
        for _, writer in connections:
            writer.close()


def test_excess_requests_get_429_at_once_and_the_admitted_complete(limited_worker):
    url, proc = limited_worker
    port = int(url.rsplit(":", 1)[1])
    httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "warm", "max_tokens": 1}, timeout=30)
    before = rss_mb(proc.pid)
    results = asyncio.run(_drill(port))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 200, sorted({r[0] for r in results})
    assert LIMIT <= len(ok) < 200 and len(refused) >= 50
    for _, _, _, payload in ok:
        assert json.loads(payload)["usage"]["completion_tokens"] == MAX_TOKENS
    slowest_refusal = max(seconds for _, seconds, _, _ in refused)
    assert slowest_refusal < 1.5, slowest_refusal  # an admitted request takes ~2 s; a refusal does not wait
    for _, _, head, payload in refused:
        assert b"retry-after: 1" in head
        error = json.loads(payload)["error"]
        assert error["code"] == "too_many_requests" and error["type"] == "rate_limit_error"
    assert rss_mb(proc.pid) - before < 50
    # Slots are released: the worker admits again, and /health was never refused.
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    assert client.completions.create(model="tiny-test", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_anthropic_refusal_is_529_overloaded_error(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, 1, extra_args=[
        "--max-concurrent-requests", "1", "--synthetic-decode-step-seconds", "0.05"])
    try:
        with httpx.Client(timeout=30) as http:
            body = {"model": "tiny-test", "max_tokens": 60, "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}
            with http.stream("POST", f"{url}/v1/messages", json=body) as held:
                assert held.status_code == 200
                refused = http.post(f"{url}/v1/messages", json={**body, "stream": False})
            assert refused.status_code == 529 and refused.headers["retry-after"] == "1"  # Anthropic's "overloaded"
            assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "overloaded_error"
            # The slot is freed when the held stream's client goes away.
            wait_until(lambda: http.post(f"{url}/v1/messages",
                                         json={**body, "stream": False, "max_tokens": 2}).status_code == 200, 10)
    finally:
        stop_worker(proc)


def test_the_limit_is_shared_by_the_frontends_and_configured_from_the_yaml():
    from api.admission import per_frontend_limit
    from disagg.deploy_config import EngineSettings
    from workers.config import ConfigError

    assert per_frontend_limit(64, 1) == 64 and per_frontend_limit(64, 3) == 22 and per_frontend_limit(2, 8) == 1
    assert per_frontend_limit(0, 4) is None and per_frontend_limit(None, 4) is None
    assert EngineSettings(max_concurrent_requests=64).serve_options()["--max-concurrent-requests"] == 64
    with pytest.raises(ConfigError, match="engine.max_concurrent_requests"):
        EngineSettings(max_concurrent_requests=-1).validate("engine")


def test_the_queue_bound_refuses_past_requests_or_tokens_and_counts_by_limit():
    from api.admission import Limit, OverloadedError, QueueBound
    from api.errors import http_error

    refused: list[str] = []
    bound = QueueBound(2, 100, "this worker", refused.append)
    first = bound.enter(90)  # alone in the queue: admitted whatever its length
    assert first is not None and (bound.num_queued, bound.num_queued_tokens) == (1, 90)
    with pytest.raises(OverloadedError, match="90 prompt tokens queued, at most 100"):
        bound.enter(11)
    second = bound.enter(10)
    with pytest.raises(OverloadedError, match="2 requests queued, at most 2"):
        bound.enter(1)
    assert refused == [Limit.QUEUED_PROMPT_TOKENS, Limit.QUEUED_REQUESTS]
    first.leave()
    first.leave()  # idempotent: the first output and the request's end both leave
    assert (bound.num_queued, bound.num_queued_tokens) == (1, 10)
    assert second is not None and bound.enter(90) is not None
    lone = QueueBound(None, 5, "x")
    assert lone.enter(500) is not None  # the token bound never refuses a request alone in the queue
    assert QueueBound(None, None, "x").enter(10**6) is None  # unbounded: nothing counted
    error = http_error(OverloadedError("busy"))
    assert (error.status_for(anthropic=False), error.status_for(anthropic=True)) == (429, 529)
    assert error.headers() == {"Retry-After": "1"} and error.anthropic_type == "overloaded_error"


def test_the_queue_bounds_are_configured_from_the_yaml_with_errors_naming_the_key():
    from disagg.deploy_config import EngineSettings, OrchestratorSettings
    from orchestrator.config import OrchestratorConfig
    from workers.config import ConfigError

    options = EngineSettings(max_queued_requests=8, max_queued_prompt_tokens=4096).serve_options()
    assert options["--max-queued-requests"] == 8 and options["--max-queued-prompt-tokens"] == 4096
    with pytest.raises(ConfigError, match="engine.max_queued_prompt_tokens"):
        EngineSettings(max_queued_prompt_tokens=-1).validate("engine")
    with pytest.raises(ConfigError, match="orchestrator.max_queued_requests"):
        OrchestratorSettings(max_queued_requests=-2).validate("orchestrator")
    with pytest.raises(ConfigError, match="orchestrator.max_queued_prompt_tokens"):
        OrchestratorConfig(model_dir="m", state_dir="s", max_queued_prompt_tokens=-1).validate("orchestrator")
