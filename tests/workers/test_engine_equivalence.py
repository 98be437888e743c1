"""The real tiny model through EngineCore: batching, caching and transfer never change tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from engine_runs import run, tokens

from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine.core import EngineCore
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_core(
    model_dir, num_blocks: int = 256, max_num_batched_tokens: int = 2048, block_size: int = BLOCK_SIZE, **options
) -> EngineCore:
    config = EngineConfig(
        kind="torch",
        model=str(model_dir),
        device="cpu",
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        **options,
    )
    return EngineCore(config)


def make_request(request_id: int, prompt: list[int], max_tokens: int = 8, **params) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


def mixed_requests(count: int = 16, **params) -> list[EngineRequest]:
    """Prompts of 1 to 61 tokens, some sharing a prefix, token ids spread over the vocabulary."""
    requests = []
    for i in range(count):
        length = 1 + (i * 13) % 61
        start = 7 if i % 4 == 0 else 31 * i
        requests.append(make_request(i, [(start + 17 * k) % 500 + 5 for k in range(length)], **params))
    return requests


@pytest.fixture(scope="module")
def alone_tokens(tiny_model_dir) -> dict[int, list[int]]:
    core = make_core(tiny_model_dir)
    return {r.request_id: tokens(run(core, r)[r.request_id]) for r in mixed_requests()}


def test_batched_greedy_tokens_equal_each_request_alone(tiny_model_dir, alone_tokens):
    outputs = run(make_core(tiny_model_dir), *mixed_requests())
    assert {i: tokens(o) for i, o in outputs.items()} == alone_tokens
    assert all(len(t) == 8 for t in alone_tokens.values())


def test_native_decode_kernel_keeps_greedy_tokens(tiny_model_dir, alone_tokens):
    # Block size 16: the kernel's; the alone runs (block size 4) attend through SDPA.
    core = make_core(tiny_model_dir, num_blocks=128, block_size=16, decode_attention="native")
    outputs = run(core, *mixed_requests())
    assert {i: tokens(o) for i, o in outputs.items()} == alone_tokens
    assert core.block_manager.num_used_blocks == 0


def test_chunked_prefill_and_preemption_keep_greedy_tokens(tiny_model_dir, alone_tokens):
    core = make_core(tiny_model_dir, num_blocks=40, max_num_batched_tokens=24)
    outputs = run(core, *mixed_requests())
    assert {i: tokens(o) for i, o in outputs.items()} == alone_tokens
    assert core.scheduler.num_preemptions > 0
    assert core.block_manager.num_used_blocks == 0


def test_prefix_cache_hit_computes_less_and_gives_identical_tokens(tiny_model_dir):
    shared = [(11 * k) % 500 + 5 for k in range(33)]
    first, second = make_request(0, shared + [9, 8, 7]), make_request(1, shared + [100, 200])
    expected = tokens(run(make_core(tiny_model_dir), second)[1])
    core = make_core(tiny_model_dir)
    run(core, first)
    core.drain_stats()
    outputs = run(core, second)[1]
    assert tokens(outputs) == expected
    assert (outputs[0].num_prompt_tokens, outputs[0].num_cached_tokens) == (35, 32)
    assert sum(s.num_prefill_tokens for s in core.drain_stats()) == 35 - 32


def test_exported_blocks_continue_identically_on_another_engine(tiny_model_dir):
    prompt = [(7 * k) % 500 + 5 for k in range(30)]  # 8 blocks, the last partial
    reference = tokens(run(make_core(tiny_model_dir), make_request(0, prompt, max_tokens=6))[0])
    ctx = make_core(tiny_model_dir)
    ctx.add_request(make_request(0, prompt, max_tokens=1), park_kv_seconds=60.0)
    (first,) = run(ctx)[0]
    assert first.new_token_ids == reference[:1]
    gen = make_core(tiny_model_dir)
    run(gen, make_request(5, prompt[:12] + [1, 2, 3]))  # the gen engine holds 3 of the blocks
    gen.add_remote_request(make_request(0, prompt, max_tokens=6), output_token_ids=first.new_token_ids)
    gen.step()
    (pull,) = gen.take_kv_pulls()
    assert (pull.first_block, len(pull.block_ids)) == (3, 5)
    gen.import_blocks(pull.block_ids, ctx.export_blocks(ctx.parked_block_ids(0)[pull.first_block :]))
    assert ctx.release_parked(0)
    gen.finish_remote_kv(0)
    assert tokens(run(gen)[0]) == reference[1:]
    assert ctx.block_manager.num_used_blocks == 0 and gen.block_manager.num_used_blocks == 0


def test_seeded_sampling_is_independent_of_batch_composition(tiny_model_dir):
    seeded = [make_request(i, [(5 * i + k) % 500 + 5 for k in range(9 + i)], temperature=1.0, seed=i) for i in range(4)]
    alone = {r.request_id: tokens(run(make_core(tiny_model_dir), r)[r.request_id]) for r in seeded}
    others = mixed_requests(6, temperature=0.8, top_k=50)
    others = [EngineRequest(100 + r.request_id, r.prompt_token_ids, r.sampling_params) for r in others]
    together = run(make_core(tiny_model_dir, max_num_batched_tokens=16), *others, *seeded)
    assert {i: tokens(together[i]) for i in alone} == alone
    reseeded = make_request(0, seeded[0].prompt_token_ids, temperature=1.0, seed=12345)
    assert tokens(run(make_core(tiny_model_dir), reseeded)[0]) != alone[0]
