"""Scheduler: token budget, chunked prefill, preemption, abort, rejection, finish reasons."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine.block_manager import BlockManager
from workers.engine.executor import ExecutorOutput, SampledToken, SchedulerOutput
from workers.engine.request import Request, RequestStatus
from workers.engine.scheduler import Scheduler
from workers.engine.synthetic import SyntheticExecutor
from workers.protocol import RejectReason, RequestOutput
from workers.sampling_params import SamplingParams

BLOCK_SIZE = 4
Execute = Callable[[SchedulerOutput], ExecutorOutput]


def make_scheduler(
    num_blocks: int = 100,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_chunked_prefill: bool = True,
    max_model_len: int = 1000,
    eos_token_ids: frozenset[int] = frozenset(),
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
    return Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE), max_model_len, eos_token_ids)


def make_request(request_id: int, prompt: int | list[int], **params) -> Request:
    tokens = list(range(100 * request_id, 100 * request_id + prompt)) if isinstance(prompt, int) else prompt
    params.setdefault("temperature", 0.0)
    return Request(request_id, tokens, SamplingParams(**params))


def scripted(scripts: dict[int, list[int]] | None = None, default: int = 7) -> Execute:
    """An executor that samples scripts[request_id][output position], else ``default``."""

    def execute(batch: SchedulerOutput) -> ExecutorOutput:
        sampled = []
        for r in batch.requests:
            script = (scripts or {}).get(r.request_id, [])
            if r.sample:
                token = script[r.num_output_tokens] if r.num_output_tokens < len(script) else default
                sampled.append(SampledToken(token))
        return ExecutorOutput.of(batch, sampled)

    return execute


def synthetic(num_blocks: int) -> Execute:
    """The synthetic executor: tokens depend on the KV it finds in the blocks."""
    config = EngineConfig(kind="synthetic", cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks))
    return SyntheticExecutor(config).execute


def step(scheduler: Scheduler, execute: Execute) -> tuple[SchedulerOutput, list[RequestOutput]]:
    batch = scheduler.schedule()
    outputs = scheduler.take_finished_outputs() + scheduler.update(batch, execute(batch))
    scheduler.block_manager.check_integrity()
    return batch, outputs


def chunks(batch: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    """(request id, start position, tokens, sample) of each scheduled request."""
    return [(r.request_id, r.start_position, len(r.token_ids), r.sample) for r in batch.requests]


def run_to_completion(scheduler: Scheduler, execute: Execute) -> dict[int, list[RequestOutput]]:
    outputs: dict[int, list[RequestOutput]] = {}
    for _ in range(1000):
        if not scheduler.has_unfinished():
            return outputs
        for output in step(scheduler, execute)[1]:
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError("requests did not finish in 1000 steps")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


# ---- budget and batching -----------------------------------------------------


def test_token_budget_splits_the_last_prompt_and_decodes_go_first():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for i in range(3):
        scheduler.add_request(make_request(i, 4))
    batch, outputs = step(scheduler, scripted())
    assert chunks(batch) == [(0, 0, 4, True), (1, 0, 4, True), (2, 0, 2, False)]
    assert (batch.num_prefill_tokens, batch.num_decode_tokens) == (10, 0)
    assert [o.request_id for o in outputs] == [0, 1]
    batch, _ = step(scheduler, scripted())
    assert chunks(batch) == [(0, 4, 1, True), (1, 4, 1, True), (2, 2, 2, True)]
    assert (batch.num_prefill_tokens, batch.num_decode_tokens) == (2, 2)
    assert batch.requests[0].token_ids == [7]  # the sampled token is fed back


def test_prompts_are_prefilled_first_come_first_served_one_a_step():
    """A ctx worker whose budget holds about one prompt (configs/local.yaml): prompts that arrive
    together finish one per step in arrival order, the oldest's rest before the next one's
    start, and a later arrival queues behind them (no convoy finishing every prompt in the
    last step, and no overtaking)."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    for i in range(4):
        scheduler.add_request(make_request(i, 7, max_tokens=1))  # context-only legs: one token each
    expected = [
        ([(0, 0, 7, True), (1, 0, 1, False)], [0]),
        ([(1, 1, 6, True), (2, 0, 2, False)], [1]),
        ([(2, 2, 5, True), (3, 0, 3, False)], [2]),
        ([(3, 3, 4, True), (4, 0, 2, True)], [3, 4]),
    ]
    for index, (want_chunks, want_finished) in enumerate(expected):
        batch, outputs = step(scheduler, scripted())
        assert chunks(batch) == want_chunks
        assert [(o.request_id, o.finish_reason) for o in outputs] == [(i, "length") for i in want_finished]
        if index == 0:
            scheduler.add_request(make_request(4, 2, max_tokens=1))  # arrives after the first step
    assert not scheduler.has_unfinished()


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(i, 4, max_tokens=2))
    batch, _ = step(scheduler, scripted())
    assert [r.request_id for r in batch.requests] == [0, 1]
    assert scheduler.num_waiting == 1
    batch, outputs = step(scheduler, scripted())
    assert [r.request_id for r in batch.requests] == [0, 1]  # full: 2 still waits
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    batch, _ = step(scheduler, scripted())
    assert chunks(batch) == [(2, 0, 4, True)]


def test_chunked_prefill_chunk_sizes():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request(0, 25))
    sizes = [chunks(step(scheduler, scripted())[0])[0] for _ in range(4)]
    assert sizes == [(0, 0, 8, False), (0, 8, 8, False), (0, 16, 8, False), (0, 24, 1, True)]


def test_without_chunked_prefill_a_prompt_waits_for_room():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request(0, 6))
    scheduler.add_request(make_request(1, 6))
    assert chunks(step(scheduler, scripted())[0]) == [(0, 0, 6, True)]
    assert chunks(step(scheduler, scripted())[0]) == [(0, 6, 1, True), (1, 0, 6, True)]


def test_without_chunked_prefill_a_prompt_over_the_budget_is_still_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request(0, 20))
    sizes = [chunks(step(scheduler, scripted())[0])[0] for _ in range(3)]
    assert sizes == [(0, 0, 8, False), (0, 8, 8, False), (0, 16, 4, True)]


# ---- preemption --------------------------------------------------------------


def test_preemption_frees_the_newest_and_recompute_gives_identical_tokens():
    scheduler = make_scheduler(num_blocks=4)
    execute = synthetic(num_blocks=4)
    first, second = make_request(0, 6, max_tokens=6), make_request(1, 6, max_tokens=6)
    scheduler.add_request(first)
    scheduler.add_request(second)
    outputs: dict[int, list[RequestOutput]] = {}
    for _ in range(3):  # both hold 2 blocks and reach 9 tokens
        for o in step(scheduler, execute)[1]:
            outputs.setdefault(o.request_id, []).append(o)
    assert second.status == RequestStatus.RUNNING and len(second.block_ids) == 2
    batch, step_outputs = step(scheduler, execute)  # the first needs a third block
    assert chunks(batch) == [(0, 8, 1, True)]
    assert second.status == RequestStatus.PREEMPTED
    assert (second.num_computed_tokens, second.block_ids, second.num_preemptions) == (0, [], 1)
    assert list(scheduler.waiting) == [second] and scheduler.running == [first]
    assert scheduler.num_preemptions_last_step == 1
    for o in step_outputs:
        outputs.setdefault(o.request_id, []).append(o)
    for request_id, rest in run_to_completion(scheduler, execute).items():
        outputs.setdefault(request_id, []).extend(rest)
    for request_id in (0, 1):
        alone = make_scheduler()
        alone.add_request(make_request(request_id, 6, max_tokens=6))
        expected = tokens_of(run_to_completion(alone, synthetic(num_blocks=100))[request_id])
        assert tokens_of(outputs[request_id]) == expected
        assert len(expected) == 6
    assert scheduler.block_manager.num_used_blocks == 0


def test_the_request_being_scheduled_can_be_the_one_preempted():
    scheduler = make_scheduler(num_blocks=4)
    first, second = make_request(0, 7), make_request(1, 8)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step(scheduler, scripted())  # 8 and 9 tokens: the second needs a third block next
    batch, outputs = step(scheduler, scripted())
    assert chunks(batch) == [(0, 7, 1, True)]
    assert second.status == RequestStatus.PREEMPTED
    assert [o.request_id for o in outputs] == [0]


def test_max_model_len_is_capped_by_the_pool():
    assert make_scheduler(num_blocks=4, max_model_len=1000).max_model_len == 16
    assert make_scheduler(num_blocks=100, max_model_len=32).max_model_len == 32


# ---- abort and rejection -----------------------------------------------------


@pytest.mark.parametrize("state", ["waiting", "running", "preempted"])
def test_abort_in_any_state_frees_blocks_at_once(state):
    scheduler = make_scheduler(num_blocks=4)
    first, second = make_request(0, 7), make_request(1, 8)
    scheduler.add_request(first)
    scheduler.add_request(second)
    if state != "waiting":
        step(scheduler, scripted())
    if state == "preempted":
        step(scheduler, scripted())
    assert second.status.name.lower() == state
    scheduler.abort(1)
    scheduler.block_manager.check_integrity()
    assert second.status == RequestStatus.FINISHED_ABORTED
    assert second.block_ids == []
    assert scheduler.block_manager.num_used_blocks == len(first.block_ids)
    assert 1 not in scheduler.requests and second not in scheduler.waiting and second not in scheduler.running
    batch, outputs = step(scheduler, scripted())
    assert [(o.request_id, o.finish_reason) for o in outputs if o.request_id == 1] == [(1, "abort")]
    assert all(r.request_id == 0 for r in batch.requests)
    scheduler.abort(1)  # already gone: a no-op
    scheduler.abort(12345)
    assert scheduler.take_finished_outputs() == []


def test_too_long_prompt_is_rejected_with_an_error():
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request(0, 17))
    scheduler.add_request(make_request(1, 16, max_tokens=10))
    assert scheduler.take_finished_outputs() == [
        RequestOutput(
            request_id=0,
            new_token_ids=[],
            finish_reason="abort",
            num_prompt_tokens=17,
            error="prompt has 17 tokens, more than the model's limit of 16 tokens (max_model_len)",
            reject_reason=RejectReason.PROMPT_TOO_LONG,
        )
    ]
    outputs = run_to_completion(scheduler, scripted())
    assert [(tokens_of(o), o[-1].finish_reason) for o in outputs.values()] == [([7], "length")]


def test_invalid_sampling_params_and_empty_prompts_are_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request(0, 4, max_tokens=0))
    scheduler.add_request(make_request(1, []))
    errors = [(o.reject_reason, o.error) for o in scheduler.take_finished_outputs()]
    assert errors == [(RejectReason.INVALID_SAMPLING_PARAMS, "invalid sampling parameters: max_tokens must be >= 1, got 0"),
                      (RejectReason.EMPTY_PROMPT, "prompt is empty")]
    assert not scheduler.has_unfinished()


def test_duplicate_request_id_raises():
    scheduler = make_scheduler()
    scheduler.add_request(make_request(0, 4))
    with pytest.raises(ValueError, match="already in the engine"):
        scheduler.add_request(make_request(0, 4))


# ---- finish reasons ----------------------------------------------------------


def finish(scheduler: Scheduler, request: Request, script: list[int]) -> tuple[list[int], str | None]:
    scheduler.add_request(request)
    outputs = run_to_completion(scheduler, scripted({request.request_id: script}))[request.request_id]
    assert scheduler.block_manager.num_used_blocks == 0
    return tokens_of(outputs), outputs[-1].finish_reason


def test_finish_reasons():
    eos = frozenset({2})
    s = make_scheduler(eos_token_ids=eos)
    assert finish(s, make_request(0, 4, stop_token_ids=(5,)), [1, 5, 1]) == ([1, 5], "stop")
    assert finish(s, make_request(1, 4), [1, 2, 1]) == ([1, 2], "stop")
    assert finish(s, make_request(2, 4, ignore_eos=True, max_tokens=3), [2, 2, 2, 2]) == ([2, 2, 2], "length")
    assert finish(s, make_request(3, 4, max_tokens=3), [1, 1, 1, 1]) == ([1, 1, 1], "length")
    # A stop token that is also the last allowed token reports stop.
    assert finish(s, make_request(4, 4, max_tokens=2), [1, 2]) == ([1, 2], "stop")
    # min_tokens: EOS only stops once more than min_tokens tokens exist.
    assert finish(s, make_request(5, 4, min_tokens=2), [2, 2, 2, 1]) == ([2, 2, 2], "stop")
    # max_tokens beyond the model length: stops at max_model_len with "length".
    short = make_scheduler(max_model_len=16)
    assert finish(short, make_request(6, 14, max_tokens=100), []) == ([7, 7], "length")


def test_first_output_reports_prompt_and_cached_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request(0, list(range(10)), max_tokens=2))
    first = run_to_completion(scheduler, scripted())[0]
    assert [(o.num_prompt_tokens, o.num_cached_tokens) for o in first] == [(10, 0), (0, 0)]
    scheduler.add_request(make_request(1, list(range(10)), max_tokens=2))
    second = run_to_completion(scheduler, scripted())[1]
    assert [(o.num_prompt_tokens, o.num_cached_tokens) for o in second] == [(10, 8), (0, 0)]
    assert (scheduler.num_prefix_queries, scheduler.num_prefix_hits) == (20, 8)


def test_request_timestamps_are_stamped():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request(0, 6, max_tokens=1)
    scheduler.add_request(request)
    step(scheduler, scripted())
    assert request.first_scheduled_time is not None and request.first_token_time is None
    step(scheduler, scripted())
    assert request.first_token_time is not None
    assert request.first_token_time >= request.first_scheduled_time


# ---- a remote request whose KV pull failed -------------------------------------


@pytest.mark.parametrize("allocated", [False, True])
def test_a_remote_request_whose_pull_failed_is_prefilled_here_like_a_new_one(allocated):
    """``recompute_remote`` before or after its blocks were allocated for the pull: the blocks are
    freed, it prefills prompt and first token, and it samples what an unbroken run samples next."""
    execute = synthetic(num_blocks=64)
    reference = make_scheduler(num_blocks=64)
    reference.add_request(make_request(0, 10, max_tokens=4))
    expected = tokens_of(run_to_completion(reference, execute)[0])
    scheduler = make_scheduler(num_blocks=64)
    request = make_request(0, 10, max_tokens=4)
    request.output_token_ids.append(expected[0])  # the ctx engine's first token
    scheduler.add_remote_request(request)
    if allocated:
        step(scheduler, execute)  # allocates its blocks and publishes the pull
        assert [p.request_id for p in scheduler.take_kv_pulls()] == [0] and request.block_ids
    assert scheduler.recompute_remote(0)
    assert (request.status, request.block_ids, scheduler.num_waiting_for_remote_kv) == (RequestStatus.WAITING, [], 0)
    assert scheduler.block_manager.num_used_blocks == 0
    assert not scheduler.recompute_remote(0) and not scheduler.recompute_remote(12345)  # not waiting for KV
    outputs = run_to_completion(scheduler, execute)[0]
    assert tokens_of(outputs) == expected[1:] and outputs[-1].finish_reason == "length"
    assert scheduler.block_manager.num_used_blocks == 0
