"""A resumed request (``AddResumedRequest``: a stream migrated mid-answer) continues exactly as
the uninterrupted run: its carried output tokens are prefilled with the prompt, count toward
max_tokens and the sampling positions, and advance its grammar; they are never reported again."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from engine_runs import tokens
from json_schemas import SCHEMAS, schema_text
from test_engine_equivalence import make_core

from workers.protocol import EngineRequest
from workers.sampling_params import GuidedDecoding, SamplingParams

PROMPT = [(11 * k) % 400 + 5 for k in range(23)]
CASES = {
    "greedy": dict(temperature=0.0, max_tokens=40, ignore_eos=True),
    "seeded": dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=40, ignore_eos=True),
    "penalized": dict(temperature=1.0, seed=5, presence_penalty=0.8, repetition_penalty=1.2, max_tokens=40,
                      ignore_eos=True),
    "json_schema": dict(temperature=0.0, max_tokens=200, guided=GuidedDecoding("json_schema", schema_text(SCHEMAS[0]))),
}


def run_one(core, request: EngineRequest, output_token_ids: list[int] = ()) -> list:
    core.add_request(request, output_token_ids=output_token_ids)
    outputs = []
    while core.has_unfinished():
        outputs.extend(core.step())
        core.check_integrity()
    return outputs


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_request_ends_as_the_uninterrupted_run(tiny_model_dir, case):
    params = SamplingParams(**CASES[case])
    whole = run_one(make_core(tiny_model_dir), EngineRequest(1, PROMPT, params))
    expected = tokens(whole)
    assert len(expected) > 6
    for cut in (1, len(expected) // 2, len(expected) - 1):
        resumed = run_one(make_core(tiny_model_dir), EngineRequest(2, PROMPT, params), expected[:cut])
        assert tokens(resumed) == expected[cut:], (case, cut)
        assert resumed[-1].finish_reason == whole[-1].finish_reason
        assert resumed[0].num_prompt_tokens == len(PROMPT)


def test_carried_tokens_the_grammar_refuses_reject_the_request(tiny_model_dir):
    params = SamplingParams(**CASES["json_schema"])
    outputs = run_one(make_core(tiny_model_dir), EngineRequest(3, PROMPT, params), [PROMPT[0], PROMPT[1]])
    assert outputs[-1].finish_reason == "abort" and "rejects the output token" in outputs[-1].error
