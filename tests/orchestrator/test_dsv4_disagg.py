"""DeepSeek-V4 disaggregated: a ctx worker prefills, a gen worker decodes from the pulled state.

Real processes (two `disagg serve` workers of the torch engine, an orchestrator), the tiny
checkpoint with an ``index_topk`` that keeps every CSA entry: there transformers' own cached
decode agrees with its full forward (docs/deepseek_v4.md), so its greedy ``generate`` is a
fair reference next to one aggregated engine. The workers' layouts differ too: ctx on 2
ranks -> gen on 1, ctx on 1 -> gen on 2 (every rank keeps the whole state, so each gen rank
pulls every block from one ctx rank), token-identical to the one-process engine, streamed or not.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from orchestrator_process import start_orchestrator, stop_orchestrator, wait_until
from transformers import AutoTokenizer, DeepseekV4ForCausalLM
from worker_process import disagg_worker_args, start_worker, stop_worker

from tests.workers.dsv4_reference import prompt
from tests.workers.engine_runs import run, tokens
from workers.config import CacheConfig, EngineConfig
from workers.engine.core import EngineCore
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

# 45: inside the window (128); 126: the gen side's decode crosses the window and the first HCA
# entry (128) and CSA entries; 263: past the window, 2 HCA entries, a CSA tail of 3.
LENGTHS = (45, 126, 263)
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def aggregated(tiny_dsv4_keep_all_dir: Path) -> dict[int, list[int]]:
    """Each prompt's greedy tokens on one aggregated engine in this process, checked against transformers'."""
    model_dir = tiny_dsv4_keep_all_dir
    prompts = _prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    core = EngineCore(EngineConfig(model=str(model_dir), device="cpu",
                                   cache=CacheConfig(block_size=16, num_blocks=200, enable_prefix_caching=False)))
    out = {i: tokens(o) for i, o in run(core, *[EngineRequest(i, p, params) for i, p in enumerate(prompts)]).items()}
    reference = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        generated = [reference.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):]
                     for p in prompts]
    assert [out[i] for i in range(len(prompts))] == [g.tolist() for g in generated]
    return out


# (ctx ranks, gen ranks)
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"ctx{layout[0]}-gen{layout[1]}")
def test_disaggregated_tokens_equal_aggregated_and_transformers(tiny_dsv4_keep_all_dir: Path, tmp_path: Path,
                                                               aggregated: dict[int, list[int]],
                                                               layout: tuple[int, int]) -> None:
    model_dir = tiny_dsv4_keep_all_dir
    prompts = _prompts()
    common = disagg_worker_args(tmp_path)
    started = []
    try:
        for role, ranks in zip(("ctx", "gen"), layout):
            started.append(start_worker(model_dir, 1, engine="torch", timeout=900, extra_args=[
                "--role", role, "--tensor-parallel-size", str(ranks), *common]))
        url, orchestrator = start_orchestrator(tmp_path, model_dir, [("ctx", started[0][0]), ("gen", started[1][0])],
                                               processes=1, conditional={"enabled": False}, timeout=300)
        try:
            decode = AutoTokenizer.from_pretrained(model_dir).decode
            for i, ids in enumerate(prompts):
                for stream in (False, True):
                    request_id = f"dsv4-{i}-{'stream' if stream else 'whole'}"
                    text = _complete(url, model_dir.name, ids, stream, request_id)
                    assert text == decode(aggregated[i]), f"prompt of {LENGTHS[i]}, stream {stream}"
                    # The gen leg decoded from the pulled state (every block of the prompt), not from a
                    # prefill of its own after a failed pull.
                    gen = wait_until(lambda rid=request_id: _gen_record(url, rid), timeout=30)
                    assert (gen["kv_transfer_blocks"], gen["kv_recomputed"]) == (-(-LENGTHS[i] // 16), False)
        finally:
            stop_orchestrator(orchestrator)
    finally:
        for _, proc in started:
            assert stop_worker(proc) == 0


def _prompts() -> list[list[int]]:
    return [prompt(n, seed=n).tolist() for n in LENGTHS]


def _complete(url: str, model: str, ids: list[int], stream: bool, request_id: str) -> str:
    body = {"model": model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600, headers={"x-request-id": request_id})
    assert response.status_code == 200, response.text
    assert response.headers["x-disagg-mode"] == "disagg"
    if not stream:
        return response.json()["choices"][0]["text"]
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def _gen_record(url: str, request_id: str) -> dict | None:
    records = {r["request_id"]: r for r in httpx.get(f"{url}/perf_metrics").json()["records"]}
    record = records.get(request_id)
    return record["gen_worker"]["record"] if record and record["gen_worker"] else None
