"""The orchestrator and workers at their concurrent-request limit: a worker's 429 means "try
another worker" (never a suspect), and the client gets 429 with Retry-After only when every
worker refused."""

from __future__ import annotations

import httpx
import openai
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import start_worker, stop_worker

HELD = {"model": "tiny-test", "prompt": "hold", "max_tokens": 200, "ignore_eos": True, "stream": True}
SHORT = {"model": "tiny-test", "prompt": "hi", "max_tokens": 2}


def test_a_busy_worker_sends_the_request_elsewhere_and_all_busy_is_429(tiny_model_dir, tmp_path):
    workers = [start_worker(tiny_model_dir, 1, extra_args=["--max-concurrent-requests", "1",
                                                           "--synthetic-decode-step-seconds", "0.05"])
               for _ in range(2)]
    url, orchestrator = start_orchestrator(tmp_path, tiny_model_dir, [("both", w) for w, _ in workers],
                                           processes=1, max_retries=2, health={"interval_seconds": 60.0})
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{url}/v1/completions", json=HELD) as first:
                assert first.status_code == 200
                busy = first.headers["x-disagg-gen-worker"]
                for _ in range(3):  # round robin meets the busy worker: it is skipped, not suspected
                    answer = http.post(f"{url}/v1/completions", json=SHORT)
                    assert answer.status_code == 200 and answer.headers["x-disagg-gen-worker"] != busy
                with http.stream("POST", f"{url}/v1/completions", json=HELD) as second:
                    assert second.status_code == 200
                    refused = http.post(f"{url}/v1/completions", json=SHORT)
                    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                    assert refused.json()["error"]["code"] == "too_many_requests"
                    anthropic_refused = http.post(f"{url}/v1/messages", json={
                        "model": "tiny-test", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                    assert anthropic_refused.status_code == 529 and anthropic_refused.headers["retry-after"] == "1"
                    assert anthropic_refused.json()["error"]["type"] == "overloaded_error"
        # Both workers are still in the rotation: a 429 is busy, not broken.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=3)
        for _ in range(2):
            assert client.completions.create(**SHORT).usage.completion_tokens == 2
        info = httpx.get(f"{url}/cluster_info").json()
        assert all(w["healthy"] for w in info["workers"]), info
    finally:
        assert stop_orchestrator(orchestrator) == 0
        for _, proc in workers:
            stop_worker(proc)
