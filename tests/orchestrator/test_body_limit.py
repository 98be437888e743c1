"""Request bodies over the limit get a 413 in the API's shape, before they are buffered, at a
worker and at the orchestrator; the receiving process does not grow with the body."""

from __future__ import annotations

import time

import httpx
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import start_worker, stop_worker

MiB = 1024 * 1024
LIMIT = 16 * MiB  # api.body_limit.DEFAULT_MAX_REQUEST_BYTES


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    worker_url, worker = start_worker(tiny_model_dir, 1)
    orch_url, orch = start_orchestrator(tmp_path_factory.mktemp("orch"), tiny_model_dir,
                                        [("both", worker_url)], processes=1)
    # One orchestrator process serves from the command's own process; a K=1 worker from its launcher.
    yield {"worker": (worker_url, worker.pid), "orchestrator": (orch_url, orch.pid)}
    assert stop_orchestrator(orch) == 0
    stop_worker(worker)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        (kb,) = [int(line.split()[1]) for line in status if line.startswith("VmRSS:")]
    return kb * 1024


def _chunks(total: int, chunk: int = MiB):
    """A JSON-looking body sent in pieces: never built in memory at once."""
    yield b'{"model": "tiny-test", "prompt": "'
    piece = b"x" * chunk
    for _ in range(total // chunk):
        yield piece
    yield b'"}'


def _post(url: str, path: str, total: int, declare_length: bool) -> tuple[httpx.Response | None, float]:
    headers = {"content-type": "application/json"}
    if declare_length:
        headers["content-length"] = str(total + len(b'{"model": "tiny-test", "prompt": "') + 2)
    started = time.monotonic()
    try:
        response = httpx.post(f"{url}{path}", content=_chunks(total), headers=headers, timeout=30)
    except httpx.TransportError:  # the server may close the connection while the client still writes
        return None, time.monotonic() - started
    return response, time.monotonic() - started


@pytest.mark.parametrize("where", ["worker", "orchestrator"])
@pytest.mark.parametrize("size_mib", [50, 500])
def test_an_oversized_body_is_a_413_at_once_and_costs_no_memory(servers, where, size_mib):
    url, pid = servers[where]
    before = _rss_bytes(pid)
    response, seconds = _post(url, "/v1/completions", size_mib * MiB, declare_length=True)
    assert response is not None, "no answer"
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]
    assert seconds < 1.0
    assert _rss_bytes(pid) - before < 50 * MiB


@pytest.mark.parametrize("where", ["worker", "orchestrator"])
def test_a_chunked_body_is_cut_off_at_the_limit(servers, where):
    url, pid = servers[where]
    before = _rss_bytes(pid)
    response, seconds = _post(url, "/v1/messages", 100 * MiB, declare_length=False)
    if response is not None:  # or the server closed the connection on the rest of the upload
        assert response.status_code == 413, response.text
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert _rss_bytes(pid) - before < 50 * MiB
    assert httpx.get(f"{url}/health").status_code == 200  # and it still serves


def test_a_body_under_the_limit_is_served(servers):
    for url, _ in servers.values():
        body = {"model": "tiny-test", "prompt": "hello", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200


def test_the_limit_is_configurable(tiny_model_dir, tmp_path):
    url, worker = start_worker(tiny_model_dir, 1, extra_args=["--max-request-bytes", "4096"])
    orch_url, orch = start_orchestrator(tmp_path, tiny_model_dir, [("both", url)], processes=1,
                                        max_request_bytes=4096)
    try:
        for base in (url, orch_url):
            body = {"model": "tiny-test", "prompt": "x" * 5000, "max_tokens": 1}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert response.status_code == 413 and "4096" in response.json()["error"]["message"]
    finally:
        assert stop_orchestrator(orch) == 0
        stop_worker(worker)
