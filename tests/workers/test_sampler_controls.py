"""Penalties, logit bias and min-p in the sampler on hand-made logits: each moves the
choice the way the API says, and rows without them keep their exact tokens."""

from __future__ import annotations

import torch

from workers.engine.sampler import Sampler, SamplingRow
from workers.sampling_params import SamplingParams

VOCAB = 32
EOS = 3
CPU = torch.device("cpu")


def _sampler() -> Sampler:
    return Sampler(frozenset({EOS}), CPU, seed=1234)


def _row(output: list[int] = (), prompt: list[int] = (), **params: object) -> SamplingRow:
    params.setdefault("temperature", 0.0)
    return SamplingRow(SamplingParams(**params), len(output), list(output), list(prompt))


def _pick(logits: torch.Tensor, *rows: SamplingRow) -> list[int]:
    return [t.token_id for t in _sampler().sample(logits, list(rows))]


def _peaked(*values: tuple[int, float]) -> torch.Tensor:
    logits = torch.zeros((1, VOCAB))
    for token_id, value in values:
        logits[0, token_id] = value
    return logits


def test_a_large_positive_bias_makes_greedy_pick_the_token() -> None:
    logits = _peaked((5, 10.0))
    assert _pick(logits, _row()) == [5]
    assert _pick(logits, _row(logit_bias=((17, 100.0),))) == [17]
    assert _pick(logits, _row(logit_bias=((5, -100.0),))) != [5]


def test_frequency_penalty_counts_each_occurrence() -> None:
    logits = _peaked((5, 3.0), (6, 2.0))
    assert _pick(logits, _row(output=[5], frequency_penalty=0.5)) == [5]  # 3 - 0.5 > 2
    assert _pick(logits, _row(output=[5, 5, 5], frequency_penalty=0.5)) == [6]  # 3 - 1.5 < 2


def test_presence_penalty_counts_once() -> None:
    logits = _peaked((5, 3.0), (6, 2.0))
    assert _pick(logits, _row(output=[5, 5, 5, 5], presence_penalty=0.9)) == [5]  # 3 - 0.9 > 2
    assert _pick(logits, _row(output=[5], presence_penalty=1.5)) == [6]
    assert _pick(logits, _row(output=[5], presence_penalty=-1.0, frequency_penalty=0.0)) == [5]


def test_repetition_penalty_covers_prompt_and_output() -> None:
    logits = _peaked((5, 3.0), (6, 2.0))
    assert _pick(logits, _row(prompt=[5], repetition_penalty=1.6)) == [6]  # 3 / 1.6 < 2
    assert _pick(logits, _row(output=[5], repetition_penalty=1.6)) == [6]
    assert _pick(logits, _row(prompt=[5], repetition_penalty=1.4)) == [5]  # 3 / 1.4 > 2
    negative = torch.full((1, VOCAB), -5.0)
    negative[0, 5], negative[0, 6] = -1.0, -1.5
    assert _pick(negative, _row(prompt=[5], repetition_penalty=2.0)) == [6]  # -1 * 2 < -1.5


def test_rows_without_controls_keep_their_tokens_in_a_mixed_batch() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn((6, VOCAB), generator=generator) * 2.0
    plain = [_row(), _row(temperature=1.0, seed=9), _row(temperature=0.7, seed=2, top_k=5)]
    alone = [_pick(logits[i:i + 1], row)[0] for i, row in zip((0, 2, 4), plain)]
    controlled = [_row(output=[1, 2], frequency_penalty=2.0), _row(logit_bias=((0, 50.0),)),
                  _row(temperature=1.0, seed=4, min_p=0.5, presence_penalty=1.0, output=[7])]
    together = _pick(logits, plain[0], controlled[0], plain[1], controlled[1], plain[2], controlled[2])
    assert [together[0], together[2], together[4]] == alone
    assert together[3] == 0


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (VOCAB - 3)]))
    drawn = {_sampler().sample(logits, [_row(temperature=1.0, seed=s, min_p=0.5)])[0].token_id for s in range(200)}
    assert drawn == {0, 1}  # 0.2 < 0.5 * 0.5
    drawn = {_sampler().sample(logits, [_row(temperature=1.0, seed=s)])[0].token_id for s in range(200)}
    assert {0, 1, 2} <= drawn


def test_logprobs_stay_those_of_the_raw_distribution() -> None:
    logits = _peaked((5, 3.0))
    (token,) = _sampler().sample(logits, [_row(logit_bias=((9, 100.0),), logprobs=1)])
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert token.token_id == 9 and abs(token.logprobs.logprob - raw[9].item()) < 1e-6
    assert token.logprobs.top_token_ids == [5]
