"""Disaggregated serving through the orchestrator when workers die, and conditional disaggregation.

Two ctx workers and one gen worker (synthetic engine, real KV transfer over
TCP, a 2 s pull timeout), one orchestrator with conditional disaggregation on
and KV-aware gen routing. The tests run in file order: the last two SIGKILL
workers.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator, wait_until
from worker_process import disagg_worker_args, spawn_worker, start_worker, stop_worker

# A ctx leg prefills for ~0.1 s (150 tokens) and a gen leg decodes for ~0.1 s: requests are in
# flight on every worker when one is killed.
TIMING = ["--synthetic-prefill-seconds-per-token", "0.0007", "--synthetic-decode-step-seconds", "0.02"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def unique_prompt(tag: str, words: int = 40) -> str:
    """A prompt no worker holds (its first token differs), long enough never to skip the ctx leg."""
    return f"{tag} " + " ".join(WORDS[i % len(WORDS)] for i in range(words))


def completion(url: str, prompt: str, max_tokens: int = 6, timeout: float = 60, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout, json={
        "model": "tiny-test", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra})


def workers_info(url: str) -> dict[str, dict]:
    return {w["worker_id"]: w for w in httpx.get(f"{url}/cluster_info").json()["workers"]}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg-faults")
    common = disagg_worker_args(tmp) + ["--kv-pull-timeout", "2", *TIMING]
    gen_args = ["--role", "gen", *common]
    ctx = [start_worker(tiny_model_dir, 1, extra_args=["--role", "ctx", *common]) for _ in range(2)]
    gen = start_worker(tiny_model_dir, 1, extra_args=gen_args)
    workers = {"static-0": ctx[0], "static-1": ctx[1], "static-2": gen}
    url, proc = start_orchestrator(
        tmp, tiny_model_dir, [("ctx", ctx[0][0]), ("ctx", ctx[1][0]), ("gen", gen[0])], processes=1,
        ctx_router={"policy": "round_robin"}, gen_router={"policy": "kv_cache_aware"},
        conditional={"enabled": True, "max_local_prefill_tokens": 4, "min_cached_fraction": 0.75},
        health={"interval_seconds": 0.2, "timeout_seconds": 1.0, "unhealthy_threshold": 2})
    state = {"url": url, "workers": workers, "model_dir": tiny_model_dir, "gen_args": gen_args}
    yield state
    assert stop_orchestrator(proc) == 0
    for _, worker in state["workers"].values():
        stop_worker(worker)


def test_conditional_disaggregation_skips_the_ctx_leg_on_a_cache_hit(cluster):
    url = cluster["url"]
    prompt = unique_prompt("conditional", words=80)
    first = completion(url, prompt)
    assert first.status_code == 200 and first.headers["x-disagg-mode"] == "disagg"
    # The gen worker pulled the prompt's KV: its KV events tell the orchestrator which blocks it holds.
    wait_until(lambda: workers_info(url)["static-2"]["num_cached_blocks"] >= 4, timeout=10)
    again = completion(url, prompt + " and one more question")
    assert again.status_code == 200 and again.headers["x-disagg-mode"] == "aggregated"
    assert "x-disagg-ctx-worker" not in again.headers and again.json()["usage"]["completion_tokens"] == 6
    fresh = completion(url, unique_prompt("another", words=80))  # nothing cached: both legs again
    assert fresh.headers["x-disagg-mode"] == "disagg"


def test_a_ctx_worker_killed_under_load_loses_no_request(cluster):
    url, workers = cluster["url"], cluster["workers"]
    results: list[tuple[int, int | None, str | None]] = []
    stop = threading.Event()

    def client(index: int) -> None:
        n = 0
        while not stop.is_set():
            response = completion(url, unique_prompt(f"load-{index}-{n}"), timeout=60)
            tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else None
            results.append((response.status_code, tokens, response.headers.get("x-disagg-ctx-worker")))
            n += 1

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(8)]
        wait_until(lambda: sum(1 for r in results if r[2] == "static-0") >= 3, timeout=30)
        workers["static-0"][1].send_signal(signal.SIGKILL)  # ctx legs and parked KV on it are lost
        killed_at = len(results)
        wait_until(lambda: len(results) >= killed_at + 24, timeout=60)
        stop.set()
        for future in futures:
            future.result()
    workers["static-0"][1].wait()
    failed = [r for r in results if r[0] != 200 or r[1] != 6]
    assert failed == [], failed
    # The kill hit requests in flight: their ctx legs were retried on static-1, or their gen
    # legs (the KV gone with static-0) were served again as normal requests.
    metrics = httpx.get(f"{url}/prometheus/metrics").text
    retries = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("disagg_orchestrator_retries_total{"))
    assert retries >= 1, metrics
    wait_until(lambda: not workers_info(url)["static-0"]["healthy"], timeout=10)
    assert all(r[2] == "static-1" for r in results[killed_at + 8:])  # out of the rotation


def test_the_gen_worker_killed_mid_stream_then_restarted(cluster):
    url, workers = cluster["url"], cluster["workers"]
    gen_proc = workers["static-2"][1]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
            "model": "tiny-test", "prompt": unique_prompt("stream"), "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as stream:
        assert stream.headers["x-disagg-mode"] == "disagg"
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        gen_proc.send_signal(signal.SIGKILL)
        frames = [line for line in lines if line.startswith("data: ")]
    assert msgspec.json.decode(frames[-2][6:])["error"]["code"] == "upstream_failed"
    assert frames[-1] == "data: [DONE]"
    gen_proc.wait()
    wait_until(lambda: not workers_info(url)["static-2"]["healthy"], timeout=10)
    assert httpx.get(f"{url}/health").status_code == 503  # no gen worker left
    assert completion(url, unique_prompt("nobody")).status_code == 503

    restarted = spawn_worker(cluster["model_dir"], 1, port=gen_proc.port, extra_args=cluster["gen_args"])
    workers["static-2"] = (workers["static-2"][0], restarted)
    assert restarted.ready.wait(60), "the gen worker did not restart"
    wait_until(lambda: workers_info(url)["static-2"]["healthy"], timeout=10)
    response = completion(url, unique_prompt("back again"))
    assert response.status_code == 200 and response.headers["x-disagg-mode"] == "disagg", (response.headers, response.text)
    assert response.headers["x-disagg-gen-worker"] == "static-2" and response.json()["usage"]["completion_tokens"] == 6
