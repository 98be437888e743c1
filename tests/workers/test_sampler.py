"""The sampler on hand-made logits: greedy, seeds, top-k/top-p, min_tokens, logprobs."""

from __future__ import annotations

import math

import torch

from workers.engine.sampler import Sampler, SamplingRow
from workers.sampling_params import SamplingParams

VOCAB = 32
EOS = 3
CPU = torch.device("cpu")


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((rows, VOCAB), generator=generator) * 2.0


def _sampler() -> Sampler:
    return Sampler(frozenset({EOS}), CPU, seed=1234)


def _row(num_output_tokens: int = 0, **params: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), num_output_tokens)


def test_greedy_rows_take_the_argmax() -> None:
    logits = _logits(5)
    tokens = _sampler().sample(logits, [_row(temperature=0.0) for _ in range(5)])
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert all(t.logprobs is None for t in tokens)


def test_seeded_token_ignores_the_rest_of_the_batch() -> None:
    target = _logits(1, seed=7)
    row = _row(num_output_tokens=3, temperature=1.0, seed=42)
    alone = _sampler().sample(target, [row])[0].token_id
    for others in range(1, 5):
        batch = torch.cat([_logits(others, seed=others), target])
        rows = [_row(temperature=0.8) for _ in range(others)] + [row]
        # A different sampler instance: its own unseeded stream must not matter either.
        assert Sampler(frozenset({EOS}), CPU, seed=others).sample(batch, rows)[-1].token_id == alone


def test_seeded_tokens_depend_on_seed_and_position() -> None:
    logits = torch.zeros((1, VOCAB))  # uniform: every token equally likely
    sampler = _sampler()
    by_position = [sampler.sample(logits, [_row(n, seed=5)])[0].token_id for n in range(40)]
    again = [sampler.sample(logits, [_row(n, seed=5)])[0].token_id for n in range(40)]
    other_seed = [sampler.sample(logits, [_row(n, seed=6)])[0].token_id for n in range(40)]
    assert by_position == again
    assert other_seed != by_position
    assert len(set(by_position)) > 10  # positions draw different tokens


def test_random_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [0.0] * (VOCAB - 3)]))
    sampler = _sampler()
    counts = [0, 0, 0]
    for n in range(600):
        counts[sampler.sample(logits, [_row(n, seed=9)])[0].token_id] += 1
    assert sum(counts) == 600
    assert 360 < counts[0] < 480 and 80 < counts[1] < 160 and 25 < counts[2] < 95


def test_top_k_restricts_support() -> None:
    logits = _logits(1, seed=3)
    allowed = set(logits[0].topk(3).indices.tolist())
    sampler = _sampler()
    drawn = {sampler.sample(logits, [_row(n, seed=1, temperature=5.0, top_k=3)])[0].token_id for n in range(200)}
    assert drawn == allowed
    top1 = {sampler.sample(logits, [_row(n, seed=1, top_k=1)])[0].token_id for n in range(20)}
    assert top1 == {int(logits[0].argmax())}


def test_top_p_restricts_support_to_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    logits = torch.log(probs).unsqueeze(0)
    sampler = _sampler()
    drawn = {sampler.sample(logits, [_row(n, seed=2, top_p=0.8)])[0].token_id for n in range(300)}
    assert drawn == {0, 1}  # mass before token 2 is 0.8: outside
    wider = {sampler.sample(logits, [_row(n, seed=2, top_p=0.81)])[0].token_id for n in range(300)}
    assert wider == {0, 1, 2}


def test_rows_with_and_without_filters_share_a_batch() -> None:
    logits = _logits(3, seed=11)
    rows = [_row(0, seed=1, top_k=1), _row(0, temperature=0.0), _row(0, seed=1, top_p=1e-6)]
    tokens = [t.token_id for t in _sampler().sample(logits, rows)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros((1, VOCAB))
    logits[0, EOS] = 50.0
    logits[0, 7] = 40.0
    logits[0, 9] = 30.0
    sampler = _sampler()
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert sampler.sample(logits, [_row(0, **params)])[0].token_id == 9
    assert sampler.sample(logits, [_row(1, **params)])[0].token_id == 9
    assert sampler.sample(logits, [_row(2, **params)])[0].token_id == EOS
    # ignore_eos: EOS does not end the request, so min_tokens need not hide it.
    ignore = dict(temperature=0.0, min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    assert sampler.sample(logits, [_row(0, **ignore)])[0].token_id == EOS


def test_logprobs_are_the_raw_distribution() -> None:
    logits = _logits(2, seed=5)
    rows = [_row(0, temperature=0.0, logprobs=4), _row(0, temperature=0.5, seed=3, logprobs=0)]
    tokens = _sampler().sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    first = tokens[0].logprobs
    assert first is not None and first.token_id == tokens[0].token_id
    assert first.top_token_ids == expected[0].topk(4).indices.tolist()
    top_expected = expected[0].topk(4).values.tolist()
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(first.top_logprobs, top_expected))
    assert math.isclose(first.logprob, expected[0, first.token_id].item(), abs_tol=1e-6)
    assert first.top_logprobs == sorted(first.top_logprobs, reverse=True)
    second = tokens[1].logprobs
    assert second is not None and second.top_token_ids == [] and second.top_logprobs == []
    assert math.isclose(second.logprob, expected[1, tokens[1].token_id].item(), abs_tol=1e-6)
