"""request_rules.stop_filter: the per-token shortcut never skips a stop that stop_status would make."""

from __future__ import annotations

import random

from workers.engine.request import Request, RequestStatus
from workers.engine.request_rules import stop_filter, stop_status
from workers.sampling_params import SamplingParams


def test_a_token_the_filter_passes_never_stops_the_request():
    rng = random.Random(7)
    skipped = stopped = 0
    for _ in range(3000):
        max_tokens = rng.randrange(1, 12)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.randrange(0, max_tokens + 1),
                                stop_token_ids=rng.sample(range(20), rng.randrange(0, 3)),
                                ignore_eos=rng.random() < 0.5)
        eos, max_model_len = frozenset(rng.sample(range(20), rng.randrange(0, 3))), rng.randrange(8, 24)
        request = Request(0, list(range(rng.randrange(1, 8))), params)
        stop_filter(request, eos, max_model_len)
        for _ in range(rng.randrange(1, 16)):
            token_id = rng.randrange(20)
            request.output_token_ids.append(token_id)
            status = stop_status(request, token_id, eos, max_model_len)
            if token_id not in request.stop_ids and len(request.output_token_ids) < request.length_limit:
                assert status is None, (params, eos, max_model_len, request.output_token_ids)
                skipped += 1
            else:
                stopped += status is not None
            if status is not None:
                break
    assert skipped > 1000 and stopped > 1000  # both sides exercised


def test_the_filter_sends_every_stopping_kind_to_stop_status():
    params = SamplingParams(max_tokens=5, stop_token_ids=[9])
    request = Request(0, [1, 2, 3], params)
    stop_filter(request, frozenset({2}), max_model_len=6)
    assert request.stop_ids == {9, 2} and request.length_limit == 3  # the model's length caps first
    stop_filter(request, frozenset({2}), max_model_len=100)
    assert request.length_limit == 5
    ignoring = Request(0, [1], SamplingParams(max_tokens=5, stop_token_ids=[9], ignore_eos=True))
    stop_filter(ignoring, frozenset({2}), max_model_len=100)
    assert ignoring.stop_ids == {9}
    ignoring.output_token_ids.append(2)
    assert stop_status(ignoring, 2, frozenset({2}), 100) is None
    request.output_token_ids.extend([4, 4, 4, 4, 4])
    assert stop_status(request, 4, frozenset({2}), 100) is RequestStatus.FINISHED_LENGTH_CAPPED
