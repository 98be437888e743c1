"""ModelRunner as an Executor: attributes, execute's outputs, profiling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.config import CacheConfig, EngineConfig
from workers.engine.executor import ScheduledRequest, SchedulerOutput
from workers.engine.model.tiny import make_tiny_model
from workers.engine.model_runner import ModelRunner
from workers.sampling_params import SamplingParams

PROMPT = [0, 47, 268, 290, 228, 42, 72, 77]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    return ModelRunner(EngineConfig(model=str(model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=32)))


def test_executor_attributes(runner: ModelRunner, tmp_path: Path) -> None:
    assert (runner.vocab_size, runner.num_blocks, runner.block_size) == (512, 32, 4)
    assert runner.max_model_len == 2048  # the model's max_position_embeddings
    assert runner.eos_token_ids == frozenset({1, 4})  # <|end_of_text|>, <|eot_id|>
    model_dir = make_tiny_model(tmp_path / "short")
    short = ModelRunner(EngineConfig(model=str(model_dir), device="cpu", max_model_len=64))
    assert short.max_model_len == 64
    assert short.num_blocks == (256 * 2**20) // short.kv_cache.shape.bytes_per_block


def test_execute_samples_only_final_chunks(runner: ModelRunner) -> None:
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    batch = SchedulerOutput(
        [
            ScheduledRequest(10, PROMPT, 0, [0, 1], True, greedy, 0),
            ScheduledRequest(11, PROMPT[:4], 0, [2], False, greedy, 0),
            ScheduledRequest(12, PROMPT[:5], 0, [3, 4], True, SamplingParams(seed=1), 0),
        ],
        num_prefill_tokens=17,
    )
    output = runner.execute(batch)
    assert output.token_ids[1] is None and None not in (output.token_ids[0], output.token_ids[2])
    logits = runner.compute_logits(SchedulerOutput([ScheduledRequest(10, PROMPT, 0, [5, 6], True, greedy, 0)]))
    assert output.token_ids[0] == int(logits[0].argmax())
    assert output.logprobs is not None
    assert output.logprobs[0] is not None and output.logprobs[0].top_token_ids[0] == output.token_ids[0]
    assert output.logprobs[1] is None and output.logprobs[2] is None
    assert runner.execute(SchedulerOutput([])).token_ids == []


def test_positions_past_max_model_len_are_refused(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "short")
    runner = ModelRunner(EngineConfig(model=str(model_dir), device="cpu", max_model_len=6))
    request = ScheduledRequest(1, PROMPT, 0, [0], True, SamplingParams(), 0)
    with pytest.raises(ValueError, match="request 1 reaches position 8 > max_model_len"):
        runner.execute(SchedulerOutput([request]))


def test_profile_writes_a_chrome_trace(runner: ModelRunner, tmp_path: Path) -> None:
    runner.start_profile(str(tmp_path / "traces"))
    with pytest.raises(RuntimeError, match="already running"):
        runner.start_profile(str(tmp_path / "traces"))
    runner.execute(SchedulerOutput([ScheduledRequest(1, PROMPT, 0, [7, 8], True, SamplingParams(), 0)]))
    path = Path(runner.stop_profile())
    assert path.parent == tmp_path / "traces"
    events = json.loads(path.read_text())["traceEvents"]
    assert any("linear" in str(event.get("name", "")) for event in events)
    with pytest.raises(RuntimeError, match="not running"):
        runner.stop_profile()
