"""The two legs' wire bodies, against recording stand-in workers (real HTTP servers in this process).

The real ctx/gen workers are tested in test_disagg.py; these stand-ins let the
orchestrator's side of the contract (/tmp contract: context_only, generation_only,
finished answers, retries, rejected legs) be checked exactly whatever the workers do.
"""

from __future__ import annotations

import threading
import time

import httpx
import msgspec
import pytest
import uvicorn
from orchestrator_process import start_orchestrator, stop_orchestrator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from worker_process import free_port

from api.tokenizer import Tokenizer
from orchestrator.prompt import ctx_leg_body, parse_request
from orchestrator.validation import RequestValidator
from workers.http_protocol import CtxAnswer

PARAMS = {"request_type": "context_only", "ctx_request_id": "7", "kv_endpoint": "tcp://127.0.0.1:1", "num_tokens": 9,
          "first_token_id": 65, "expires_at": 1e10, "signature": "ab" * 32}


class StandIn:
    """A worker that records every request and answers per ``self.mode``."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.mode = "ok"
        self.port = free_port()

        async def completions(request: Request) -> Response:
            body = msgspec.json.decode(await request.body())
            self.requests.append((request.headers.get("x-request-id"), body))
            if self.mode == "fail":
                return Response(b'{"error": {"message": "boom"}}', status_code=500)
            if self.mode == "reject" and "disaggregated_params" in body:
                return Response(b'{"error": {"message": "no legs here"}}', status_code=400)
            if self.mode == "no_legs" and "disaggregated_params" in body:  # no cluster key (api.disaggregation)
                return Response(b'{"error": {"message": "this worker does not serve disaggregated requests", '
                                b'"param": "disaggregated_params"}}', status_code=400)
            params = body.get("disaggregated_params") or {}
            if params.get("request_type") == "context_only":
                answer_params = {"request_type": "context_only", "finished": True, "first_token_id": 2} \
                    if self.mode == "finished" else PARAMS
                return Response(msgspec.json.encode({
                    "id": "cmpl-ctx", "choices": [{"index": 0, "text": "A", "finish_reason": "stop"}],
                    "disaggregated_params": answer_params,
                    # A leg sent its prompt ids gets none back (api.disaggregation); else its own.
                    **({} if params.get("prompt_token_ids") else {"prompt_token_ids": [7, 8]})}))
            if body.get("stream"):
                async def frames():
                    yield b'data: {"choices": [{"text": "A"}]}\n\n'
                    yield b'data: {"choices": [{"text": "B"}]}\n\ndata: [DONE]\n\n'
                return StreamingResponse(frames(), media_type="text/event-stream")
            return Response(msgspec.json.encode({"id": "cmpl-gen", "choices": [{"index": 0, "text": "AB"}]}))

        async def ok(request: Request) -> Response:
            return Response(b"[]" if request.url.path == "/kv_cache_events" else b"{}")

        app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                                *(Route(p, ok) for p in ("/health", "/worker_info", "/kv_cache_events"))])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def legs(tiny_model_dir, tmp_path_factory):
    ctx_a, ctx_b, gen = StandIn(), StandIn(), StandIn()
    url, proc = start_orchestrator(tmp_path_factory.mktemp("legs"), tiny_model_dir,
                                   [("ctx", ctx_a.url), ("ctx", ctx_b.url), ("gen", gen.url)], processes=1,
                                   conditional={"enabled": False}, health={"interval_seconds": 60.0})
    yield url, ctx_a, ctx_b, gen
    stop_orchestrator(proc)
    for stand_in in (ctx_a, ctx_b, gen):
        stand_in.server.should_exit = True


def reset(*stand_ins: StandIn) -> None:
    for stand_in in stand_ins:
        stand_in.requests.clear()
        stand_in.mode = "ok"


def test_ctx_then_gen_bodies(legs, tiny_model_dir):
    url, ctx_a, ctx_b, gen = legs
    reset(ctx_a, ctx_b, gen)
    ids = Tokenizer.from_model_dir(tiny_model_dir).encode("hello disaggregated world")
    client = {"model": "tiny-test", "prompt": "hello disaggregated world", "max_tokens": 5, "stream": True,
              "stream_options": {"include_usage": True}, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=client, headers={"x-request-id": "r1"}) as response:
        text = response.read()
    assert text == b'data: {"choices": [{"text": "A"}]}\n\ndata: {"choices": [{"text": "B"}]}\n\ndata: [DONE]\n\n'
    assert response.headers["x-disagg-mode"] == "disagg"
    [(ctx_id, ctx)] = ctx_a.requests + ctx_b.requests
    assert ctx_id == "r1-ctx"
    assert ctx == {"model": "tiny-test", "prompt": client["prompt"], "max_tokens": 1, "stream": False,
                   "temperature": 0, "disaggregated_params": {"request_type": "context_only", "prompt_token_ids": ids}}
    [(gen_id, body)] = gen.requests
    assert gen_id == "r1-gen"
    assert body == {**client, "disaggregated_params": {**PARAMS, "request_type": "generation_only",
                                                       "prompt_token_ids": ids}}


def test_finished_ctx_answer_is_the_answer(legs):
    url, ctx_a, ctx_b, gen = legs
    reset(ctx_a, ctx_b, gen)
    ctx_a.mode = ctx_b.mode = "finished"
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "x y z", "max_tokens": 5})
    assert response.headers["x-disagg-mode"] == "ctx_only" and gen.requests == []
    assert response.json() == {"id": "cmpl-ctx", "choices": [{"index": 0, "text": "A", "finish_reason": "stop"}]}
    # A streaming client gets a normal request on the gen worker instead.
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "x", "max_tokens": 5,
                                                         "stream": True})
    assert response.headers["x-disagg-mode"] == "aggregated" and "disaggregated_params" not in gen.requests[0][1]


def test_failed_ctx_worker_is_retried_and_rejected_leg_falls_back(legs):
    url, ctx_a, ctx_b, gen = legs
    reset(ctx_a, ctx_b, gen)
    ctx_a.mode = ctx_b.mode = "fail"
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "p", "max_tokens": 5})
    assert response.status_code == 200 and response.headers["x-disagg-mode"] == "aggregated"
    assert len(ctx_a.requests) == len(ctx_b.requests) == 1  # each ctx worker tried once, then the gen worker
    assert "disaggregated_params" not in gen.requests[0][1]
    gen.mode = "fail"
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "p", "max_tokens": 5})
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_failed"
    reset(ctx_a, ctx_b, gen)
    ctx_b.mode = "fail"
    for _ in range(2):  # round robin meets the failing worker once: retried on the other
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "p", "max_tokens": 5})
        assert response.status_code == 200 and response.headers["x-disagg-ctx-worker"] == "static-0"


def legs_sent(url: str) -> dict[str, float]:
    """The orchestrator's ``disagg_orchestrator_legs_total`` per phase."""
    text = httpx.get(f"{url}/prometheus/metrics").text
    counts = {"ctx": 0.0, "gen": 0.0}
    for line in text.splitlines():
        if line.startswith("disagg_orchestrator_legs_total{"):
            counts[line.split('phase="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return counts


def test_a_rejected_leg_is_the_answer_never_replayed(legs):
    """A ctx worker's 4xx goes to the client as it is: no retry on the other ctx worker, no gen leg."""
    url, ctx_a, ctx_b, gen = legs
    reset(ctx_a, ctx_b, gen)
    ctx_a.mode = ctx_b.mode = "reject"
    before = legs_sent(url)
    for stream in (False, True):
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "p", "max_tokens": 5,
                                                             "stream": stream})
        assert response.status_code == 400 and response.json() == {"error": {"message": "no legs here"}}
    assert len(ctx_a.requests) + len(ctx_b.requests) == 2 and gen.requests == []
    after = legs_sent(url)
    assert after["ctx"] - before["ctx"] == 2 and after["gen"] == before["gen"]


def test_a_worker_that_refuses_the_leg_itself_falls_back_to_a_normal_request(legs):
    """A 400 naming disaggregated_params is about the worker (clients cannot send it): the gen worker serves."""
    url, ctx_a, ctx_b, gen = legs
    reset(ctx_a, ctx_b, gen)
    ctx_a.mode = ctx_b.mode = "no_legs"
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "p", "max_tokens": 5})
    assert response.status_code == 200 and response.headers["x-disagg-mode"] == "aggregated"
    assert len(ctx_a.requests) + len(ctx_b.requests) == 1  # not retried on the other ctx worker
    [(_, body)] = gen.requests
    assert "disaggregated_params" not in body


def test_one_token_requests_skip_the_ctx_leg(legs):
    url, ctx_a, ctx_b, gen = legs
    reset(ctx_a, ctx_b, gen)
    response = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "p", "max_tokens": 1})
    assert response.headers["x-disagg-mode"] == "aggregated" and ctx_a.requests == ctx_b.requests == []


class NoWorkerYet:
    """No worker has reported its limits: validation leaves them to the workers."""

    def max_model_len(self) -> None:
        return None

    def vocab_size(self) -> None:
        return None


def test_parse_request_session_ids_and_leg_bodies(tiny_model_dir):
    tokenizer = RequestValidator(Tokenizer.from_model_dir(tiny_model_dir), "m", NoWorkerYet())
    raw = msgspec.json.encode({"model": "m", "max_tokens": 9, "metadata": {"user_id": "u-1"}, "stream": True,
                               "messages": [{"role": "user", "content": "hi"}]})
    parsed = parse_request("messages", raw, tokenizer, None)
    assert parsed.session_id == "u-1" and parsed.stream and parsed.max_tokens == 9 and parsed.prompt_ids
    assert parse_request("messages", raw, tokenizer, "hdr").session_id == "hdr"
    chat = parse_request("chat", msgspec.json.encode({"model": "m", "user": "alice", "max_completion_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]}),
                         tokenizer, None)
    assert chat.session_id == "alice" and chat.max_tokens == 4
    body = msgspec.json.decode(ctx_leg_body(chat))
    assert body["max_tokens"] == 1 and "max_completion_tokens" not in body and body["messages"] == chat.body["messages"]
    assert body["disaggregated_params"]["prompt_token_ids"] == chat.prompt_ids  # not rendered again by the ctx worker
    assert CtxAnswer().gen_params() is None  # no params: not a ctx answer


