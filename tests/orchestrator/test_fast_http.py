"""The fast lane (``orchestrator.fast_http``) over raw sockets and the official SDKs: the generation
routes answer as the ASGI routes did (auth, body limit, 405 with Allow, errors in the API's shape),
pipelined requests that mix the lane and the ASGI app answer in order on one connection, and a
client that leaves aborts the worker's request, streaming or not.

One worker (synthetic engine, 20 ms decode steps) behind one orchestrator process with an API key
and a 4 KiB body limit.
"""

from __future__ import annotations

import json
import socket
import time

import anthropic
import httptools
import httpx
import openai
import pytest
from orchestrator_process import orchestrator_log, start_orchestrator, stop_orchestrator, wait_until
from worker_process import start_worker, stop_worker

KEY = "fast-lane-key"
MAX_BYTES = 4096
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def lane(tiny_model_dir, tmp_path_factory):
    worker_url, worker = start_worker(tiny_model_dir, 1, extra_args=["--synthetic-decode-step-seconds", "0.02"])
    url, proc = start_orchestrator(tmp_path_factory.mktemp("fast-lane"), tiny_model_dir, [("both", worker_url)],
                                   processes=1, api_key=KEY, max_request_bytes=MAX_BYTES)
    yield url, worker_url, proc
    assert stop_orchestrator(proc) == 0
    stop_worker(worker)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _request(method: str, path: str, body: dict | None = None, headers: dict[str, str] | None = None) -> bytes:
    payload = b"" if body is None else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "host: orchestrator", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    if body is not None:
        lines += ["content-type: application/json", f"content-length: {len(payload)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class _Responses:
    """Every response parsed from the bytes of one connection, in order."""

    def __init__(self) -> None:
        self.done: list[dict] = []
        self._current: dict = {}
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._current = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current["headers"][name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._current["body"] += body

    def on_message_complete(self) -> None:
        self._current["status"] = self.parser.get_status_code()
        self.done.append(self._current)


def _exchange(port: int, data: bytes, count: int, timeout: float = 30.0) -> list[dict]:
    """Send ``data`` on one connection and read ``count`` complete responses."""
    responses = _Responses()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        while len(responses.done) < count:
            chunk = sock.recv(65536)
            if not chunk:
                break
            responses.parser.feed_data(chunk)
    return responses.done


def _completion(max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": "tiny-test", "prompt": "once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}


def test_the_sdks_work_through_the_fast_lane(lane):
    url, *_ = lane
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    chunks = list(client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    completion = client.completions.create(model="tiny-test", prompt="hello", max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    message = anthropic.Anthropic(base_url=url, api_key=KEY).messages.create(
        model="tiny-test", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny-test", prompt="hello", max_tokens=3)


def test_api_key_is_required_in_each_api_shape(lane):
    url, *_ = lane
    port = _port(url)
    chat = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    none, wrong, anthropic_none, by_header = _exchange(port, b"".join([
        _request("POST", "/v1/completions", _completion()),
        _request("POST", "/v1/chat/completions", chat, {"authorization": "Bearer nope"}),
        _request("POST", "/v1/messages", chat),
        _request("POST", "/v1/chat/completions", chat, {"x-api-key": KEY}),
    ]), 4)
    assert none["status"] == 401 and json.loads(none["body"])["error"]["code"] == "invalid_api_key"
    assert wrong["status"] == 401
    assert anthropic_none["status"] == 401 and json.loads(anthropic_none["body"])["type"] == "error"
    assert by_header["status"] == 200 and json.loads(by_header["body"])["usage"]["completion_tokens"] == 2


def test_pipelined_requests_of_the_lane_and_the_app_answer_in_order(lane):
    url, *_ = lane
    stream_chat = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                   "stream": True, "ignore_eos": True}
    answers = _exchange(_port(url), b"".join([
        _request("POST", "/v1/completions", _completion(5), {**AUTH, "x-request-id": "pipe-1"}),
        _request("GET", "/v1/models", None, AUTH),
        _request("POST", "/v1/chat/completions", stream_chat, {**AUTH, "x-request-id": "pipe-3"}),
        _request("POST", "/v1/completions?ignored=1", _completion(2), AUTH),  # a query: the ASGI route
        _request("POST", "/v1/completions", _completion(1), {**AUTH, "x-request-id": "pipe-5"}),
    ]), 5)
    assert [a["status"] for a in answers] == [200] * 5
    assert json.loads(answers[0]["body"])["usage"]["completion_tokens"] == 5
    assert answers[0]["headers"]["x-request-id"] == "pipe-1"
    assert json.loads(answers[1]["body"])["data"][0]["id"] == "tiny-test"
    assert answers[2]["headers"]["content-type"].startswith("text/event-stream")
    assert answers[2]["headers"]["transfer-encoding"] == "chunked"
    events = [line for line in answers[2]["body"].decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert json.loads(answers[3]["body"])["usage"]["completion_tokens"] == 2
    assert answers[4]["headers"]["x-request-id"] == "pipe-5"


def test_bodies_over_the_limit_get_413_in_the_api_shape(lane):
    url, *_ = lane
    port = _port(url)
    # A declared length over the limit is refused before a byte of the body is sent.
    head = (b"POST /v1/messages HTTP/1.1\r\nhost: o\r\nx-api-key: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % (KEY.encode(), MAX_BYTES * 10))
    declared, = _exchange(port, head, 1)
    assert declared["status"] == 413 and json.loads(declared["body"])["type"] == "error"
    # A chunked body is refused as it passes the limit.
    piece = b"x" * 1000
    chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: o\r\nauthorization: Bearer %s\r\n"
               b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" % KEY.encode()
               + (b"%x\r\n%s\r\n" % (len(piece), piece)) * 6 + b"0\r\n\r\n")
    streamed, = _exchange(port, chunked, 1)
    assert streamed["status"] == 413 and json.loads(streamed["body"])["error"]["code"] == "request_too_large"
    # Under the limit, chunked: served.
    small = json.dumps(_completion(2)).encode()
    fine, = _exchange(port, b"POST /v1/completions HTTP/1.1\r\nhost: o\r\nauthorization: Bearer %s\r\n"
                            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (KEY.encode(), len(small),
                                                                                         small), 1)
    assert fine["status"] == 200 and json.loads(fine["body"])["usage"]["completion_tokens"] == 2


def test_a_wrong_method_is_405_with_allow_and_bad_json_is_400(lane):
    url, *_ = lane
    wrong = httpx.get(f"{url}/v1/chat/completions", headers=AUTH)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    bad = httpx.post(f"{url}/v1/messages", content=b"{not json", headers=AUTH)
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_expect_100_continue_is_answered_before_the_body(lane):
    url, *_ = lane
    body = json.dumps(_completion(2)).encode()
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: o\r\nauthorization: Bearer %s\r\nexpect: 100-continue\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n" % (KEY.encode(), len(body)))
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):  # connection: close ends it
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"completion_tokens":2' in answer


def _running_steps(worker_url: str) -> int:
    """Engine steps with a running request since the last drain of the worker's /metrics."""
    return sum(1 for step in httpx.get(f"{worker_url}/metrics").json() if step["num_running"] > 0)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_the_worker_request(lane, stream):
    url, worker_url, proc = lane
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as sock:
        sock.sendall(_request("POST", "/v1/completions", _completion(1000, stream=stream), AUTH))
        if stream:
            assert b"data: " in sock.recv(65536)  # relaying
        else:
            wait_until(lambda: _running_steps(worker_url) > 0, timeout=10)  # the worker runs it
    time.sleep(0.3)
    _running_steps(worker_url)  # drain what ran until the abort
    time.sleep(0.3)
    assert _running_steps(worker_url) == 0  # 1000 tokens at 20 ms a step would still be running
    info = httpx.get(f"{url}/cluster_info", headers=AUTH).json()
    assert all(w["in_flight_requests"] == 0 for w in info["workers"])
    records = httpx.get(f"{url}/perf_metrics", headers=AUTH).json()["records"]
    if not stream:  # ended by the client, and recorded as such
        assert records[-1]["error"].startswith("ClientDisconnected")
    assert "Traceback" not in orchestrator_log(proc)  # cancelled at once, not failed writing to a closed socket
