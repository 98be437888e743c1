"""stream_interval: the engine gathers N tokens per output after the first, token for token the same stream."""

from __future__ import annotations

import pytest
from engine_runs import run, tokens

from workers.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from workers.engine.core import EngineCore
from workers.protocol import EngineRequest, RequestOutput
from workers.sampling_params import SamplingParams

PROMPT = list(range(1, 41))


def make_core(stream_interval: int = 1) -> EngineCore:
    return EngineCore(EngineConfig(kind="synthetic", cache=CacheConfig(block_size=16, num_blocks=64),
                                   scheduler=SchedulerConfig(stream_interval=stream_interval)))


def request(request_id: int, max_tokens: int = 10, **params) -> EngineRequest:
    return EngineRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def test_default_streams_every_token():
    outputs = run(make_core(), request(0))[0]
    assert [len(o.new_token_ids) for o in outputs] == [1] * 10


def test_each_output_is_exactly_what_the_rules_report():
    """The per-token shortcut of ``Scheduler.update`` builds the outputs ``request_output`` would:
    the prompt and cache counts on the first only, the finish reason on the last only, logprobs
    on every output that asked for them."""
    outputs = run(make_core(), request(0, max_tokens=4))[0]
    ids = tokens(outputs)
    assert outputs == [RequestOutput(0, [ids[0]], num_prompt_tokens=len(PROMPT)), RequestOutput(0, [ids[1]]),
                       RequestOutput(0, [ids[2]]), RequestOutput(0, [ids[3]], "length")]
    with_logprobs = run(make_core(), request(0, max_tokens=3, logprobs=2))[0]
    assert tokens(with_logprobs) == ids[:3]
    assert [(o.finish_reason, o.num_prompt_tokens, len(o.new_logprobs)) for o in with_logprobs] == [
        (None, len(PROMPT), 1), (None, 0, 1), ("length", 0, 1)]


@pytest.mark.parametrize(("interval", "sizes"), [(4, [1, 4, 4, 1]), (3, [1, 3, 3, 3]), (16, [1, 9])])
def test_engine_interval_gathers_tokens_first_token_at_once(interval, sizes):
    expected = tokens(run(make_core(), request(0))[0])
    outputs = run(make_core(interval), request(0))[0]
    assert [len(o.new_token_ids) for o in outputs] == sizes
    assert tokens(outputs) == expected
    assert outputs[0].num_prompt_tokens == len(PROMPT)
    assert [o.finish_reason for o in outputs] == [None] * (len(sizes) - 1) + ["length"]


def test_request_interval_overrides_the_engine_and_carries_logprobs():
    core = make_core(stream_interval=2)
    every = run(make_core(), request(0, logprobs=1))[0]
    outputs = run(core, request(0, logprobs=1, stream_interval=4), request(1, max_tokens=5))
    assert [len(o.new_token_ids) for o in outputs[0]] == [1, 4, 4, 1]
    assert [len(o.new_token_ids) for o in outputs[1]] == [1, 2, 2]  # the engine's interval
    assert tokens(outputs[0]) == tokens(every)
    gathered = [lp for o in outputs[0] for lp in o.new_logprobs]
    assert gathered == [lp for o in every for lp in o.new_logprobs]
    assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in outputs[0])


def test_abort_with_unreported_tokens_frees_every_block():
    core = make_core(stream_interval=8)
    core.add_request(request(0, max_tokens=100))
    for _ in range(4):
        core.step()
    core.abort(0)
    outputs = core.step()
    assert [o.finish_reason for o in outputs] == ["abort"]
    assert not core.has_unfinished()
    core.check_integrity()
    assert core.block_manager.num_used_blocks == 0


def test_out_of_range_intervals_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="stream_interval"):
        SchedulerConfig(stream_interval=0).validate()
    with pytest.raises(ValueError, match="stream_interval must be in"):
        SamplingParams(stream_interval=1025).validate()
