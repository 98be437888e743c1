"""/prometheus/metrics on a real worker with 4 frontends: one multiprocess view from any of them."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from worker_process import start_worker, stop_worker

K = 4


def samples(text: str, name: str) -> dict[str, float]:
    """{labels: value} of the series ``name`` (exact metric name, with or without labels)."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            found[series[len(name):]] = float(value)
    return found


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=K, engine="synthetic",
                             extra_args=["--served-model-name", "tiny", "--num-blocks", "128"])
    yield url
    assert stop_worker(proc) == 0
    assert os.listdir(proc.ipc_root) == []


@pytest.mark.asyncio
async def test_counters_of_all_frontends_sum_in_every_scrape(worker):
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=worker, timeout=30, limits=limits) as http:
        responses = await asyncio.gather(*(
            http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
            for _ in range(64)))
        assert all(r.status_code == 200 for r in responses)
        assert len({r.headers["x-disagg-frontend"] for r in responses}) >= 3
        scrapes = [await http.get("/prometheus/metrics") for _ in range(32)]
    assert {s.headers["x-disagg-frontend"] for s in scrapes} == {"0", "1", "2", "3"}
    for scrape in scrapes:
        assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
        text = scrape.text
        # Known label values exist at zero: a dashboard's "no failures" is a 0 series, not a missing one.
        assert samples(text, "disagg_request_success_total") == {'{finished_reason="length"}': 64.0,
                                                                 '{finished_reason="stop"}': 0.0}
        assert samples(text, "disagg_request_failure_total") == {'{reason="abort"}': 0.0,
                                                                 '{reason="incomplete"}': 0.0}
        assert samples(text, "disagg_inter_token_latency_seconds_count") == {"": 64.0}  # 3 tokens each
        assert samples(text, "disagg_frontends") == {"": float(K)}  # one per live frontend, summed
        assert samples(text, "disagg_generation_tokens_total") == {"": 192.0}
        assert samples(text, "disagg_e2e_request_latency_seconds_count") == {"": 64.0}
        assert samples(text, "disagg_time_to_first_token_seconds_count") == {"": 64.0}
        # The launcher's series: once per scrape, no pid label.
        assert samples(text, "disagg_num_requests_running") == {"": 0.0}
        assert samples(text, "disagg_num_requests_waiting") == {"": 0.0}
        assert samples(text, "disagg_kv_cache_usage_ratio") == {"": 0.0}
        (config,) = samples(text, "disagg_config_info")
        assert 'engine="synthetic"' in config and 'num_frontends="4"' in config and 'num_blocks="128"' in config
        assert text.count("# TYPE disagg_config_info gauge") == 1


@pytest.mark.asyncio
async def test_long_chat_pieces_are_tokenized_once_per_frontend_and_counted(worker):
    system = "You are a careful assistant. " * 24  # one piece of ~700 characters: kept (api.piece_cache)
    served = []
    async with httpx.AsyncClient(base_url=worker, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        for i in range(12):
            response = await http.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 2, "messages": [{"role": "system", "content": system},
                                                               {"role": "user", "content": f"question {i}"}]})
            assert response.status_code == 200, response.text
            served.append(response.headers["x-disagg-frontend"])
        text = (await http.get("/prometheus/metrics")).text
    # Each frontend tokenized the system prompt the first time it saw it and found it after that.
    frontends = len(set(served))
    assert samples(text, "disagg_prompt_piece_cache_lookups_total") == {
        '{result="hit"}': float(12 - frontends), '{result="miss"}': float(frontends)}


@pytest.mark.asyncio
async def test_every_process_reports_its_own_process_figures_and_the_build(worker):
    from api.process_metrics import SAMPLE_SECONDS

    await asyncio.sleep(SAMPLE_SECONDS + 0.5)  # every frontend has sampled itself at least once
    async with httpx.AsyncClient(base_url=worker, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        scrapes = [(await http.get("/prometheus/metrics")).text for _ in range(8)]
    for text in scrapes:  # whichever frontend answers: all of them, each once
        rss = samples(text, "process_resident_memory_bytes")
        by_process: dict[str, set[str]] = {}
        for labels, value in rss.items():
            process = labels.split('process="')[1].split('"')[0]
            by_process.setdefault(process, set()).add(labels.split('pid="')[1].split('"')[0])
            assert value > 10e6, labels  # a Python process with its imports: tens of MB at least
        assert {p: len(pids) for p, pids in by_process.items()} == {"launcher": 1, "engine": 1, "frontend": K - 1}
        # pid: the process that wrote the series; the engine's is written by its launcher.
        assert len(by_process["frontend"] | by_process["launcher"]) == K and by_process["engine"] == by_process["launcher"]
        assert len(samples(text, "process_cpu_seconds_total")) == K + 1
        started = {labels.split('process="')[1].split('"')[0]: value
                   for labels, value in samples(text, "process_start_time_seconds").items()}
        assert len(samples(text, "process_start_time_seconds")) == K + 1
        assert started["engine"] >= started["launcher"]  # the launcher spawned it
        assert all(v >= 4 for v in samples(text, "process_open_fds").values())
        (build,) = samples(text, "disagg_build_info")  # the same build in every process: one series
        assert 'version="' in build and 'commit="' in build
