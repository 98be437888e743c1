"""A real worker (the tiny torch model, a pool of 12 blocks) serves an evicted prompt from its host
and disk KV tiers: identical tokens, its full blocks reported as cached, the tiers' figures in
``/metrics`` and ``/kv_cache_events``."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from worker_process import start_worker, stop_worker, worker_log

BLOCK_SIZE = 16
PROMPT = [(7 * i) % 400 + 50 for i in range(97)]  # six full blocks and one token
OTHERS = [[(11 * i + 13 * k) % 400 + 50 for i in range(97)] for k in range(1, 4)]


def block_bytes(model_dir) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * BLOCK_SIZE * config["num_key_value_heads"] * head_dim * 4  # float32


def complete(url: str, prompt: list[int]) -> tuple[str, int]:
    body = {"model": "tiny-test", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    details = answer["usage"].get("prompt_tokens_details") or {}
    return answer["choices"][0]["text"], details.get("cached_tokens", 0)


def prometheus_sample(url: str, series: str, timeout: float = 20.0) -> float:
    """The series' value once the launcher's gauge refresh (a health reply a second or so) has set it."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/prometheus/metrics", timeout=30).text
        match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
        if (match and float(match.group(1)) > 0) or time.monotonic() > deadline:
            return float(match.group(1)) if match else 0.0
        time.sleep(0.5)


@pytest.mark.parametrize("host_blocks,disk_blocks", [(24, 0), (2, 24)], ids=["host", "disk"])
def test_an_evicted_prompt_comes_back_from_the_tiers_with_identical_output(tiny_model_dir, tmp_path, host_blocks,
                                                                           disk_blocks):
    per_block = block_bytes(tiny_model_dir)
    args = ["--device", "cpu", "--num-blocks", "12", "--block-size", str(BLOCK_SIZE),
            "--kv-host-tier-bytes", str(host_blocks * per_block)]
    if disk_blocks:
        args += ["--kv-disk-tier-path", str(tmp_path / "kv"), "--kv-disk-tier-bytes", str(disk_blocks * per_block)]
    url, proc = start_worker(tiny_model_dir, num_frontends=1, engine="torch", extra_args=args, timeout=120)
    try:
        httpx.get(f"{url}/kv_cache_events", timeout=30)  # start the drain from here
        first, cached = complete(url, PROMPT)
        assert cached == 0
        for other in OTHERS:  # each takes 7 of the 12 blocks: the prompt's are evicted
            complete(url, other)
        again, cached = complete(url, PROMPT)
        assert again == first
        assert cached == 6 * BLOCK_SIZE  # every full block, from the pool or a tier
        stats = [s for s in httpx.get(f"{url}/metrics", timeout=30).json() if s.get("tiers")]
        tiers = stats[-1]["tiers"]
        assert tiers["host_hits"] + tiers["disk_hits"] >= 1 and tiers["disk_failures"] == 0
        assert (tiers["disk_hits"] > 0) == (disk_blocks > 0)
        assert tiers["bytes_onboarded"] == (tiers["host_hits"] + tiers["disk_hits"]) * per_block
        events = httpx.get(f"{url}/kv_cache_events", timeout=30).json()
        tiers_seen = {e["event"].get("tier", "pool") for e in events}
        assert {"pool", "host"} <= tiers_seen and ("disk" in tiers_seen) == (disk_blocks > 0)
        tier = "disk" if disk_blocks else "host"
        assert prometheus_sample(url, f'disagg_kv_tier_hits_total{{tier="{tier}"}}') == tiers[f"{tier}_hits"]
    except Exception:
        print(worker_log(proc))
        raise
    finally:
        assert stop_worker(proc) == 0
    if disk_blocks:
        assert list((tmp_path / "kv").iterdir()) == []  # the engine removed its disk tier at exit
