"""Prompt logprobs through EngineCore on the tiny model, against transformers' full-sequence logits."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it; nothing may be downloaded

from engine_runs import run, tokens  # noqa: E402
from test_engine_equivalence import make_core, make_request  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SyntheticConfig  # noqa: E402
from workers.engine.core import EngineCore  # noqa: E402
from workers.protocol import RequestOutput, TokenLogprobs  # noqa: E402

PROMPT = [0, 47, 268, 290, 228, 42, 72, 77, 418, 228, 441, 263, 170, 252, 237, 422, 254, 230, 9, 33, 61]
TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position: row p scores token p + 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], dim=-1)


def _prompt_logprobs(outputs: list[RequestOutput]) -> list[TokenLogprobs]:
    carrying = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outputs[0]  # once, with the first token
    return carrying[0].prompt_logprobs  # type: ignore[return-value]


def _check(entries: list[TokenLogprobs], reference: torch.Tensor) -> None:
    assert [e.token_id for e in entries] == PROMPT[1:]
    for position, entry in enumerate(entries):
        row = reference[position]
        assert entry.logprob == pytest.approx(row[PROMPT[position + 1]].item(), abs=1e-4)
        assert entry.rank == int((row > row[PROMPT[position + 1]]).sum().item()) + 1
        values, ids = row.topk(TOP)
        assert entry.top_token_ids == ids.tolist()
        assert entry.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_equal_transformers(tiny_model_dir, reference):
    core = make_core(tiny_model_dir)
    outputs = run(core, make_request(1, PROMPT, prompt_logprobs=TOP), make_request(2, PROMPT[:5]))
    _check(_prompt_logprobs(outputs[1]), reference)
    assert all(o.prompt_logprobs is None for o in outputs[2])  # a request that did not ask gets none


@pytest.mark.parametrize("budget", [4, 7])
def test_chunked_prefill_gives_the_same_numbers(tiny_model_dir, reference, budget):
    core = make_core(tiny_model_dir, max_num_batched_tokens=budget)
    outputs = run(core, make_request(1, PROMPT, prompt_logprobs=TOP))
    _check(_prompt_logprobs(outputs[1]), reference)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny_model_dir, reference):
    core = make_core(tiny_model_dir)
    plain = run(core, make_request(1, PROMPT))[1]
    again = run(core, make_request(2, PROMPT, prompt_logprobs=TOP))[2]
    assert again[0].num_cached_tokens == 0  # the blocks the first request cached are not used
    _check(_prompt_logprobs(again), reference)
    assert tokens(again) == tokens(plain)
    hit = run(core, make_request(3, PROMPT))[3]  # a plain request still hits the cache
    assert hit[0].num_cached_tokens > 0


def test_zero_alternatives_and_one_token_prompts(tiny_model_dir, reference):
    outputs = run(make_core(tiny_model_dir), make_request(1, PROMPT, prompt_logprobs=0),
                  make_request(2, PROMPT[:1], prompt_logprobs=2))
    entries = _prompt_logprobs(outputs[1])
    assert all(e.top_token_ids == [] and e.top_logprobs == [] for e in entries)
    assert entries[3].logprob == pytest.approx(reference[3][PROMPT[4]].item(), abs=1e-4)
    assert _prompt_logprobs(outputs[2]) == []  # the first token has none


def test_the_synthetic_engine_carries_their_shape():
    core = EngineCore(EngineConfig(kind="synthetic", synthetic=SyntheticConfig(vocab_size=500)))
    outputs = run(core, make_request(1, PROMPT, prompt_logprobs=2))
    entries = _prompt_logprobs(outputs[1])
    assert [e.token_id for e in entries] == PROMPT[1:] and all(len(e.top_token_ids) == 2 for e in entries)


def test_a_request_preempted_mid_prefill_collects_each_position_once():
    def core(num_blocks: int) -> EngineCore:
        return EngineCore(EngineConfig(kind="synthetic", synthetic=SyntheticConfig(vocab_size=500),
                                       cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                       scheduler=SchedulerConfig(max_num_batched_tokens=8)))

    asking = make_request(2, [(7 * k) % 500 for k in range(40)], max_tokens=4, prompt_logprobs=1)
    alone = _prompt_logprobs(run(core(64), asking)[2])
    # A decoding request that keeps growing preempts the newer one while it is still prefilling
    # (in chunks of 8): it recomputes positions it has already scored.
    tight = core(12)
    tight.add_request(make_request(1, list(range(8)), max_tokens=40))
    tight.add_request(asking)
    outputs: list[RequestOutput] = []
    preempted_before_output = 0
    while tight.has_unfinished():
        preemptions = tight.scheduler.num_preemptions
        outputs += [o for o in tight.step() if o.request_id == 2]
        if tight.scheduler.num_preemptions > preemptions and not outputs:
            preempted_before_output += 1
    assert preempted_before_output > 0
    assert _prompt_logprobs(outputs) == alone
