"""Speculative decoding through the disaggregated flow: the gen worker drafts by prompt lookup.

A ctx worker, a gen worker with ``--num-speculative-tokens`` and an aggregated worker without it
(torch engine, the tiny model): greedy text, stop strings and lengths through the orchestrator
equal the plain worker's, and the gen worker's Prometheus counts drafts verified and accepted.
"""

from __future__ import annotations

import httpx
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator, wait_until
from worker_process import disagg_worker_args, start_worker, stop_worker

SPECULATION = ["--num-speculative-tokens", "6", "--prompt-lookup-min", "1"]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    common = disagg_worker_args(tmp)
    ctx = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "ctx", *common])
    gen = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "gen", *common, *SPECULATION])
    plain = start_worker(tiny_model_dir, 1, engine="torch")
    url, proc = start_orchestrator(tmp, tiny_model_dir, [("ctx", ctx[0]), ("gen", gen[0])],
                                   conditional={"enabled": False})
    yield url, plain[0], gen[0]
    assert stop_orchestrator(proc) == 0
    for _, worker in (ctx, gen, plain):
        stop_worker(worker)


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_greedy_text_stops_and_lengths_equal_a_plain_worker(cluster):
    url, plain, gen = cluster
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n" * 2
    expected = httpx.post(f"{plain}/v1/completions", timeout=120, json=dict(
        model="tiny-test", prompt=prompt, max_tokens=40, temperature=0, ignore_eos=True)).json()["choices"][0]["text"]
    stop = expected[len(expected) // 2:len(expected) // 2 + 3]  # a stop string met mid-output
    for extra in ({}, {"stop": [stop]}, {"max_tokens": 17}, {"stream_interval": 3}):
        kwargs = dict(model="tiny-test", prompt=prompt, max_tokens=40, temperature=0, ignore_eos=True) | extra
        reference = httpx.post(f"{plain}/v1/completions", json=kwargs, timeout=120).json()
        response = httpx.post(f"{url}/v1/completions", json=kwargs, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["x-disagg-mode"] == "disagg"
        body = response.json()
        assert body["choices"][0]["text"] == reference["choices"][0]["text"], extra
        assert body["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"], extra
        if "stop" not in extra:  # (a stop string cuts the text; the usage counts every token the engine sent,
            # and a verify step's tokens come together, as stream_interval's do)
            assert body["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"], extra

    def counted() -> str | None:  # the launcher refreshes its engine figures every second
        text = httpx.get(f"{gen}/prometheus/metrics").text
        return text if _counter(text, "disagg_spec_decode_accepted_tokens_total") > 0 else None

    metrics = wait_until(counted, timeout=10)
    drafted = _counter(metrics, "disagg_spec_decode_draft_tokens_total")
    assert drafted >= _counter(metrics, "disagg_spec_decode_accepted_tokens_total") > 0
