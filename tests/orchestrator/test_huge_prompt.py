"""A huge prompt under the body limit is refused on its length, before it is tokenized whole
(``Tokenizer.proves_too_long``), at a worker and at the orchestrator, for every API."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import rss_mb, start_worker, stop_worker

from api.tokenizer import Tokenizer

TEN_MB = "word " * (2 * 1024 * 1024)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    worker_url, worker = start_worker(tiny_model_dir, 1)
    url, orchestrator = start_orchestrator(tmp_path_factory.mktemp("huge"), tiny_model_dir,
                                           [("both", worker_url)], processes=1)
    yield {"worker": (worker_url, worker.pid), "orchestrator": (url, orchestrator.pid)}
    assert stop_orchestrator(orchestrator) == 0
    stop_worker(worker)


def test_the_bound_is_a_true_upper_bound(tiny_model_dir):
    tokenizer = Tokenizer.from_model_path(tiny_model_dir)
    assert tokenizer.max_token_chars is not None
    for text in ("hello world", "x" * 5000, " " * 3000, "<|im_start|>" * 50, "ĠĠ ĠĠ\u00e9\u4e2d" * 400):
        assert len(tokenizer.encode(text)) * tokenizer.max_token_chars >= len(text)
        assert not tokenizer.proves_too_long(text, len(tokenizer.encode(text)))


BODIES = {
    "/v1/completions": {"model": "tiny-test", "prompt": TEN_MB, "max_tokens": 1},
    "/v1/chat/completions": {"model": "tiny-test", "messages": [{"role": "user", "content": TEN_MB}]},
    "/v1/messages": {"model": "tiny-test", "max_tokens": 1, "messages": [{"role": "user", "content": TEN_MB}]},
}


@pytest.mark.parametrize("where", ["worker", "orchestrator"])
def test_memory_goes_back_after_the_first_10_mb_prompt(stack, where):
    """No warm-up: the process's RSS before it ever saw a large body is the bar (it stayed ~30 MB
    above it for good before ``api.memory`` trimmed the heap after large bodies)."""
    url, pid = stack[where]
    payload = msgspec.json.encode({"model": "tiny-test", "messages": [{"role": "user", "content": "x" * 10_000_000}]})
    with httpx.Client(timeout=30) as http:
        assert http.post(f"{url}/v1/chat/completions", json={"model": "tiny-test", "max_tokens": 1, "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200
        before = rss_mb(pid)
        response = http.post(f"{url}/v1/chat/completions", content=payload,
                             headers={"content-type": "application/json"})
    assert response.status_code == 400
    deadline = time.monotonic() + 5
    while rss_mb(pid) - before > 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rss_mb(pid) - before <= 5, (before, rss_mb(pid))


@pytest.mark.parametrize("where", ["worker", "orchestrator"])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_10_mb_prompt_is_400_at_once(stack, where, path):
    url, pid = stack[where]
    payload = msgspec.json.encode(BODIES[path])
    assert 10_000_000 < len(payload) < 16 * 1024 * 1024  # under the body limit: the prompt check answers
    with httpx.Client(timeout=30) as http:
        http.post(f"{url}{path}", content=payload, headers={"content-type": "application/json"})  # warm
        before = rss_mb(pid)
        start = time.monotonic()
        response = http.post(f"{url}{path}", content=payload, headers={"content-type": "application/json"})
        seconds = time.monotonic() - start
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    if path == "/v1/messages":
        assert error["type"] == "invalid_request_error" and "characters" in error["message"]
    else:
        assert error["code"] == "context_length_exceeded" and error["param"] in ("prompt", "messages")
    assert seconds < 1.0, seconds  # tokenizing 10 MB took many seconds; ~0.1 s here, slack for load
    assert rss_mb(pid) - before < 50


def _send_head(url: str, head: bytes) -> tuple[bytes, float]:
    """Write ``head`` (stopping early if the server closes) and read the answer."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            for i in range(0, len(head), 65536):
                sock.sendall(head[i:i + 65536])
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer, time.monotonic() - start


@pytest.mark.parametrize("where", ["worker", "orchestrator"])
def test_a_megabyte_of_headers_is_431(stack, where):
    url, pid = stack[where]
    many = b"".join(b"x-filler-%d: %s\r\n" % (i, b"v" * 1000) for i in range(1000))  # ~1 MB in 1,000 headers
    one_line = b"x-endless: " + b"v" * (1 << 20)  # one header that never ends
    for path, headers, shape in ((b"/v1/completions", many + b"\r\n", "openai"),
                                 (b"/v1/messages", many + b"\r\n", "anthropic"),
                                 (b"/v1/completions", one_line, "openai")):
        before = rss_mb(pid)
        answer, seconds = _send_head(url, b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n%s" % (path, headers))
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        body = msgspec.json.decode(answer.split(b"\r\n\r\n", 1)[1])
        if shape == "anthropic":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        else:
            assert body["error"]["code"] == "request_header_fields_too_large"
        assert seconds < 2.0 and rss_mb(pid) - before < 20
    # A normal request on the same server still works.
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
