"""A huge prompt under the body limit is refused on its length, before it is tokenized whole
(``Tokenizer.proves_too_long``), at a worker and at the orchestrator, for every API."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import msgspec
import pytest

from frontends.tokenizer import Tokenizer
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import start_worker, stop_worker

TEN_MB = "word " * (2 * 1024 * 1024)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


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
