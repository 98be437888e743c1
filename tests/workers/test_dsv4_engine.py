"""DeepSeek-V4 through the engine: the scheduler's continuous batching over our model, and what it refuses."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.worker_process import start_worker, stop_worker
from tests.workers.dsv4_reference import greedy_tokens, prompt
from tests.workers.engine_runs import run, tokens
from workers.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from workers.engine.core import EngineCore
from workers.engine.model.deepseek_v4.model import DeepseekV4Model, SequenceBatch
from workers.engine.model.deepseek_v4.runner import DeepseekV4Runner
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams


def _config(model_dir: Path, **cache: object) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        device="cpu",
        cache=CacheConfig(block_size=16, num_blocks=200, enable_prefix_caching=False, **cache),  # type: ignore[arg-type]
        # A small token budget: long prompts are prefilled in chunks next to other sequences' decodes.
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96),
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_continuous_batching_gives_each_sequence_its_own_greedy_tokens(tiny_dsv4_dir: Path) -> None:
    core = EngineCore(_config(tiny_dsv4_dir))
    assert isinstance(core.executor, DeepseekV4Runner)
    lengths = [3, 40, 133, 200]
    prompts = [prompt(n, seed=n).tolist() for n in lengths]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = run(core, *[EngineRequest(i, p, params) for i, p in enumerate(prompts)])
    model = core.executor.model
    for i, ids in enumerate(prompts):
        assert tokens(outputs[i]) == greedy_tokens(model, ids, 8), f"prompt of {lengths[i]} tokens"


def test_prefix_caching_is_refused_with_the_key(tiny_dsv4_dir: Path) -> None:
    config = _config(tiny_dsv4_dir)
    with pytest.raises(ConfigError) as error:
        EngineCore(replace(config, cache=replace(config.cache, enable_prefix_caching=True)))
    assert error.value.key == "engine.cache.enable_prefix_caching"


def test_bfloat16_is_refused_with_the_key(tiny_dsv4_dir: Path) -> None:
    with pytest.raises(ConfigError) as error:
        EngineCore(replace(_config(tiny_dsv4_dir), dtype="bfloat16"))
    assert error.value.key == "engine.dtype"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_disagg_serve_answers_with_the_models_greedy_tokens(tiny_dsv4_dir: Path) -> None:
    """A real `disagg serve` worker (launcher, engine process, a frontend) over HTTP."""
    url, proc = start_worker(
        tiny_dsv4_dir, num_frontends=1, engine="torch", extra_args=["--served-model-name", "m"], timeout=900
    )
    try:
        ids = prompt(150, seed=3).tolist()
        body = {"model": "m", "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (150, 6)
        text = response.json()["choices"][0]["text"]
        expected = greedy_tokens(DeepseekV4Model.from_dir(tiny_dsv4_dir), ids, 6)
        assert text == AutoTokenizer.from_pretrained(tiny_dsv4_dir).decode(expected)
    finally:
        assert stop_worker(proc) == 0


def test_prompt_logprobs_score_each_prompt_token_by_the_model(tiny_dsv4_dir: Path) -> None:
    core = EngineCore(_config(tiny_dsv4_dir))
    ids = prompt(130, seed=3).tolist()  # prefilled in two chunks (the budget is 96 tokens)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    entries = run(core, EngineRequest(1, ids, params))[1][0].prompt_logprobs
    assert isinstance(core.executor, DeepseekV4Runner)
    model = core.executor.model
    expected = torch.log_softmax(model.forward(torch.tensor(ids), [SequenceBatch(model.new_state(), len(ids))]), -1)
    assert entries is not None and [e.token_id for e in entries] == ids[1:]
    for position, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(expected[position, ids[position + 1]].item(), abs=1e-4)
        assert entry.top_token_ids == expected[position].topk(2).indices.tolist()
