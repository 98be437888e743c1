"""The synthetic engine: EngineCore on the timing model, with real KV bookkeeping."""

from __future__ import annotations

import sys
import time

import pytest
from engine_runs import run, tokens

from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SyntheticConfig
from workers.engine.core import EngineCore
from workers.engine.executor import ProfilingUnsupported, SchedulerOutput
from workers.engine.kv_events import BlockRemoved, BlockStored
from workers.engine.synthetic import NOMINAL_KV_BYTES_PER_TOKEN, SyntheticExecutor
from workers.protocol import EngineRequest, RejectReason, RequestOutput
from workers.sampling_params import SamplingParams


def make_core(num_blocks: int | None = 64, block_size: int = 16, **synthetic) -> EngineCore:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    return EngineCore(EngineConfig(kind="synthetic", cache=cache, synthetic=SyntheticConfig(**synthetic)))


def make_request(request_id: int, prompt: list[int], max_tokens: int = 8, **params) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


PROMPT = list(range(1, 41))


def test_same_prompt_same_tokens_whatever_the_batch():
    alone = tokens(run(make_core(), make_request(0, PROMPT))[0])
    crowd = run(make_core(), *[make_request(i, list(range(i, i + 30))) for i in range(1, 6)], make_request(0, PROMPT))
    assert tokens(crowd[0]) == alone
    assert len(alone) == 8 and len(set(alone)) > 1
    assert all(0 <= t < 32000 for t in alone)
    assert tokens(crowd[1]) != alone


def test_seed_changes_sampled_tokens_deterministically():
    greedy = tokens(run(make_core(), make_request(0, PROMPT))[0])
    seeded = [tokens(run(make_core(), make_request(0, PROMPT, temperature=1.0, seed=5))[0]) for _ in range(2)]
    assert seeded[0] == seeded[1] != greedy


def test_engine_seed_changes_the_stream():
    assert tokens(run(make_core(seed=1), make_request(0, PROMPT))[0]) != tokens(
        run(make_core(seed=2), make_request(0, PROMPT))[0]
    )


def test_chunked_prefill_gives_the_same_tokens():
    expected = tokens(run(make_core(), make_request(0, PROMPT))[0])
    config = EngineConfig(
        kind="synthetic",
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=7),
    )
    assert tokens(run(EngineCore(config), make_request(0, PROMPT))[0]) == expected


def test_no_eos_unless_configured():
    core = make_core(vocab_size=2)  # every token is 0 or 1
    outputs = run(core, make_request(0, [1, 0, 1], max_tokens=50))[0]
    assert len(tokens(outputs)) == 50 and outputs[-1].finish_reason == "length"
    config = EngineConfig(kind="synthetic", cache=CacheConfig(num_blocks=64), synthetic=SyntheticConfig(vocab_size=2))
    stopping = EngineCore(config, SyntheticExecutor(config, eos_token_ids=frozenset({0, 1})))
    outputs = run(stopping, make_request(0, [1, 0, 1], max_tokens=50))[0]
    assert len(tokens(outputs)) == 1 and outputs[-1].finish_reason == "stop"


def test_timing_model_is_respected():
    core = make_core(prefill_seconds_per_token=0.001, decode_step_base_seconds=0.02, decode_seconds_per_seq=0.01)
    executor = core.executor
    assert executor.step_seconds(SchedulerOutput([], num_prefill_tokens=100)) == pytest.approx(0.1)
    assert executor.step_seconds(SchedulerOutput([], num_decode_tokens=3)) == pytest.approx(0.05)
    for i in range(3):
        core.add_request(make_request(i, list(range(i, i + 40)), max_tokens=2))
    started = time.perf_counter()
    core.step()  # 120 prefill tokens: 0.12 s
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    core.step()  # 3 decodes: 0.02 + 3 * 0.01 s
    decode = time.perf_counter() - started
    assert 0.12 <= prefill < 0.6
    assert 0.05 <= decode < 0.5
    stats = core.drain_stats()
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in stats] == [(120, 0), (0, 3)]
    assert stats[0].step_seconds >= 0.12


def test_zero_timing_does_not_sleep():
    core = make_core()
    started = time.perf_counter()
    run(core, *[make_request(i, PROMPT, max_tokens=20) for i in range(8)])
    assert time.perf_counter() - started < 1.0


def test_prefix_cache_hits_events_and_stats_behave_like_the_real_engine():
    core = make_core()
    first = run(core, make_request(0, PROMPT))[0]
    stored = [e for e in core.drain_kv_events()]
    assert [e.event_id for e in stored] == list(range(len(stored)))
    assert all(isinstance(e.event, BlockStored) for e in stored)
    # 40 prompt + 7 computed output tokens: 2 full blocks.
    assert sum(len(e.event.block_hashes) for e in stored) == 2
    second = run(core, make_request(1, PROMPT))[1]
    assert tokens(second) == tokens(first)
    assert (second[0].num_prompt_tokens, second[0].num_cached_tokens) == (40, 32)
    assert (first[0].num_prompt_tokens, first[0].num_cached_tokens) == (40, 0)
    stats = core.drain_stats()
    assert (stats[-1].prefix_cache_queries, stats[-1].prefix_cache_hits) == (80, 32)
    assert stats[-1].prefix_cache_hit_rate == pytest.approx(0.4)
    assert stats[-1].kv_blocks_used == 0 and stats[-1].kv_blocks_cached == 2
    assert stats[-1].kv_blocks_free + stats[-1].kv_blocks_cached == 64


def test_eviction_publishes_removed_events():
    core = make_core(num_blocks=4, block_size=4)
    run(core, make_request(0, list(range(9)), max_tokens=1))  # 2 full blocks cached
    core.drain_kv_events()
    run(core, make_request(1, list(range(100, 115)), max_tokens=1))  # needs all 4 blocks
    kinds = [type(e.event) for e in core.drain_kv_events()]
    assert kinds[0] is BlockRemoved and kinds.count(BlockRemoved) == 1


def test_blocks_all_free_after_finishing_and_after_abort():
    core = make_core(num_blocks=16, block_size=4)
    for i in range(6):
        core.add_request(make_request(i, list(range(i, i + 10)), max_tokens=6))
    core.step()
    core.abort(2)
    outputs = run(core)
    assert outputs[2][-1].finish_reason == "abort"
    assert core.block_manager.num_used_blocks == 0
    assert core.block_manager.num_free_blocks + core.block_manager.num_cached_blocks == 16


def test_preemption_under_pressure_keeps_outputs_identical():
    requests = [make_request(i, list(range(i, i + 10)), max_tokens=12) for i in range(6)]
    expected = {r.request_id: tokens(run(make_core(), r)[r.request_id]) for r in requests}
    core = make_core(num_blocks=12, block_size=4)  # 6 x 22 tokens need 36 blocks
    outputs = run(core, *requests)
    assert {i: tokens(o) for i, o in outputs.items()} == expected
    assert core.scheduler.num_preemptions > 0


def prefill_on_ctx(prompt: list[int]) -> tuple[EngineCore, RequestOutput]:
    """A context-only request: one token, its blocks parked for the gen side."""
    ctx = make_core()
    ctx.add_request(make_request(0, prompt, max_tokens=1), park_kv_seconds=60.0)
    (first,) = run(ctx)[0]
    assert first.finish_reason == "length"
    return ctx, first


def test_disaggregated_round_trip_continues_identically():
    prompt = list(range(3, 38))  # 35 tokens: 3 blocks, the last partial
    reference = tokens(run(make_core(), make_request(0, prompt, max_tokens=6))[0])
    ctx, first = prefill_on_ctx(prompt)
    assert first.new_token_ids == reference[:1]
    parked = ctx.parked_block_ids(0)
    assert len(parked) == 3 and ctx.block_manager.num_used_blocks == 3
    gen = make_core()
    gen.add_remote_request(make_request(0, prompt, max_tokens=6), output_token_ids=first.new_token_ids)
    assert gen.step() == [] and gen.has_unfinished()
    (pull,) = gen.take_kv_pulls()
    assert (pull.request_id, pull.first_block, pull.num_tokens, len(pull.block_ids)) == (0, 0, 35, 3)
    gen.import_blocks(pull.block_ids, ctx.export_blocks(parked))
    assert ctx.release_parked(0) and ctx.block_manager.num_used_blocks == 0
    gen.finish_remote_kv(0)
    outputs = run(gen)[0]
    assert tokens(outputs) == reference[1:]
    assert outputs[-1].finish_reason == "length"
    assert gen.block_manager.num_used_blocks == 0


def test_disaggregated_pull_skips_local_prefix_hits():
    prompt = list(range(3, 38))
    reference = tokens(run(make_core(), make_request(0, prompt, max_tokens=4))[0])
    ctx, first = prefill_on_ctx(prompt)
    gen = make_core()
    run(gen, make_request(9, prompt[:32] + [1, 2], max_tokens=1))  # caches the first 2 blocks
    gen.add_remote_request(make_request(0, prompt, max_tokens=4), output_token_ids=first.new_token_ids)
    gen.step()
    (pull,) = gen.take_kv_pulls()
    assert (pull.first_block, len(pull.block_ids)) == (2, 1)
    gen.import_blocks(pull.block_ids, ctx.export_blocks(ctx.parked_block_ids(0)[2:]))
    gen.finish_remote_kv(0)
    outputs = run(gen)[0]
    assert tokens(outputs) == reference[1:]
    assert outputs[0].num_cached_tokens == 32


def test_disaggregated_wrong_blocks_give_different_tokens():
    prompt = list(range(3, 38))
    reference = tokens(run(make_core(), make_request(0, prompt, max_tokens=4))[0])
    ctx, first = prefill_on_ctx(prompt)
    gen = make_core()
    gen.add_remote_request(make_request(0, prompt, max_tokens=4), output_token_ids=first.new_token_ids)
    gen.step()
    (pull,) = gen.take_kv_pulls()
    gen.import_blocks(pull.block_ids, ctx.export_blocks(ctx.parked_block_ids(0)[::-1]))
    gen.finish_remote_kv(0)
    assert tokens(run(gen)[0]) != reference[1:]


def test_parked_blocks_expire_and_remote_requests_abort_cleanly():
    ctx = make_core()
    ctx.add_request(make_request(0, list(range(20)), max_tokens=1), park_kv_seconds=0.0)
    run(ctx)
    assert ctx.parked_block_ids(0) is not None
    ctx.add_request(make_request(1, [5], max_tokens=1))
    run(ctx)  # the next schedule releases what expired
    assert ctx.parked_block_ids(0) is None and ctx.block_manager.num_used_blocks == 0
    gen = make_core()
    gen.add_remote_request(make_request(0, list(range(20)), max_tokens=4), output_token_ids=[7])
    gen.step()
    assert gen.block_manager.num_used_blocks == 2
    gen.abort(0)
    assert gen.block_manager.num_used_blocks == 0
    assert [(o.request_id, o.finish_reason) for o in gen.step()] == [(0, "abort")]
    assert gen.take_kv_pulls() == [] and not gen.has_unfinished()
    with pytest.raises(ValueError, match="not waiting for pulled KV"):
        gen.finish_remote_kv(0)


def test_num_blocks_and_max_model_len_from_config():
    derived = make_core(num_blocks=None, block_size=16)
    assert derived.block_manager.num_blocks == 256 * 2**20 // (NOMINAL_KV_BYTES_PER_TOKEN * 16)
    assert derived.max_model_len == 8192
    capped = EngineCore(EngineConfig(kind="synthetic", max_model_len=100, cache=CacheConfig(num_blocks=64)))
    assert capped.max_model_len == 100
    small = make_core(num_blocks=4, block_size=16, max_model_len=8192)
    assert small.max_model_len == 64


def test_rejections_come_out_of_the_next_step():
    core = make_core(num_blocks=4, block_size=16)
    core.add_request(make_request(0, list(range(65))))
    core.add_request(make_request(1, [32000]))
    outputs = core.step()
    assert [(o.request_id, o.finish_reason, o.error, o.reject_reason) for o in outputs] == [
        (0, "abort", "prompt has 65 tokens, more than the model's limit of 64 tokens (max_model_len)",
         RejectReason.PROMPT_TOO_LONG),
        (1, "abort", "token id 32000 is outside the vocabulary [0, 32000)", RejectReason.TOKEN_OUT_OF_VOCABULARY),
    ]
    assert all(o.reject_reason.is_client_error for o in outputs)  # the request's fault: a 400
    assert not core.has_unfinished()


def test_logprobs_are_reported_when_asked():
    outputs = run(make_core(), make_request(0, PROMPT, max_tokens=2, logprobs=3))[0]
    for output in outputs:
        (logprobs,) = output.new_logprobs
        assert logprobs.token_id == output.new_token_ids[0]
        assert logprobs.top_token_ids[0] == logprobs.token_id and len(logprobs.top_logprobs) == 3
        assert logprobs.top_logprobs == sorted(logprobs.top_logprobs, reverse=True)
    assert run(make_core(), make_request(0, PROMPT, max_tokens=1))[0][0].new_logprobs is None


def test_profiling_is_unsupported_with_a_clear_error():
    core = make_core()
    with pytest.raises(ProfilingUnsupported, match="nothing to profile"):
        core.start_profile("/tmp/trace")
    with pytest.raises(ProfilingUnsupported):
        core.stop_profile()


def test_synthetic_engine_does_not_import_torch():
    import subprocess

    code = (
        "import sys; from workers.config import EngineConfig; from workers.engine.core import EngineCore; "
        "EngineCore(EngineConfig(kind='synthetic')); print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_has_work_is_false_while_only_pulling_kv():
    gen = make_core()
    gen.add_remote_request(make_request(0, list(range(20)), max_tokens=4), output_token_ids=[7])
    assert gen.has_work()
    gen.step()
    assert gen.has_unfinished() and not gen.has_work()
    (pull,) = gen.take_kv_pulls()
    stats = gen.drain_stats()
    assert stats == []  # nothing ran
    gen.finish_remote_kv(0)
    assert gen.has_work()
    gen.step()
    assert gen.drain_stats()[0].num_decode_tokens == 1


def test_a_parked_request_id_cannot_be_reused_until_released():
    ctx, first = prefill_on_ctx(list(range(3, 38)))
    ctx.add_request(make_request(0, [1, 2, 3]), park_kv_seconds=60.0)
    (output,) = ctx.step()
    assert (output.finish_reason, output.error) == ("abort", "request id 0 still has parked KV blocks")
    assert output.reject_reason is RejectReason.KV_STILL_PARKED and not output.reject_reason.is_client_error
    ctx.release_parked(0)
    ctx.add_request(make_request(0, [1, 2, 3], max_tokens=1), park_kv_seconds=60.0)
    assert run(ctx)[0][0].finish_reason == "length"
    stats = ctx.drain_stats()
    assert stats[-1].kv_blocks_parked == 1 and stats[-1].kv_blocks_used == 1


def test_iteration_stats_count_preemptions_and_finishes_and_travel_as_msgpack():
    import msgspec

    from workers.engine.stats import IterationStats

    core = make_core(num_blocks=12, block_size=4)
    run(core, *[make_request(i, list(range(i, i + 10)), max_tokens=12) for i in range(6)])
    stats = core.drain_stats()
    assert sum(s.num_preemptions for s in stats) == core.scheduler.num_preemptions > 0
    assert sum(s.num_finished for s in stats) == 6
    assert all(s.kv_blocks_used + s.kv_blocks_free + s.kv_blocks_cached == 12 for s in stats)
    assert stats[-1].num_running == 0 and stats[-1].num_waiting == 0
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=list[IterationStats])
    assert decoded == stats
    assert core.drain_stats() == []


def test_random_arrivals_and_aborts_keep_books_balanced_and_tokens_exact():
    import random

    rng = random.Random(1234)
    config = EngineConfig(
        kind="synthetic",
        cache=CacheConfig(block_size=4, num_blocks=24),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=20),
    )
    core = EngineCore(config)
    shared = [rng.randrange(1, 500) for _ in range(12)]
    requests, aborted, outputs = {}, set(), {}
    for _ in range(400):
        if len(requests) < 40 and rng.random() < 0.3:
            prompt = shared[: rng.randrange(0, 13)] + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 20))]
            request = make_request(len(requests), prompt, max_tokens=rng.randrange(1, 16))
            requests[request.request_id] = request
            core.add_request(request)
        if requests and rng.random() < 0.05:
            victim = rng.randrange(len(requests))
            if victim not in outputs or outputs[victim][-1].finish_reason is None:
                core.abort(victim)
                aborted.add(victim)
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        core.check_integrity()
    while core.has_unfinished():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert len(requests) == 40 and len(aborted) > 0
    assert core.scheduler.num_preemptions > 0 and core.scheduler.num_prefix_hits > 0
    assert core.block_manager.num_used_blocks == 0
    for request_id, request in requests.items():
        finish_reason = outputs[request_id][-1].finish_reason
        alone = tokens(run(make_core(), request)[request_id])
        if request_id in aborted:  # only unfinished requests were aborted
            produced = tokens(outputs[request_id])
            assert (finish_reason, produced) == ("abort", alone[: len(produced)])
        else:
            assert (tokens(outputs[request_id]), finish_reason) == (alone, "length")


def test_grammars_and_penalties_are_ignored():
    """A timing model: constrained or penalized requests run as free ones (documented in EngineCore)."""
    from workers.sampling_params import GuidedDecoding

    free = make_request(0, [1, 2, 3], max_tokens=8)
    controlled = make_request(0, [1, 2, 3], max_tokens=8, frequency_penalty=1.0, logit_bias=((5, 100.0),),
                              guided=GuidedDecoding("json_schema", '{"type": "object"}'))
    assert tokens(run(make_core(), controlled)[0]) == tokens(run(make_core(), free)[0])


def test_requests_waiting_for_remote_kv_are_counted_through_every_transition():
    """The stats' count is kept at the transitions (not a scan per step): queued, pulling,
    pulled, and aborted in either waiting state all move it."""
    gen = make_core()
    for request_id in range(3):
        gen.add_remote_request(make_request(request_id, list(range(20)), max_tokens=2), output_token_ids=[7])
    assert gen.scheduler.num_waiting_for_remote_kv == 3  # queued, no blocks yet
    gen.abort(2)  # aborted while queued
    gen.step()  # blocks allocated: pulling
    assert gen.scheduler.num_waiting_for_remote_kv == 2 and len(gen.take_kv_pulls()) == 2
    gen.abort(1)  # aborted while pulling
    gen.finish_remote_kv(0)
    assert gen.scheduler.num_waiting_for_remote_kv == 0
    gen.step()
    assert gen.drain_stats()[-1].num_waiting_for_remote_kv == 0
    run(gen)
    assert gen.scheduler.num_waiting_for_remote_kv == 0 and gen.block_manager.num_used_blocks == 0
