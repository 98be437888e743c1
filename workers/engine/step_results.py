"""A step's results applied to its requests: ``Scheduler.update`` (``workers.engine.scheduler``).

Split from the scheduler by concern: choosing the next step is there, advancing the requests by
what a step computed and sampled (tokens appended, stops, streamed outputs, blocks cached, freed
or parked) is here. ``StepResults`` is the scheduler's base; it reads the scheduler's tables.
"""

from __future__ import annotations

import time
from itertools import repeat

from workers.config import SchedulerConfig
from workers.engine.block_manager import BlockManager
from workers.engine.executor import ExecutorOutput, SchedulerOutput
from workers.engine.request import Request, RequestStatus
from workers.engine.request_rules import request_output, stop_status
from workers.protocol import RejectReason, RequestOutput, TokenLogprobs

__all__ = ["StepResults"]


class StepResults:
    """``update``: the scheduler's half that applies a step's results (the attributes are its)."""

    config: SchedulerConfig
    block_manager: BlockManager
    max_model_len: int
    eos_token_ids: frozenset[int]
    requests: dict[int, Request]
    running: list[Request]
    num_finished_last_step: int
    num_accepted_last_step: int
    num_accepted_tokens: int
    _park_seconds: dict[int, float]

    def update(self, batch: SchedulerOutput, result: ExecutorOutput) -> list[RequestOutput]:
        """Advance the scheduled requests by what the step computed and sampled.

        Per request this is the engine's innermost loop: attribute reads are hoisted, the
        common streamed token (one, not the first, not the last, no logprobs) becomes its
        ``RequestOutput`` directly, and one clock reading stamps every first token of the step.
        """
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        self.num_accepted_last_step = 0
        requests = self.requests
        default_interval = self.config.stream_interval
        block_size = self.block_manager.block_size
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        now: float | None = None
        owners = batch.owners
        if len(owners) != len(batch.requests):  # a batch that ``schedule`` did not build (tests)
            owners = [requests.get(scheduled.request_id) for scheduled in batch.requests]
        if len(result.token_ids) != len(batch.requests):
            raise ValueError(f"the executor sampled {len(result.token_ids)} entries of a batch of {len(batch.requests)}")
        if result.prompt_logprobs is not None:
            _collect_prompt_logprobs(batch, owners, result.prompt_logprobs)
        more_token_ids = result.more_token_ids
        entries = zip(batch.requests, owners, result.token_ids, result.logprobs or repeat(None),
                      more_token_ids or repeat(None))
        for scheduled, request, token_id, logprobs, more in entries:
            if request is None or request.status is not _RUNNING:
                continue  # aborted while the step ran
            request_id = scheduled.request_id
            is_first = request.first_token_time is None  # nothing reported for it before
            if scheduled.draft_token_ids:  # a verify step: 1 to k + 1 tokens (``speculative``)
                sampled = [token_id, *more] if token_id is not None and more is not None else []
                status, num_sampled = self._apply_verified(request, sampled, eos_token_ids, max_model_len)
                self.num_accepted_last_step += num_sampled - 1
                if status is not None:
                    finished.append(request)
                num_unreported = request.num_unreported_tokens + num_sampled
                if is_first or status is not None or num_unreported >= (
                        request.sampling_params.stream_interval or default_interval):
                    request.num_unreported_tokens = num_unreported
                    outputs.append(_report(request, is_first))
                else:
                    request.num_unreported_tokens = num_unreported
                continue
            num_new = len(scheduled.token_ids)
            num_computed = request.num_computed_tokens = request.num_computed_tokens + num_new
            if num_computed % block_size < num_new:  # a block filled up this step
                self.block_manager.cache_full_blocks(request)
            if token_id is None:  # (the entry's ``sample`` is false)
                continue
            output_token_ids = request.output_token_ids
            output_token_ids.append(token_id)
            grammar = request.grammar
            if grammar is not None and not grammar.consume_token(token_id):
                request.error = f"the grammar rejected token {token_id}: {grammar.get_error()}"
                request.reject_reason = RejectReason.SAMPLED_OUTSIDE_GRAMMAR
            if is_first:
                if now is None:
                    now = time.time()
                request.first_token_time = now
            # Most tokens certainly stop nothing (request_rules.stop_filter): no stop_status call.
            if (token_id in request.stop_ids or len(output_token_ids) >= request.length_limit
                    or request.error is not None or grammar is not None):
                status = stop_status(request, token_id, eos_token_ids, max_model_len)
                if status is not None:
                    request.status = status
                    finished.append(request)
            else:
                status = None
            num_unreported = request.num_unreported_tokens + 1
            if logprobs is not None:
                request.unreported_logprobs.append(logprobs)
            # The first token goes out at once (time to first token), the last with the finish
            # reason, the rest every stream_interval tokens.
            if is_first or status is not None:
                request.num_unreported_tokens = num_unreported
                outputs.append(_report(request, is_first))
            elif num_unreported >= (request.sampling_params.stream_interval or default_interval):
                if num_unreported == 1 and logprobs is None:  # = _report(request, False), built directly
                    request.num_unreported_tokens = 0
                    outputs.append(RequestOutput(request_id, [token_id]))
                else:
                    request.num_unreported_tokens = num_unreported
                    outputs.append(_report(request, False))
            else:
                request.num_unreported_tokens = num_unreported
        self.num_finished_last_step = len(finished)
        self.num_accepted_tokens += self.num_accepted_last_step
        if finished:
            self._retire(finished)
        return outputs

    def _apply_verified(self, request: Request, sampled: list[int], eos_token_ids: frozenset[int],
                        max_model_len: int) -> tuple[RequestStatus | None, int]:
        """Append a verify step's tokens one by one, each checked as a plain step checks its one, up to
        the first that finishes the request (the rest are dropped: a stop token, EOS or ``max_tokens``
        cuts exactly where decoding token by token would). The KV computed this step is the last
        token's and the accepted drafts' (the tokens appended but the last); blocks held only for the
        rejected drafts' positions are released. The finished state and the tokens appended."""
        if request.first_token_time is None:
            request.first_token_time = time.time()
        output_token_ids = request.output_token_ids
        status = None
        num_sampled = 0
        for token_id in sampled:
            output_token_ids.append(token_id)
            num_sampled += 1
            if token_id in request.stop_ids or len(output_token_ids) >= request.length_limit:
                status = stop_status(request, token_id, eos_token_ids, max_model_len)
                if status is not None:
                    request.status = status
                    break
        request.num_computed_tokens += num_sampled
        block_manager = self.block_manager
        block_manager.cache_full_blocks(request)  # (after the append: the hashes read the tokens)
        needed = -(-request.num_tokens // block_manager.block_size)  # the next step writes the last token
        if len(request.block_ids) > needed:
            block_manager.keep_blocks(request, needed)
        return status, num_sampled

    def _retire(self, finished: list[Request]) -> None:
        """Free (or park) the blocks of requests that finished this step, and forget them."""
        for request in finished:
            request.grammar = None  # the matcher is freed now, not when the last reference goes
            park_seconds = self._park_seconds.pop(request.request_id, None)
            if park_seconds is None:
                self.block_manager.free(request)
            else:
                self.block_manager.park(request, deadline=time.time() + park_seconds)
            del self.requests[request.request_id]
        # Every request in ``running`` is RUNNING (preemption and abort take theirs out): the
        # ones that are not any more are exactly those finished this step.
        self.running = [r for r in self.running if r.status is _RUNNING]


_RUNNING = RequestStatus.RUNNING  # (hoisted: read per request per step)


def _collect_prompt_logprobs(batch: SchedulerOutput, owners: list[Request | None],
                             results: list[list[TokenLogprobs] | None]) -> None:
    """Append each chunk's prompt logprobs to its request's: only positions it lacks (a request
    preempted before its first output recomputes positions it already has)."""
    for scheduled, request, entries in zip(batch.requests, owners, results):
        if entries is None or request is None or request.prompt_logprobs is None:
            continue
        collected = request.prompt_logprobs
        skip = len(collected) - scheduled.start_position
        if skip >= 0:
            collected.extend(entries[skip:])


def _report(request: Request, is_first: bool) -> RequestOutput:
    """The output of the request's unreported tokens (and their logprobs); the first carries the
    prompt logprobs when asked."""
    new_token_ids = request.output_token_ids[-request.num_unreported_tokens:]
    logprobs = request.unreported_logprobs or None
    request.num_unreported_tokens = 0
    if logprobs is not None:
        request.unreported_logprobs = []
    output = request_output(request, new_token_ids, is_first, logprobs)
    if is_first and request.prompt_logprobs is not None:
        output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
    return output
