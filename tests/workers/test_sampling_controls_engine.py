"""Penalties and logit bias through EngineCore with the tiny model: greedy output moves
the way the API says."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from engine_runs import run, tokens
from test_engine_equivalence import make_core, make_request

PROMPT = [(11 * k) % 500 + 5 for k in range(12)]


def _greedy(model_dir, **params) -> list[int]:
    return tokens(run(make_core(model_dir), make_request(0, PROMPT, max_tokens=48, **params))[0])


def _repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


def test_frequency_and_presence_penalties_reduce_repeats(tiny_model_dir):
    plain = _repeats(_greedy(tiny_model_dir))
    assert plain > 0
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert _repeats(_greedy(tiny_model_dir, **penalty)) < plain, penalty
    # Rewarding repeats (negative penalties, repetition_penalty < 1) makes the model loop.
    for reward in ({"frequency_penalty": -2.0}, {"presence_penalty": -2.0}, {"repetition_penalty": 0.5}):
        assert _repeats(_greedy(tiny_model_dir, **reward)) > plain + 20, reward


def test_logit_bias_steers_greedy_output(tiny_model_dir):
    plain = _greedy(tiny_model_dir)
    assert set(_greedy(tiny_model_dir, logit_bias=((77, 100.0),))) == {77}
    banned = plain[0]
    assert banned not in _greedy(tiny_model_dir, logit_bias=((banned, -100.0),))
