"""The deployment-wide KV pool through real processes: a ctx worker that lacks a conversation's earlier
turns pulls them from the worker that holds them (here the gen worker, which decoded them), and the
answers equal an aggregated worker's that computed every prompt itself (docs/operations.md, "The KV pool")."""

from __future__ import annotations

import time

import httpx
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator, wait_until
from worker_process import disagg_worker_args, start_worker, stop_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool_cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvpool")
    common = disagg_worker_args(tmp)
    workers = [start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", role, *common])
               for role in ("ctx", "ctx", "gen")]
    both = start_worker(tiny_model_dir, 1, engine="torch")
    # Round robin sends each turn to the other ctx worker: only the pool can give it the earlier turns.
    pool = {"enabled": True, "min_blocks": 1, "overhead_seconds": 0.0}
    url, proc = start_orchestrator(tmp, tiny_model_dir, [("ctx", workers[0][0]), ("ctx", workers[1][0]),
                                                         ("gen", workers[2][0])], processes=1,
                                   conditional={"enabled": False}, ctx_router={"policy": "round_robin"},
                                   kv_pool=pool)
    yield url, both[0], [w[0] for w in workers]
    assert stop_orchestrator(proc) == 0
    for _, worker in (*workers, both):
        stop_worker(worker)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ctx_record(url: str, request_id: str) -> dict | None:
    records = {r["request_id"]: r for r in httpx.get(f"{url}/perf_metrics").json()["records"]}
    record = records.get(request_id)
    return record["ctx_worker"]["record"] if record and record.get("ctx_worker") else None


def test_a_ctx_worker_pulls_the_earlier_turns_and_answers_the_same(pool_cluster):
    url, aggregated, _ = pool_cluster
    messages = [{"role": "system", "content": "You answer questions about serving systems. " * 8}]
    fetched_turns = 0
    for turn in range(4):
        messages.append({"role": "user", "content": f"question {turn}: what is step {turn} of the path? " * 2})
        body = {"model": "tiny-test", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        expected = httpx.post(f"{aggregated}/v1/chat/completions", json=body, timeout=60).json()
        parked_before = metric(url, 'disagg_orchestrator_kv_pool_fetches_total{outcome="parked"}')
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                              headers={"x-request-id": f"pool-turn-{turn}"})
        assert response.status_code == 200 and response.headers["x-disagg-mode"] == "disagg", response.text
        answer = response.json()
        assert answer["choices"][0]["message"] == expected["choices"][0]["message"], turn
        if metric(url, 'disagg_orchestrator_kv_pool_fetches_total{outcome="parked"}') > parked_before:
            fetched_turns += 1
            record = wait_until(lambda request_id=f"pool-turn-{turn}": ctx_record(url, request_id), timeout=10)
            # The ctx worker never saw this conversation: its cached tokens are the pool's blocks.
            assert record["num_cached_tokens"] >= 16, record
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == record["num_cached_tokens"]
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        time.sleep(0.6)  # the KV events of this turn reach the orchestrator's index
    assert fetched_turns >= 2, fetched_turns
    assert metric(url, 'disagg_orchestrator_kv_pool_fetches_total{outcome="failed"}') == 0


def test_a_gen_worker_serves_an_export_but_no_other_ctx_leg(pool_cluster):
    """The export leg (``prefix_export``) is the one context_only leg a gen worker serves."""
    _, _, (_, _, gen) = pool_cluster
    body = {"model": "tiny-test", "prompt": list(range(5, 40)), "max_tokens": 1, "ignore_eos": True}
    refused = httpx.post(f"{gen}/v1/completions", json={**body, "disaggregated_params": {
        "request_type": "context_only"}}, timeout=30)
    assert refused.status_code == 400 and "gen worker" in refused.text
    exported = httpx.post(f"{gen}/v1/completions", json={**body, "disaggregated_params": {
        "request_type": "context_only", "prefix_export": True}}, timeout=30)
    assert exported.status_code == 200, exported.text
    params = exported.json()["disaggregated_params"]
    assert params["signature"] and params["num_tokens"] == 35


def test_a_forged_kv_prefix_is_ignored_not_pulled(pool_cluster):
    """A kv_prefix whose signature does not check never reaches the engine: the prompt is computed."""
    url, aggregated, (ctx, _, _) = pool_cluster
    prompt = list(range(7, 60))
    expected = httpx.post(f"{aggregated}/v1/completions", json={
        "model": "tiny-test", "prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=30).json()
    forged = {"request_type": "context_only", "ctx_request_id": "1", "kv_endpoint": "tcp://127.0.0.1:9",
              "num_tokens": 32, "first_token_id": 1, "expires_at": time.time() + 60, "signature": "00" * 32,
              "prompt_token_ids": prompt[:32]}
    response = httpx.post(f"{ctx}/v1/completions", json={
        "model": "tiny-test", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "disaggregated_params": {"request_type": "context_only", "kv_prefix": forged}}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected["choices"][0]["text"]


def test_a_request_asking_for_prompt_logprobs_fetches_no_prefix(pool_cluster):
    """Its ctx leg scores the whole prompt (pulled KV has no logits): the pool is not asked, and the
    prompt logprobs equal an aggregated worker's."""
    url, aggregated, _ = pool_cluster
    messages = [{"role": "system", "content": "You score prompts for serving systems. " * 8},
                {"role": "user", "content": "how long is the path? " * 3}]
    body = {"model": "tiny-test", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    # One ctx worker computes the conversation; round robin sends the next request to the other, which
    # would pull it from the pool.
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    time.sleep(0.6)  # its KV events reach the orchestrator's index
    expected = httpx.post(f"{aggregated}/v1/chat/completions", json={**body, "prompt_logprobs": 1}, timeout=60).json()
    def fetches() -> float:
        return sum(metric(url, f'disagg_orchestrator_kv_pool_fetches_total{{outcome="{outcome}"}}')
                   for outcome in ("parked", "failed"))

    before = fetches()
    response = httpx.post(f"{url}/v1/chat/completions", json={**body, "prompt_logprobs": 1}, timeout=60)
    assert response.status_code == 200 and response.headers["x-disagg-mode"] == "disagg", response.text
    assert fetches() == before
    ours, theirs = response.json()["prompt_logprobs"], expected["prompt_logprobs"]
    assert ours[0] is None and len(ours) == len(theirs) == expected["usage"]["prompt_tokens"]
    assert [sorted(e) for e in ours[1:]] == [sorted(e) for e in theirs[1:]]
