"""Continuous batching: which tokens of which requests run in the next step.

Every request state transition happens here (``RequestStatus``):

    WAITING -> RUNNING                 admitted: prefix hits taken, blocks allocated
    WAITING_FOR_REMOTE_KV -> WAITING   (disaggregated gen side) blocks allocated, the
                                       transfer agent filled them: ``finish_remote_kv``;
                                       or the pull failed: blocks freed, the prompt is
                                       prefilled here instead (``recompute_remote``)
    WAITING -> ONBOARDING              its prefix continues in the host or disk tier: blocks
                                       allocated for those, their KV copied in on a thread
    ONBOARDING -> WAITING              the copy is done (``_collect_onboarded``): first in line,
                                       the copied blocks computed and cached
    WAITING_FOR_REMOTE_KV -> ONBOARDING -> WAITING_FOR_REMOTE_KV
                                       (gen side) the same before its pull; the copied blocks
                                       are then pool hits, and only the rest is pulled
    RUNNING -> PREEMPTED               blocks ran out: blocks freed, progress reset,
                                       back to the front of its priority's part of the
                                       queue (recompute)
    PREEMPTED -> RUNNING               re-admitted like a new request
    RUNNING -> FINISHED_STOPPED        EOS (unless ignore_eos), a stop token id, or its grammar complete
    RUNNING -> FINISHED_LENGTH_CAPPED  max_tokens, or the sequence reached max_model_len
    any -> FINISHED_ABORTED            abort, or rejected at admission (``error`` set)

The rules for one request (what is rejected, when it stops, what it reports)
are in ``workers.engine.request_rules``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from common.block_hash import BlockHash
from workers.config import SchedulerConfig
from workers.engine.block_manager import BlockManager
from workers.engine.executor import ScheduledRequest, SchedulerOutput
from workers.engine.request import Request, RequestStatus
from workers.engine.request_rules import admission_error, request_output, stop_filter, token_slice
from workers.engine.speculative import Speculator
from workers.engine.step_results import StepResults
from workers.engine.tier_requests import TierRequests
from workers.protocol import RejectReason, RequestOutput

__all__ = ["Scheduler", "KVPull"]


@dataclass(frozen=True, slots=True)
class KVPull:
    """Blocks of a ``WAITING_FOR_REMOTE_KV`` request that the KV-transfer agent must fill.

    ``block_ids[i]`` receives block ``first_block + i`` of the remote request's
    table: the blocks before ``first_block`` hit this engine's prefix cache.
    The KV of positions ``[first_block * block_size, num_tokens)`` is needed.
    """

    request_id: int
    block_ids: list[int]
    first_block: int
    num_tokens: int


class Scheduler(StepResults):
    """Running requests first (decodes and unfinished prefill chunks), then waiting ones.

    The waiting queue is ordered by each request's ``priority`` (lower first, vLLM's
    semantics), arrival order among equals; it only orders admission: a running
    request is never preempted for a more urgent one.

    A step holds at most ``max_num_batched_tokens`` tokens and the running set
    at most ``max_num_seqs`` requests. A prompt longer than what is left of the
    budget is split across steps (chunked prefill); with chunked prefill off a
    prompt waits for a step that fits it whole, unless it alone exceeds the
    budget (then it is chunked anyway, or it would never run). When blocks run
    out for a running request the newest running request is preempted,
    possibly the one being scheduled; no waiting request is admitted in a
    step that preempted.

    ``max_model_len`` is capped at what the block pool can hold, so one request
    alone always fits and preemption always makes progress.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        speculator: Speculator | None = None,
    ) -> None:
        """``speculator``: decode steps of eligible requests carry prompt-lookup drafts (``speculative``)."""
        self.config = config
        self.speculator = speculator
        self.block_manager = block_manager
        self.max_model_len = min(max_model_len, block_manager.num_blocks * block_manager.block_size)
        self.eos_token_ids = eos_token_ids
        self.requests: dict[int, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: deque[Request] = deque()  # WAITING_FOR_REMOTE_KV, no blocks yet
        self._kv_pulls: list[KVPull] = []  # allocated remote requests not yet taken
        # Requests in WAITING_FOR_REMOTE_KV (queued or pulling): counted at the three transitions,
        # because the per-step stats read it and a scan of every request costs O(requests) a step.
        self._num_remote_kv = 0
        self._park_seconds: dict[int, float] = {}  # request id -> how long to park its KV at finish
        self._finished_outputs: list[RequestOutput] = []  # aborts and rejections, reported next step
        tiers = block_manager.tiers
        self.onboarding = TierRequests(block_manager, tiers) if tiers is not None else None  # ONBOARDING
        # Cumulative prefix-cache accounting, in tokens, counted at each admission.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_preemptions = 0  # cumulative
        self.num_preemptions_last_step = 0
        self.num_finished_last_step = 0  # by ``update`` (aborts and rejections are not counted)
        # Speculative decoding: drafts proposed and accepted, cumulative (Prometheus) and last step.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_last_step = 0

    # ---- requests in and out -----------------------------------------------

    def add_request(self, request: Request, park_kv_seconds: float | None = None) -> None:
        """Queue a request, or reject it (reported by the next step) when it can never run.

        ``park_kv_seconds`` (disaggregated ctx side): when the request finishes its
        blocks are parked for that long instead of freed (``BlockManager.park``).
        """
        if self._admit(request, park_kv_seconds):
            self._enqueue(request)

    def add_remote_request(self, request: Request, park_kv_seconds: float | None = None,
                           num_remote_tokens: int | None = None) -> None:
        """Queue a request whose KV comes from another engine: by default every position but the
        last token's (a gen leg); ``num_remote_tokens`` (a whole number of blocks) only that prefix,
        the rest prefilled here (a ctx leg fetching a prefix from a peer: the deployment's KV pool).

        A later ``schedule`` allocates its blocks (reusing local prefix hits) and
        publishes a ``KVPull``; ``finish_remote_kv`` makes it schedulable.
        ``park_kv_seconds``: as for ``add_request``.
        """
        if not self._admit(request, park_kv_seconds):
            return
        # Pulled KV has no logits: a gen leg reports the ctx leg's prompt logprobs, and a ctx leg that
        # asks for them pulls no prefix (``api.disaggregation``).
        request.prompt_logprobs = None
        request.num_remote_tokens = request.num_tokens - 1 if num_remote_tokens is None else num_remote_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._num_remote_kv += 1
        self.remote_waiting.append(request)

    def take_kv_pulls(self) -> list[KVPull]:
        pulls, self._kv_pulls = self._kv_pulls, []
        return pulls

    def has_kv_pulls(self) -> bool:
        return bool(self._kv_pulls)

    def finish_remote_kv(self, request_id: int) -> None:
        """The pulled blocks hold the remote KV: queue the request first in line to decode."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV or request in self.remote_waiting:
            raise ValueError(f"request {request_id} is not waiting for pulled KV")
        remote = _remote_tokens(request)
        if remote > request.num_computed_tokens:
            request.num_computed_tokens = remote
            if remote < request.num_prompt_tokens:  # a prefix from the KV pool: the deployment's cache saved it
                request.num_cached_tokens = remote
        self.block_manager.cache_full_blocks(request)
        request.status = RequestStatus.WAITING
        self._num_remote_kv -= 1
        self.waiting.appendleft(request)  # it holds blocks: never leave it behind requests needing them

    def recompute_remote(self, request_id: int) -> bool:
        """The request's KV pull failed: free its blocks and prefill it here like a preempted request
        (prompt and first token), so it still ends as it would have; False when it is not waiting for KV.

        Its frontend may have streamed the first token already (``api.disaggregation``): an
        abort could no longer be replayed on another worker without the client seeing it twice.
        """
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return False
        if request in self.remote_waiting:
            self.remote_waiting.remove(request)
        else:
            self._kv_pulls = [p for p in self._kv_pulls if p.request_id != request_id]
        self._num_remote_kv -= 1
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._enqueue(request)
        return True

    def _admit(self, request: Request, park_kv_seconds: float | None) -> bool:
        """``_accept``, and remember how long to park the request's KV at finish (a ctx leg)."""
        if park_kv_seconds is not None and self.block_manager.parked_block_ids(request.request_id) is not None:
            self.reject(request, RejectReason.KV_STILL_PARKED,
                        f"request id {request.request_id} still has parked KV blocks")
            return False
        if not self._accept(request):
            return False
        if park_kv_seconds is not None:
            self._park_seconds[request.request_id] = park_kv_seconds
        return True
    def _enqueue(self, request: Request) -> None:
        """Into ``waiting`` behind every request of its priority or a more urgent one (a lower
        value: vLLM's rule; equal priorities keep their arrival order), never ahead of a request
        holding blocks (its pulled KV, ``finish_remote_kv``: it must not wait for blocks it holds)."""
        waiting = self.waiting
        priority = request.sampling_params.priority
        if not waiting or waiting[-1].sampling_params.priority <= priority:
            waiting.append(request)  # the common case: one priority for all
            return
        index = len(waiting)
        while (index > 0 and waiting[index - 1].sampling_params.priority > priority
               and waiting[index - 1].num_computed_tokens == 0):
            index -= 1
        waiting.insert(index, request)

    def _accept(self, request: Request) -> bool:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id} is already in the engine")
        error = admission_error(request, self.max_model_len)
        if error is not None:
            self.reject(request, *error)
            return False
        stop_filter(request, self.eos_token_ids, self.max_model_len)
        self.requests[request.request_id] = request
        return True

    def reject(self, request: Request, reason: RejectReason, error: str) -> None:
        request.status = RequestStatus.FINISHED_ABORTED
        request.error = error
        request.reject_reason = reason
        self._finished_outputs.append(request_output(request, [], is_first=request.first_token_time is None))

    def abort(self, request_id: int) -> None:
        """Finish the request in any state and free its blocks now; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self._num_remote_kv -= 1
        if request.status == RequestStatus.ONBOARDING:
            if self.onboarding.abandon(request).remote:  # type: ignore[union-attr]  # (ONBOARDING: tiers)
                self._num_remote_kv -= 1
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.remote_waiting:
            self.remote_waiting.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self._kv_pulls = [p for p in self._kv_pulls if p.request_id != request_id]
        else:
            self.waiting.remove(request)
        self._park_seconds.pop(request_id, None)
        if self.onboarding is None or not self.onboarding.is_abandoned(request_id):
            self.block_manager.free(request)
        if self.onboarding is not None:
            self.onboarding.take_charge(request_id)  # (copied in, never scheduled: nothing to charge)
        request.grammar = None
        request.status = RequestStatus.FINISHED_ABORTED
        self._finished_outputs.append(request_output(request, [], is_first=request.first_token_time is None))

    def take_finished_outputs(self) -> list[RequestOutput]:
        """Outputs of requests aborted or rejected since the last call."""
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs)

    def has_work(self) -> bool:
        """Whether ``schedule`` can make progress now: false while every unfinished
        request waits for pulled KV (the transfer agent, not a step, moves them on)."""
        return bool(self.running or self.waiting or self.remote_waiting or self._finished_outputs
                    or (self.onboarding is not None and self.onboarding.has_done()))

    @property
    def is_idle(self) -> bool:
        """No request holds blocks (parked tables aside): none unfinished, none abandoned mid-copy."""
        return not self.requests and (self.onboarding is None or not self.onboarding.num_abandoned)

    @property
    def num_onboarding(self) -> int:
        return 0 if self.onboarding is None else self.onboarding.num_in_flight

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return self._num_remote_kv

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        batch = SchedulerOutput(requests=[])
        budget = self.config.max_num_batched_tokens
        self.num_preemptions_last_step = 0
        self.block_manager.release_expired(time.time())
        if self.onboarding is not None and self.onboarding.has_done():
            self._collect_onboarded()
        block_size = self.block_manager.block_size
        running, scheduled, owners = self.running, batch.requests, batch.owners
        speculator = self.speculator
        i = num_decodes = 0
        while i < len(running) and budget > 0:
            request = running[i]
            output_token_ids = request.output_token_ids
            num_computed = request.num_computed_tokens
            num_tokens = len(request.prompt_token_ids) + len(output_token_ids)  # (not the property: per request)
            if speculator is not None and num_computed == num_tokens - 1 and output_token_ids:
                drafts = speculator.drafts(request, budget)
                # Slots for the drafts too; none free: a plain decode (drafts never preempt anyone).
                if drafts and self.block_manager.try_allocate(request, 1 + len(drafts)):
                    num_decodes += 1 + len(drafts)
                    batch.num_draft_tokens += len(drafts)
                    scheduled.append(ScheduledRequest(
                        request.request_id, [output_token_ids[-1], *drafts], num_computed, request.block_ids, True,
                        request.sampling_params, len(output_token_ids), output_token_ids, request.prompt_token_ids,
                        request.grammar, draft_token_ids=drafts))
                    owners.append(request)
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            # Most decodes fit in the last block they hold: no allocation to ask for.
            if (num_computed == num_tokens - 1 and output_token_ids
                    and num_tokens <= len(request.block_ids) * block_size):
                # The decode step (the hot path): _add_to_batch's, built here (a running request was
                # scheduled before, so its first_scheduled_time is set).
                num_decodes += 1
                scheduled.append(ScheduledRequest(
                    request.request_id, [output_token_ids[-1]], num_computed, request.block_ids, True,
                    request.sampling_params, len(output_token_ids), output_token_ids, request.prompt_token_ids,
                    request.grammar))
                owners.append(request)
                budget -= 1
            else:
                num_new = min(num_tokens - num_computed, budget)
                fits = num_computed + num_new <= len(request.block_ids) * block_size
                if not fits and not self._allocate_or_preempt(request, num_new):
                    break  # the request preempted itself: it was the last running one
                self._add_to_batch(batch, request, num_new)
                budget -= num_new
            i += 1
        batch.num_decode_tokens += num_decodes
        self.num_draft_tokens += batch.num_draft_tokens
        if self.num_preemptions_last_step == 0:
            self._allocate_remote()
            self._admit_waiting(batch, budget)
        return batch

    def _allocate_remote(self) -> None:
        block_manager = self.block_manager
        while self.remote_waiting:
            request = self.remote_waiting[0]
            hits = block_manager.get_computed_blocks(request)
            if self.onboarding is not None:  # blocks below the pool are copied in first, not pulled
                lower = block_manager.lower_tier_hits(request, hits)
                if lower:
                    if not self._start_onboarding(request, hits, lower, remote=True):
                        return
                    continue
            num_cached = len(hits) * block_manager.block_size
            num_remote = max(0, _remote_tokens(request) - num_cached)  # at least the last token is computed here
            if not block_manager.try_allocate(request, num_remote, hits):
                return
            self.remote_waiting.popleft()
            request.num_computed_tokens = request.num_cached_tokens = num_cached
            self._count_prefix_lookup(request, num_cached)
            pull = KVPull(request.request_id, request.block_ids[len(hits) :], len(hits), num_cached + num_remote)
            self._kv_pulls.append(pull)

    def _count_prefix_lookup(self, request: Request, num_cached: int) -> None:
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += num_cached

    def _allocate_or_preempt(self, request: Request, num_new: int) -> bool:
        while not self.block_manager.try_allocate(request, num_new):
            victim = self.running.pop()  # newest; never one already in this batch
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_last_step += 1
        # First in line among its priority (it arrived before the requests waiting there), behind
        # more urgent ones: with one priority for all, the front of the queue.
        waiting, priority = self.waiting, request.sampling_params.priority
        index = 0
        while index < len(waiting) and waiting[index].sampling_params.priority < priority:
            index += 1
        waiting.insert(index, request)

    def _admit_waiting(self, batch: SchedulerOutput, budget: int) -> None:
        block_manager, max_batched = self.block_manager, self.config.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            fresh = request.num_computed_tokens == 0  # else its KV was pulled from a remote engine
            # A request still owed its prompt logprobs computes its whole prompt: a cached block has
            # KV but no logits (vLLM skips the prefix cache for these requests too).
            reuses = fresh and request.prompt_logprobs is None
            hits = block_manager.get_computed_blocks(request) if reuses else []
            if reuses and self.onboarding is not None:
                lower = block_manager.lower_tier_hits(request, hits)
                if lower:
                    if not self._start_onboarding(request, hits, lower, remote=False):
                        break
                    continue  # (an inline copy put it back first in line: admitted next)
            num_cached = len(hits) * block_manager.block_size
            num_new = request.num_tokens - request.num_computed_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill and num_new <= max_batched:
                    break  # wait for a step with room for the whole prompt
                num_new = budget
            if not block_manager.try_allocate(request, num_new, hits):
                break
            self.waiting.popleft()
            if fresh:
                request.num_computed_tokens = request.num_cached_tokens = num_cached
                self._count_prefix_lookup(request, num_cached)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if self.onboarding is not None:
                batch.num_onboarded_blocks += self.onboarding.take_charge(request.request_id)
            self._add_to_batch(batch, request, num_new)
            budget -= num_new

    def _start_onboarding(self, request: Request, hits: list[int], lower: list[BlockHash], remote: bool) -> bool:
        """Copy the ``lower`` tier hits in (``TierRequests.start``); the request leaves the head of
        ``remote_waiting`` (``remote``) or ``waiting``. False when the pool has no room now."""
        onboarding = self.onboarding
        if onboarding is None or not onboarding.start(request, hits, lower, remote):
            return False
        (self.remote_waiting if remote else self.waiting).popleft()
        request.status = RequestStatus.ONBOARDING
        if onboarding.has_done():  # an inline copy (the simulation)
            self._collect_onboarded()
        return True

    def _collect_onboarded(self) -> None:
        """Copied requests wait first in line. One whose KV is pulled lets the copied blocks go to the
        prefix cache, where its allocation finds them as hits: only the blocks after them are pulled."""
        for copy in self.onboarding.collect():  # type: ignore[union-attr]  # (called with tiers only)
            request = copy.request
            if copy.remote:
                self.block_manager.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.remote_waiting.appendleft(request)
            else:
                request.num_cached_tokens = request.num_computed_tokens
                self._count_prefix_lookup(request, request.num_cached_tokens)
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)

    def _add_to_batch(self, batch: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        output_token_ids = request.output_token_ids
        num_tokens = len(request.prompt_token_ids) + len(output_token_ids)
        if end == num_tokens and start == num_tokens - 1 and output_token_ids:
            batch.num_decode_tokens += 1
            token_ids = [output_token_ids[-1]]  # the decode step (the hot path)
        else:
            batch.num_prefill_tokens += num_new
            token_ids = token_slice(request, start, end)
        # Live lists (block table, output and prompt tokens), read-only for the executor
        # while the step runs: copying them every step would cost O(length) per request.
        # Prompt logprobs: the positions of this chunk that score a prompt token (never the last one's:
        # that row is the sampled one).
        prompt_rows = 0 if request.prompt_logprobs is None else max(0, min(end, request.num_prompt_tokens - 1) - start)
        batch.requests.append(ScheduledRequest(
            request.request_id, token_ids, start, request.block_ids, end == num_tokens, request.sampling_params,
            len(output_token_ids), output_token_ids, request.prompt_token_ids, request.grammar, prompt_rows))
        batch.owners.append(request)


def _remote_tokens(request: Request) -> int:
    """The positions whose KV a remote request pulls (``add_remote_request``)."""
    return request.num_tokens - 1 if request.num_remote_tokens is None else request.num_remote_tokens
