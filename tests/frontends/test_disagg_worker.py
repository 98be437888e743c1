"""HTTP level: real ctx and gen workers (``disagg serve --role ctx|gen``); the test plays
the orchestrator (a context_only call, then a generation_only call with the returned params).

Invariant: the disaggregated answer equals the same request's answer from one
aggregated worker (text, finish reason, usage), streaming or not, OpenAI and
Anthropic; after every test both engines have zero KV blocks in use.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.worker_process import free_port, start_worker, stop_worker, worker_log

BLOCK_SIZE = 4
MODEL = "tiny-test"
# Token-id prompts: partial blocks (5, 7, 13) and exact block multiples (4, 8, 16).
ID_PROMPTS = [list(range(30, 30 + n)) for n in (1, 4, 5, 7, 8, 13, 16)]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("key") / "cluster.key"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path


def _start(model_dir, role: str, key_file, num_frontends: int = 1, engine: str = "synthetic", key: bool = True):
    args = ["--role", role, "--block-size", str(BLOCK_SIZE)]
    if key:
        args += ["--cluster-key-file", str(key_file)]
    return start_worker(model_dir, num_frontends, engine, extra_args=args, timeout=120)


@pytest.fixture(scope="module")
def workers(tiny_model_dir, key_file):
    """(ctx url, gen url); both also answer plain requests (the ctx worker's are the aggregated reference)."""
    ctx_url, ctx_proc = _start(tiny_model_dir, "ctx", key_file)
    try:
        gen_url, gen_proc = _start(tiny_model_dir, "gen", key_file, num_frontends=2)
    except BaseException:
        stop_worker(ctx_proc)
        raise
    yield ctx_url, gen_url
    for proc in (ctx_proc, gen_proc):
        assert stop_worker(proc) == 0, worker_log(proc)


def _blocks_used(url: str) -> float | None:
    text = httpx.get(f"{url}/prometheus/metrics", timeout=10).text
    match = re.search(r"^disagg_kv_cache_blocks_used(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)
    return None if match is None else float(match.group(1))


def assert_no_blocks_in_use(*urls: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while (used := _blocks_used(url)) != 0.0:
            assert time.monotonic() < deadline, f"{url}: {used} KV blocks still in use"
            time.sleep(0.2)


@pytest.fixture(autouse=True)
def no_leak(request):
    yield
    if "workers" in request.fixturenames:
        assert_no_blocks_in_use(*request.getfixturevalue("workers"))


# ---- the orchestrator, by hand -------------------------------------------------


def ctx_leg(url: str, path: str, body: dict) -> dict:
    ctx_body = {**body, "stream": False, "max_tokens": 1, "disaggregated_params": {"request_type": "context_only"}}
    ctx_body.pop("stream_options", None)
    response = httpx.post(f"{url}{path}", json=ctx_body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def gen_body(body: dict, ctx_answer: dict) -> dict:
    params = {**ctx_answer["disaggregated_params"], "request_type": "generation_only",
              "prompt_token_ids": ctx_answer["prompt_token_ids"]}
    return {**body, "disaggregated_params": params}


def post(url: str, path: str, body: dict) -> tuple[int, dict | list[dict]]:
    """Status and JSON body, or the list of SSE data objects of a stream."""
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    if not body.get("stream") or response.status_code != 200:
        return response.status_code, response.json()
    events = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return response.status_code, events


def _uncached(usage: dict) -> dict:
    """Usage without the cache split: which prompt tokens hit a cache depends on the order requests ran in."""
    usage = dict(usage)
    if "cache_read_input_tokens" in usage:
        usage["input_tokens"] += usage.pop("cache_read_input_tokens")
    usage.pop("prompt_tokens_details", None)
    return usage


def summary(path: str, answer) -> tuple:
    """(text, finish reason, usage) of any API's answer, streamed or not."""
    if path == "/v1/messages":
        if isinstance(answer, dict):
            return "".join(b["text"] for b in answer["content"]), answer["stop_reason"], _uncached(answer["usage"])
        text = "".join(e["delta"]["text"] for e in answer if e["type"] == "content_block_delta")
        delta = next(e for e in answer if e["type"] == "message_delta")
        return text, delta["delta"]["stop_reason"], _uncached(delta["usage"])
    if isinstance(answer, dict):
        choice = answer["choices"][0]
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        return text, choice["finish_reason"], _uncached(answer["usage"])
    chunks = [e for e in answer if e.get("choices")]
    if path == "/v1/completions":
        text = "".join(c["choices"][0]["text"] for c in chunks)
    else:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")]
    usage = [e["usage"] for e in answer if e.get("usage")]
    return text, finish[-1], _uncached(usage[-1]) if usage else None


def disaggregated(ctx_url: str, gen_url: str, path: str, body: dict):
    answer = ctx_leg(ctx_url, path, body)
    params = answer["disaggregated_params"]
    assert params["request_type"] == "context_only" and not params.get("finished")
    status, result = post(gen_url, path, gen_body(body, answer))
    assert status == 200, result
    return result


def check_same(ctx_url: str, gen_url: str, path: str, body: dict) -> None:
    # A plain request on the ctx worker (it computes every KV itself): the aggregated answer.
    status, reference = post(ctx_url, path, body)
    assert status == 200, reference
    assert summary(path, disaggregated(ctx_url, gen_url, path, body)) == summary(path, reference)


def completion(prompt, stream: bool = False, max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# ---- tests -------------------------------------------------------------------


def test_worker_info(workers):
    ctx_url, gen_url = workers
    ctx_info, gen_info = (httpx.get(f"{u}/worker_info").json() for u in workers)
    assert (ctx_info["role"], gen_info["role"]) == ("ctx", "gen")
    assert ctx_info["kv_endpoint"].startswith("tcp://127.0.0.1:")
    assert gen_info["kv_endpoint"] != ctx_info["kv_endpoint"]
    assert (ctx_info["block_size"], ctx_info["hash_seed"], ctx_info["model"]) == (BLOCK_SIZE, 0, MODEL)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_aggregated(workers, stream):
    ctx_url, gen_url = workers
    for prompt in [*ID_PROMPTS, "Hello there, how are you today?"]:
        check_same(ctx_url, gen_url, "/v1/completions", completion(prompt, stream))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_aggregated(workers, stream):
    ctx_url, gen_url = workers
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about blocks."}],
            "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    check_same(ctx_url, gen_url, "/v1/chat/completions", body)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_equals_aggregated(workers, stream):
    ctx_url, gen_url = workers
    body = {"model": MODEL, "max_tokens": 7, "temperature": 0, "stream": stream,
            "system": "Be brief.", "messages": [{"role": "user", "content": "What is a KV cache?"}]}
    check_same(ctx_url, gen_url, "/v1/messages", body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_ctx_leg_sent_its_prompt_ids_uses_them_and_echoes_none(workers, path):
    """The orchestrator's ids (it rendered and tokenized the body already) are the ctx leg's prompt;
    the answer leaves them out, and the gen leg built from them is the aggregated answer."""
    ctx_url, gen_url = workers
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about blocks."}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    echoed = ctx_leg(ctx_url, path, body)  # ids rendered by the worker: the reference prompt
    ids = echoed["prompt_token_ids"]
    assert post(gen_url, path, gen_body(body, echoed))[0] == 200  # frees the parked KV
    sent = {**body, "stream": False, "max_tokens": 1,
            "disaggregated_params": {"request_type": "context_only", "prompt_token_ids": ids}}
    response = httpx.post(f"{ctx_url}{path}", json=sent, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "prompt_token_ids" not in answer and "prompt_token_ids" not in answer["disaggregated_params"]
    # The signature binds the ids the ctx leg prefilled: other ids are refused, these are served.
    other = gen_body(body, {**answer, "prompt_token_ids": [*ids[:-1], ids[-1] + 1]})
    status, error = post(gen_url, path, other)
    assert status == 400 and "signature does not check" in error["error"]["message"], error
    status, result = post(gen_url, path, gen_body(body, {**answer, "prompt_token_ids": ids}))
    assert status == 200, result
    assert summary(path, result) == summary(path, post(ctx_url, path, body)[1])
    # Ids outside the vocabulary are the client's 400 as any token-id prompt's, never the engine's.
    bad = {**sent, "disaggregated_params": {"request_type": "context_only", "prompt_token_ids": [10**9]}}
    response = httpx.post(f"{ctx_url}{path}", json=bad, timeout=60)
    assert response.status_code == 400, response.text


def test_concurrent_requests_equal_aggregated(workers):
    ctx_url, gen_url = workers
    bodies = [completion(list(range(100 + i, 110 + 3 * i)), stream=i % 2 == 1) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        disagg = list(pool.map(lambda b: disaggregated(ctx_url, gen_url, "/v1/completions", b), bodies))
    for body, answer in zip(bodies, disagg):
        status, reference = post(ctx_url, "/v1/completions", body)
        assert summary("/v1/completions", answer) == summary("/v1/completions", reference)


def test_unsigned_or_forged_params_are_400(workers):
    ctx_url, gen_url = workers
    body = completion(ID_PROMPTS[5])
    answer = ctx_leg(ctx_url, "/v1/completions", body)
    good = gen_body(body, answer)
    forged_endpoint = {**good["disaggregated_params"], "kv_endpoint": "tcp://10.9.9.9:1"}
    unsigned = {k: v for k, v in good["disaggregated_params"].items() if k != "signature"}
    other_prompt = {**good["disaggregated_params"], "prompt_token_ids": list(range(40, 53))}
    for params in (forged_endpoint, unsigned, other_prompt):
        status, error = post(gen_url, "/v1/completions", {**body, "disaggregated_params": params})
        assert status == 400, error
        assert error["error"]["param"] == "disaggregated_params"
    # Nothing was pulled or released: the genuine params still work.
    status, result = post(gen_url, "/v1/completions", good)
    assert status == 200
    assert summary("/v1/completions", result) == summary("/v1/completions", post(ctx_url, "/v1/completions", body)[1])


def test_roles_refuse_the_other_leg(workers):
    ctx_url, gen_url = workers
    body = completion(ID_PROMPTS[3])
    status, error = post(gen_url, "/v1/completions",
                         {**body, "max_tokens": 1, "disaggregated_params": {"request_type": "context_only"}})
    assert status == 400 and "gen worker" in error["error"]["message"]
    answer = ctx_leg(ctx_url, "/v1/completions", body)
    status, error = post(ctx_url, "/v1/completions", gen_body(body, answer))
    assert status == 400 and "ctx worker" in error["error"]["message"]
    assert post(gen_url, "/v1/completions", gen_body(body, answer))[0] == 200  # frees the parked KV


def test_transfer_numbers_in_perf_records_and_prometheus(workers):
    ctx_url, gen_url = workers
    for _ in range(2):  # each frontend of the gen worker may answer; /perf_metrics drains
        httpx.get(f"{gen_url}/perf_metrics", timeout=10)
    disaggregated(ctx_url, gen_url, "/v1/completions", completion(list(range(200, 217))))
    pulled: list[dict] = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and time.monotonic() < deadline:  # records are shipped a moment after the answer
        time.sleep(0.1)
        records = httpx.get(f"{gen_url}/perf_metrics", timeout=10).json()
        records = records["records"] if isinstance(records, dict) else records
        pulled += [r for r in records if r.get("kv_transfer_blocks") and r["num_prompt_tokens"] == 17]
    assert len(pulled) == 1, pulled
    record = pulled[0]
    assert record["kv_transfer_blocks"] == 5  # 17 prompt tokens over blocks of 4, nothing cached before
    assert record["kv_transfer_bytes"] == 5 * 8 * BLOCK_SIZE  # synthetic blocks: one uint64 per slot
    assert record["kv_transfer_seconds"] > 0 and record["kv_transfer_bytes_per_second"] > 0
    text = httpx.get(f"{gen_url}/prometheus/metrics", timeout=10).text
    assert re.search(r"^disagg_kv_transfer_bytes_total [1-9]", text, re.M), text


def test_torch_tokens_equal_aggregated(tiny_model_dir, key_file):
    """Two role-both workers on the tiny model: A's ctx leg, B's gen leg vs A alone."""
    a_url, a_proc = _start(tiny_model_dir, "both", key_file, engine="torch")
    try:
        b_url, b_proc = _start(tiny_model_dir, "both", key_file, engine="torch")
        try:
            for prompt in [ID_PROMPTS[2], ID_PROMPTS[4], ID_PROMPTS[5], "The quick brown fox"]:
                body = completion(prompt, max_tokens=6)
                status, reference = post(a_url, "/v1/completions", body)
                got = disaggregated(a_url, b_url, "/v1/completions", body)
                assert summary("/v1/completions", got) == summary("/v1/completions", reference)
            assert_no_blocks_in_use(a_url, b_url)
        finally:
            assert stop_worker(b_proc) == 0, worker_log(b_proc)
    finally:
        assert stop_worker(a_proc) == 0, worker_log(a_proc)


def test_ctx_role_without_a_cluster_key_does_not_start(tiny_model_dir, tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.delenv("DISAGG_CLUSTER_KEY_FILE", raising=False)
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(tiny_model_dir), "--engine", "synthetic",
            "--port", str(free_port()), "--role", "ctx"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "needs a cluster key" in done.stderr
    loose = tmp_path / "loose.key"
    loose.write_text("ab" * 32)
    loose.chmod(0o644)
    done = subprocess.run([*argv, "--cluster-key-file", str(loose)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "must be 0600" in done.stderr


def test_worker_registers_heartbeats_and_deregisters(tiny_model_dir, key_file):
    """A stub orchestrator on a real socket records what a --register-url worker sends."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received: list[tuple[str, dict]] = []

    class Stub(BaseHTTPRequestHandler):
        def do_POST(self):  # http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, body))
            answer = {"worker_id": "w-1", "ttl_seconds": 1.0, "heartbeat_seconds": 0.2} if self.path.endswith("/register") else {}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url, proc = start_worker(tiny_model_dir, 1, extra_args=[
            "--role", "gen", "--cluster-key-file", str(key_file),
            "--register-url", f"http://127.0.0.1:{server.server_port}"], timeout=120)
        try:
            deadline = time.monotonic() + 10
            while sum(path == "/workers/heartbeat" for path, _ in received) < 2:
                assert time.monotonic() < deadline, received
                time.sleep(0.1)
        finally:
            assert stop_worker(proc) == 0, worker_log(proc)
        path, body = received[0]
        assert path == "/workers/register" and body["role"] == "gen" and body["url"] == url
        assert body["kv_endpoint"].startswith("tcp://127.0.0.1:")
        assert received[-1] == ("/workers/deregister", {"worker_id": "w-1"})
    finally:
        server.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_replayed_params_are_prefilled_on_the_gen_worker_once_the_kv_is_released(workers, stream):
    """The pull of a replayed leg finds no parked KV: the gen engine prefills the prompt itself
    (its client may hold the first token already), and the answer is still the aggregated one."""
    ctx_url, gen_url = workers
    body = completion(list(range(300, 311)), stream)
    answer = ctx_leg(ctx_url, "/v1/completions", body)
    assert post(gen_url, "/v1/completions", gen_body(body, answer))[0] == 200  # the ack frees the ctx KV
    status, replay = post(gen_url, "/v1/completions", gen_body(body, answer))
    assert status == 200, replay
    assert summary("/v1/completions", replay) == summary("/v1/completions", post(ctx_url, "/v1/completions", body)[1])


def test_a_first_token_that_stops_parks_nothing(workers):
    ctx_url, gen_url = workers
    body = completion(list(range(400, 409)))
    parked = ctx_leg(ctx_url, "/v1/completions", body)
    first = parked["disaggregated_params"]["first_token_id"]
    assert post(gen_url, "/v1/completions", gen_body(body, parked))[0] == 200  # frees it again
    answer = ctx_leg(ctx_url, "/v1/completions", {**body, "stop_token_ids": [first]})
    assert answer["disaggregated_params"] == {"request_type": "context_only", "finished": True,
                                              "first_token_id": first}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["prompt_token_ids"] == list(range(400, 409))


def event_texts(path: str, events: list[dict]) -> list[str]:
    """The text of each streamed event, in order (the token sequence as the client saw it)."""
    if path == "/v1/messages":
        return [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    key = "text" if path == "/v1/completions" else "content"
    return [c["choices"][0][key] if key == "text" else c["choices"][0]["delta"].get("content") or ""
            for c in events if c.get("choices")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_the_ctx_legs_first_token_streams_as_its_own_event_then_the_rest(workers, path):
    """The gen leg streams the ctx leg's first token at once, as the aggregated worker streams its
    first: the same events one for one (no token twice, none missing), the same usage, also at the
    smallest gen leg (max_tokens 2)."""
    ctx_url, gen_url = workers
    for max_tokens in (2, 6):
        if path == "/v1/completions":
            body = completion("Count the blocks in the cache", True, max_tokens)
        else:
            body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": "Count the blocks in the cache"}]}
            if path == "/v1/chat/completions":
                body["stream_options"] = {"include_usage": True}
        status, reference = post(ctx_url, path, body)
        assert status == 200 and len(event_texts(path, reference)) >= 2, reference  # the first token alone first
        disagg = disaggregated(ctx_url, gen_url, path, body)
        assert event_texts(path, disagg) == event_texts(path, reference)
        assert summary(path, disagg) == summary(path, reference)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_across_the_first_and_second_token_ends_the_answer_as_aggregated(workers, stream):
    ctx_url, gen_url = workers
    body = completion("Stop strings that span two tokens", True, 6)
    texts = event_texts("/v1/completions", post(ctx_url, "/v1/completions", body)[1])
    assert texts[0] and texts[1], texts
    stop = texts[0][-1] + texts[1][0]
    body = {**completion("Stop strings that span two tokens", stream, 6), "stop": [stop]}
    status, reference = post(ctx_url, "/v1/completions", body)
    assert status == 200 and summary("/v1/completions", reference)[1] == "stop", reference
    # Text and finish reason; not usage: the tokens counted past a stop string are those of the
    # engine output it was found in, and how many outputs the lane reader coalesced is timing.
    disagg = disaggregated(ctx_url, gen_url, "/v1/completions", body)
    assert summary("/v1/completions", disagg)[:2] == summary("/v1/completions", reference)[:2]


def test_the_first_token_is_streamed_before_the_kv_pull_ends(tiny_model_dir, key_file):
    """With the ctx engine stopped (SIGSTOP) the pull cannot finish, yet the first event (the ctx
    leg's token) arrives at once; once it runs again the rest follows, as aggregated."""
    import signal

    from tests.worker_procs import children_of

    ctx_url, ctx_proc = _start(tiny_model_dir, "ctx", key_file)
    try:
        gen_url, gen_proc = _start(tiny_model_dir, "gen", key_file)
    except BaseException:
        stop_worker(ctx_proc)
        raise
    engines = children_of(ctx_proc.pid)
    try:
        body = completion(list(range(200, 221)), True, 5)
        reference = post(ctx_url, "/v1/completions", body)[1]
        answer = ctx_leg(ctx_url, "/v1/completions", body)
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)
        events: list[dict] = []
        with httpx.stream("POST", f"{gen_url}/v1/completions", json=gen_body(body, answer), timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    break
            assert event_texts("/v1/completions", events) == event_texts("/v1/completions", reference)[:1]
            time.sleep(0.5)  # the engine stays stopped: nothing more can come
            for pid in engines:
                os.kill(pid, signal.SIGCONT)
            events += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert event_texts("/v1/completions", events) == event_texts("/v1/completions", reference)
        assert_no_blocks_in_use(ctx_url, gen_url)
    finally:
        for pid in engines:
            os.kill(pid, signal.SIGCONT)
        assert stop_worker(gen_proc) == 0, worker_log(gen_proc)
        assert stop_worker(ctx_proc) == 0, worker_log(ctx_proc)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_cover_every_token_including_the_ctx_legs_first(workers, stream):
    ctx_url, gen_url = workers
    body = {**completion(ID_PROMPTS[3], stream, max_tokens=6), "logprobs": 2}

    def logprobs(answer) -> dict:
        choices = [answer["choices"][0]] if isinstance(answer, dict) else [e["choices"][0] for e in answer
                                                                           if e.get("choices")]
        merged: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        for choice in choices:
            for key in merged:
                merged[key] += (choice.get("logprobs") or {}).get(key) or []
        return merged

    status, reference = post(ctx_url, "/v1/completions", body)
    assert status == 200
    expected = logprobs(reference)
    assert len(expected["tokens"]) == 6
    assert logprobs(disaggregated(ctx_url, gen_url, "/v1/completions", body)) == expected


@pytest.mark.parametrize("stream", [False, True])
def test_gen_leg_reports_the_ctx_legs_cached_tokens(workers, stream):
    """Cached prompt tokens of a disaggregated request are the ctx leg's hits (api.disaggregation)."""
    ctx_url, gen_url = workers
    prompt = f"A prompt that only the ctx worker has seen before ({stream})" * 2
    post(ctx_url, "/v1/completions", completion(prompt))  # the ctx worker caches it; the gen worker never saw it
    answer = ctx_leg(ctx_url, "/v1/completions", completion(prompt))
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= BLOCK_SIZE and answer["disaggregated_params"]["num_cached_tokens"] == cached
    status, result = post(gen_url, "/v1/completions", gen_body(completion(prompt, stream), answer))
    assert status == 200, result
    usage = [e["usage"] for e in result if e.get("usage")][-1] if stream else result["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached

    body = {"model": MODEL, "max_tokens": 5, "stream": stream, "messages": [{"role": "user", "content": prompt}]}
    post(ctx_url, "/v1/messages", body | {"stream": False})
    answer = ctx_leg(ctx_url, "/v1/messages", body)
    cached = answer["usage"]["cache_read_input_tokens"]
    assert cached >= BLOCK_SIZE and answer["disaggregated_params"]["num_cached_tokens"] == cached
    status, result = post(gen_url, "/v1/messages", gen_body(body, answer))
    assert status == 200, result
    if stream:
        start = next(e for e in result if e["type"] == "message_start")["message"]["usage"]
        final = next(e for e in result if e["type"] == "message_delta")["usage"]
        assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"] == cached
        assert final["input_tokens"] == answer["usage"]["input_tokens"]
    else:
        assert result["usage"]["cache_read_input_tokens"] == cached
        assert result["usage"]["input_tokens"] == answer["usage"]["input_tokens"]


def test_a_gen_leg_from_a_killed_ctx_worker_is_served_within_seconds_not_the_pull_timeout(tiny_model_dir, key_file):
    import signal

    from tests.worker_procs import children_of, group_pids_alive, wait_until

    ctx_url, ctx_proc = _start(tiny_model_dir, "ctx", key_file)
    gen_url, gen_proc = start_worker(tiny_model_dir, 1, extra_args=[
        "--role", "gen", "--block-size", str(BLOCK_SIZE), "--cluster-key-file", str(key_file),
        "--kv-pull-timeout", "30"], timeout=120)
    try:
        body = completion(list(range(400, 421)))
        answer = ctx_leg(ctx_url, "/v1/completions", body)  # its KV is parked on the ctx engine ...
        pids = [ctx_proc.pid, *children_of(ctx_proc.pid)]
        for pid in pids:  # ... which dies with its worker before the gen leg pulls it
            os.kill(pid, signal.SIGKILL)
        ctx_proc.wait()
        wait_until(lambda: group_pids_alive(pids) == [], 5)
        started = time.monotonic()
        status, served = post(gen_url, "/v1/completions", gen_body(body, answer))
        assert time.monotonic() - started < 5  # the refused connection, not 30 s of silence
        assert status == 200, served  # prefilled on the gen engine instead
        reference = post(gen_url, "/v1/completions", body)[1]
        assert summary("/v1/completions", served) == summary("/v1/completions", reference)
        assert_no_blocks_in_use(gen_url)

        def recomputed() -> str | None:  # counted once, from the request's perf record
            text = httpx.get(f"{gen_url}/prometheus/metrics", timeout=10).text
            return re.search(r"^disagg_kv_transfer_recomputed_total ([0-9.]+)$", text, re.M)[1]

        wait_until(lambda: recomputed() == "1.0", 5)
        records: list[dict] = []

        def both_recorded() -> bool:  # the gen leg's and the reference's (drained on read)
            page = httpx.get(f"{gen_url}/perf_metrics", timeout=10).json()
            records.extend(r for r in (page["records"] if isinstance(page, dict) else page)
                           if r["num_prompt_tokens"] == 21)
            return len(records) == 2

        wait_until(both_recorded, 5)
        assert sorted(r["kv_recomputed"] for r in records) == [False, True], records
        assert [r["kv_transfer_seconds"] for r in records] == [None, None]  # no transfer figures for it
    finally:
        if ctx_proc.poll() is None:
            stop_worker(ctx_proc)
        assert stop_worker(gen_proc) == 0, worker_log(gen_proc)
