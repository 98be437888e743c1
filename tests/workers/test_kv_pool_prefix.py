"""A ctx request whose prompt's leading blocks come from a peer engine (the KV pool): pulled, not computed."""

from __future__ import annotations

from engine_runs import run, tokens
from test_synthetic import make_core, make_request, prefill_on_ctx


def test_a_prefix_pulled_from_a_peer_continues_as_if_computed_here():
    prefix = list(range(3, 51))  # 48 tokens: 3 whole blocks, parked on the holder
    prompt = prefix + list(range(60, 75))  # 63 tokens: 15 more to prefill here
    reference = run(make_core(), make_request(0, prompt, max_tokens=1))[0]
    holder, _ = prefill_on_ctx(prefix)
    ctx = make_core()
    ctx.add_remote_request(make_request(7, prompt, max_tokens=1), (), park_kv_seconds=60.0,
                           num_remote_tokens=len(prefix))
    assert ctx.step() == []
    (pull,) = ctx.take_kv_pulls()
    assert (pull.first_block, len(pull.block_ids), pull.num_tokens) == (0, 3, 48)
    ctx.import_blocks(pull.block_ids, holder.export_blocks(holder.parked_block_ids(0)))
    ctx.finish_remote_kv(7)
    (first,) = run(ctx)[7]
    assert tokens([first]) == tokens(reference)
    assert first.num_cached_tokens == 48  # the pool saved them, as a local prefix hit would
    assert ctx.parked_block_ids(7) is not None and len(ctx.parked_block_ids(7)) == 4  # for its gen leg
    assert ctx.scheduler.num_prefix_hits == 0


def test_a_local_hit_shortens_the_pull_and_a_longer_one_skips_it():
    prefix = list(range(3, 51))
    prompt = prefix + list(range(60, 75))
    reference = tokens(run(make_core(), make_request(0, prompt, max_tokens=1))[0])
    holder, _ = prefill_on_ctx(prefix)
    ctx = make_core()
    run(ctx, make_request(9, prefix[:32] + [1, 2], max_tokens=1))  # caches the first 2 blocks here
    ctx.add_remote_request(make_request(7, prompt, max_tokens=1), (), park_kv_seconds=60.0,
                           num_remote_tokens=len(prefix))
    ctx.step()
    (pull,) = ctx.take_kv_pulls()
    assert (pull.first_block, len(pull.block_ids)) == (2, 1)
    ctx.import_blocks(pull.block_ids, holder.export_blocks(holder.parked_block_ids(0)[2:]))
    ctx.finish_remote_kv(7)
    assert tokens(run(ctx)[7]) == reference

    warm = make_core()
    run(warm, make_request(9, prompt, max_tokens=1))  # holds every block of the prefix already
    warm.add_remote_request(make_request(7, prompt, max_tokens=1), (), num_remote_tokens=len(prefix))
    warm.step()
    (pull,) = warm.take_kv_pulls()
    assert pull.block_ids == []  # nothing to pull: the agent completes it at once
    warm.finish_remote_kv(7)
    assert tokens(run(warm)[7]) == reference


def test_a_failed_prefix_pull_is_prefilled_here():
    prefix = list(range(3, 51))
    prompt = prefix + list(range(60, 75))
    reference = tokens(run(make_core(), make_request(0, prompt, max_tokens=3))[0])
    ctx = make_core()
    ctx.add_remote_request(make_request(7, prompt, max_tokens=3), (), num_remote_tokens=len(prefix))
    ctx.step()
    ctx.take_kv_pulls()
    assert ctx.recompute_remote(7)
    outputs = run(ctx)[7]
    assert tokens(outputs) == reference and outputs[0].num_cached_tokens == 0
