"""Prompt-lookup speculative decoding: greedy output token for token that of plain decoding.

The tiny random-weight model falls into loops that quote its own earlier output, so drafts are
both accepted and rejected; the prompts repeat text so that lookups hit the prompt too.
"""

from __future__ import annotations

import pytest

from workers.config import ConfigError, EngineConfig, SpeculativeConfig
from workers.engine.speculative import accepted, propose_ngram

# ---- the proposer and the acceptance rule (no model) -----------------------------------------


def test_the_longest_suffix_found_earlier_proposes_what_followed_its_latest_occurrence():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 2, 4, 3) == [4, 5, 1]
    # [2, 3] occurs twice before; the latest wins. The 3-gram [9, 2, 3] occurs nowhere.
    assert propose_ngram([2, 3, 7, 2, 3, 8, 9, 2, 3], 2, 3, 2) == [8, 9]
    # A 3-gram match beats a more recent 2-gram one.
    assert propose_ngram([1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3], 2, 3, 1) == [4]
    assert propose_ngram([1, 2, 3, 1, 2, 3, 4, 1, 2, 3], 2, 3, 5) == [4, 1, 2, 3]  # stops at the end
    assert propose_ngram([7, 7, 7, 7], 1, 4, 3) == [7]  # overlapping runs
    assert propose_ngram([1, 2, 3, 4], 1, 4, 3) == []  # nothing repeats
    assert propose_ngram([5, 1, 2, 6, 2], 2, 4, 3) == []  # only a 1-gram repeats; min is 2
    assert propose_ngram([5, 1, 2, 6, 2], 1, 4, 3) == [6, 2]
    assert propose_ngram([1, 2, 1, 2], 2, 2, 0) == [] and propose_ngram([1], 1, 1, 3) == []


def test_accepted_keeps_the_confirmed_drafts_and_one_sample_more():
    assert accepted([4, 5, 6], [4, 5, 7, 8]) == [4, 5, 7]
    assert accepted([4, 5, 6], [4, 5, 6, 9]) == [4, 5, 6, 9]
    assert accepted([4], [1, 2]) == [1]


def test_the_config_keys_are_validated_by_name(tiny_model_dir):
    def check(**fields):
        EngineConfig(model=str(tiny_model_dir), speculative=SpeculativeConfig(**fields)).validate()

    check(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1)
    with pytest.raises(ConfigError, match=r"engine.num_speculative_tokens: must be in \[0, 32\], got 33"):
        check(num_speculative_tokens=33)
    with pytest.raises(ConfigError, match="engine.prompt_lookup_min: must be >= 1"):
        check(prompt_lookup_min=0)
    with pytest.raises(ConfigError, match=r"engine.prompt_lookup_max: must be in \[prompt_lookup_min \(3\), 16\]"):
        check(prompt_lookup_min=3, prompt_lookup_max=2)


# ---- the engine -----------------------------------------------------------------------------

pytest.importorskip("torch")

from engine_runs import run, run_disaggregated, tokens  # noqa: E402
from test_engine_equivalence import make_core, make_request  # noqa: E402

from workers.protocol import EngineRequest  # noqa: E402

BASE = [5, 17, 33, 99, 12, 8, 71, 40]


def speculating(model_dir, k: int = 4, **options):
    return make_core(model_dir, speculative=SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1), **options)


def repeating_requests(count: int = 10, **params) -> list[EngineRequest]:
    """Prompts that quote themselves, of different lengths and output lengths."""
    return [make_request(i, (BASE * 3)[: 6 + 2 * i] + [i + 3, 9], max_tokens=30 + 3 * i, **params)
            for i in range(count)]


def outputs_by_id(outputs) -> dict[int, tuple[list[int], str | None]]:
    return {i: (tokens(o), o[-1].finish_reason) for i, o in outputs.items()}


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> dict[int, tuple[list[int], str | None]]:
    return outputs_by_id(run(make_core(tiny_model_dir), *repeating_requests()))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_tokens_are_those_of_plain_decoding_with_drafts_accepted_and_rejected(tiny_model_dir, plain, k):
    core = speculating(tiny_model_dir, k)
    assert outputs_by_id(run(core, *repeating_requests())) == plain
    drafted, confirmed = core.scheduler.num_draft_tokens, core.scheduler.num_accepted_tokens
    assert 0 < confirmed < drafted, (drafted, confirmed)
    stats = core.drain_stats()
    assert sum(s.num_draft_tokens for s in stats) == drafted
    assert sum(s.num_accepted_tokens for s in stats) == confirmed
    assert core.load().num_draft_tokens == drafted and core.load().num_accepted_tokens == confirmed
    # Fewer steps than tokens: the point of it.
    assert len(stats) < sum(len(t) for t, _ in plain.values())
    assert core.block_manager.num_used_blocks == 0


def test_small_blocks_chunked_prefill_preemption_and_stream_interval_keep_the_tokens(tiny_model_dir, plain):
    core = speculating(tiny_model_dir, 6, num_blocks=48, max_num_batched_tokens=20)
    outputs = run(core, *repeating_requests(stream_interval=3))
    assert outputs_by_id(outputs) == plain
    assert core.scheduler.num_preemptions > 0 and core.scheduler.num_accepted_tokens > 0
    assert core.block_manager.num_used_blocks == 0


def test_stop_tokens_eos_and_max_tokens_cut_where_plain_decoding_does(tiny_model_dir, plain):
    # A stop id that plain decoding meets mid-output, after a run of accepted drafts; and EOS.
    looping = max(plain.values(), key=lambda entry: len(entry[0]))[0]
    stop_id = looping[len(looping) // 2]
    eos = sorted(make_core(tiny_model_dir).executor.eos_token_ids)
    variants = [dict(stop_token_ids=[stop_id]), dict(stop_token_ids=[stop_id], min_tokens=12),
                dict(ignore_eos=False, stop_token_ids=[looping[5]]), dict(stop_token_ids=eos, ignore_eos=False)]
    for params in variants:
        reference = outputs_by_id(run(make_core(tiny_model_dir), *repeating_requests(**params)))
        core = speculating(tiny_model_dir, 8)
        assert outputs_by_id(run(core, *repeating_requests(**params))) == reference, params
        assert core.scheduler.num_accepted_tokens > 0
        if params is not variants[-1]:  # (the random model may never sample EOS)
            assert any(reason == "stop" for _, reason in reference.values()), f"no stop met: {params}"
    # max_tokens never overrun, whatever k: every output is exactly its cap long.
    for i, (output_tokens, reason) in plain.items():
        assert (len(output_tokens), reason) == (30 + 3 * i, "length")


def test_sampled_constrained_and_logprob_requests_do_not_speculate(tiny_model_dir):
    seeded = [make_request(i, (BASE * 3)[:12], max_tokens=20, temperature=0.9, seed=i) for i in range(3)]
    logprobs = [make_request(10, (BASE * 3)[:12], max_tokens=20, logprobs=2)]
    penalized = [make_request(11, (BASE * 3)[:12], max_tokens=20, repetition_penalty=1.3)]
    requests = seeded + logprobs + penalized
    core = speculating(tiny_model_dir)
    with_speculation = run(core, *requests)
    assert core.scheduler.num_draft_tokens == 0
    reference = run(make_core(tiny_model_dir), *requests)
    assert outputs_by_id(with_speculation) == outputs_by_id(reference)


def test_a_gen_engine_speculates_after_pulling_the_prompts_kv(tiny_model_dir, plain):
    """The disaggregated flow: the ctx engine prefills and samples the first token, the gen engine
    pulls the KV and decodes the rest with drafts; the tokens are those of one engine alone."""
    (request,) = [r for r in repeating_requests() if r.request_id == 7]
    ctx, gen = make_core(tiny_model_dir), speculating(tiny_model_dir)
    first_leg = make_request(7, request.prompt_token_ids, max_tokens=1)
    first, rest = run_disaggregated(ctx, gen, first_leg, request)
    assert (first.new_token_ids + tokens(rest), rest[-1].finish_reason) == plain[7]
    assert gen.scheduler.num_accepted_tokens > 0
    assert ctx.block_manager.num_used_blocks == 0 and gen.block_manager.num_used_blocks == 0
