"""The two-phase request flow: plan, ctx leg, gen leg, with retries and streaming.

1. Plan: the gen router picks the gen worker first, because conditional
   disaggregation depends on what it already caches. The ctx leg is skipped
   (one normal request to the gen worker: mode ``aggregated``) when
   ``should_skip_ctx`` says so, when the client asked for one token, when no
   ctx worker is healthy, or when the ctx router picks the gen worker itself
   (a ``both`` worker: no point moving KV to itself).
2. ctx leg: context_only, non-streaming, ``x-request-id: <id>-ctx``. A failed
   worker (no connection, timeout, 5xx) is retried on another ctx worker, at
   most ``max_retries`` times; when none succeeds, or the worker refuses the
   leg itself (a 400 naming ``disaggregated_params``: no cluster key, wrong
   role), the request goes to the gen worker as a normal one. Any other 4xx
   from any leg is the client's answer as it is, never retried or sent to
   another worker (the request was validated before planning,
   ``orchestrator.validation``, so such a 4xx is rare). An answer
   that already finished (``disaggregated_params.finished``) is the client's
   answer (mode ``ctx_only``); for a streaming client it is instead served as
   a normal request on the gen worker, because re-encoding a finished answer
   as a stream per API is not worth its code, and so is one that asked for
   ``n`` > 1 choices or ``echo`` (``ParsedRequest.ctx_can_answer``). With ``n``
   > 1 the ctx leg makes choice 0's first token and the gen leg all ``n``
   choices (``api.choices``): the prompt's KV moves once. Prompt logprobs
   (``echo`` with ``logprobs``, ``prompt_logprobs``) are the ctx leg's to
   compute: they ride in its ``disaggregated_params`` to the gen leg, which
   reports them and computes none (``api.disaggregation``).
3. gen leg: generation_only with the ctx params and prompt ids,
   ``x-request-id: <id>-gen``, streaming as the client asked. A failure
   before the first byte reached the client is retried as a *normal* request
   on another gen worker (always correct, whatever happened to the parked
   KV; a KV pull that fails is no failed leg: the gen engine prefills the
   prompt itself, ``Scheduler.recompute_remote``); a connection
   lost before anything was relayed goes once more to the same worker (one of
   its frontends died, not the worker). After the first byte, the stream moves
   to another gen worker, token-exact (``orchestrator.migration``), or, when it
   cannot, ends with the API's error event. Closing the client's stream closes the upstream
   one, which aborts the request in the worker (and, through it, the KV pull).

A worker's 429 or 529 (at one of its admission limits, ``api.admission``) is a
failed leg that does not make the worker suspect nor count against ``max_retries``:
the leg goes on to every other worker of its phase; when every gen worker refused,
the client gets 429 (Anthropic: 529) with Retry-After. When every ctx worker refused,
the gen worker serves the request alone (it refuses in turn when it is full).
A connection refused or lost before any answer is first retried on the same worker
(``orchestrator.attempts``; the leg client only raises): one dead frontend is not a dead worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

import msgspec
from starlette.responses import Response

from api.admission import OVERLOADED_STATUSES, RETRY_AFTER_SECONDS, Limit, OverloadedError, QueueTicket
from api.request_fields import warning_header
from api.streaming import FinalFrame
from orchestrator.answers import Answer, JsonAnswer, StreamAnswer, Watch, to_response
from orchestrator.attempts import Attempts
from orchestrator.config import OrchestratorConfig
from orchestrator.errors import LegFailed, NoWorkerError, RequestTimeoutError, UpstreamFailedError, UpstreamRejected
from orchestrator.http_client import HttpClient, LegResponse, UpstreamError, UpstreamTimeout
from orchestrator.kv_pool import KVPool
from orchestrator.metrics import Metrics
from orchestrator.migration import MARKS_HEADERS, Migration
from orchestrator.prompt import ParsedRequest, ctx_leg_body, gen_leg_body
from orchestrator.registry import WorkerRecord
from orchestrator.relay import Relay
from orchestrator.request_end import RequestEnds
from orchestrator.routing import Candidate, Router, RouteRequest, should_skip_ctx
from orchestrator.state_protocol import CtxLegTrace, FailedLeg, GenLegTrace, RequestTrace
from orchestrator.view import ClusterView, StateLink
from workers.disagg_params import DisaggParams
from workers.http_protocol import CtxAnswer, Mode, Phase, client_answer

__all__ = ["Flow", "within"]

log = logging.getLogger("disagg.orchestrator.flow")

T = TypeVar("T")

_CTX_ANSWER = msgspec.json.Decoder(CtxAnswer)


class Flow:
    def __init__(self, config: OrchestratorConfig, view: ClusterView, link: StateLink, upstream: HttpClient,
                 metrics: Metrics, ends: RequestEnds) -> None:
        self.config = config
        self.ends = ends
        self.view = view
        self.link = link
        self.upstream = upstream
        self.metrics = metrics
        self.ctx_router = Router(config.ctx_router)
        self.gen_router = Router(config.gen_router)
        self.pool = KVPool(view, upstream)

    def apply(self, config: OrchestratorConfig) -> None:
        """New live settings (``Orchestrator.apply_settings``); a router whose settings are unchanged
        keeps its state (its round-robin position, its sessions)."""
        if config.ctx_router != self.config.ctx_router:
            self.ctx_router = Router(config.ctx_router)
        if config.gen_router != self.config.gen_router:
            self.gen_router = Router(config.gen_router)
        self.config = config

    # -- planning ---------------------------------------------------------------------------

    def choose(self, phase: Phase, request: ParsedRequest, exclude: set[str]) -> Candidate | None:
        candidates = self.view.candidates(phase, request.prompt_ids, exclude, request.block_hashes)
        if not candidates:
            return None
        router = self.ctx_router if phase is Phase.CTX else self.gen_router
        return router.choose(candidates, RouteRequest(len(request.prompt_ids), request.session_id))

    def pick(self, phase: Phase, request: ParsedRequest, exclude: set[str]) -> WorkerRecord | None:
        chosen = self.choose(phase, request, exclude)
        return None if chosen is None else self.view.workers[chosen.worker_id]

    def plan(self, request: ParsedRequest) -> tuple[WorkerRecord, WorkerRecord | None]:
        """(gen worker, ctx worker or None for a normal request)."""
        chosen = self.choose(Phase.GEN, request, set())
        if chosen is None:
            raise NoWorkerError("no healthy generation worker")
        gen = self.view.workers[chosen.worker_id]
        if request.max_tokens == 1:  # the ctx leg's one token is the whole answer
            return gen, None
        if should_skip_ctx(self.config.conditional, len(request.prompt_ids), chosen.matched_blocks,
                           chosen.block_size):
            return gen, None
        ctx = self.pick(Phase.CTX, request, set())
        if ctx is None or ctx.worker_id == gen.worker_id:
            return gen, None
        return gen, ctx

    # -- the request ------------------------------------------------------------------------

    async def handle(self, request: ParsedRequest, request_id: str, watch: Watch, record: RequestTrace) -> Response:
        """``answer`` as a Starlette response (the ASGI routes, batches)."""
        return to_response(await self.answer(request, request_id, watch, record))

    async def answer(self, request: ParsedRequest, request_id: str, watch: Watch, record: RequestTrace,
                     queued: QueueTicket | None = None) -> Answer:
        """``queued``: the request's place in this process's queue bound, left once its first token is
        known (the ctx leg's answer); the caller leaves it at the latest when this returns."""
        record.num_prompt_tokens = len(request.prompt_ids)
        deadline = time.monotonic() + self.config.timeouts.request_seconds
        gen, ctx = self.plan(request)
        headers = {"x-request-id": request_id}
        if request.ignored_fields:
            name, value = warning_header(request.ignored_fields)
            headers[name.decode()] = value.decode()
        gen_params: DisaggParams | None = None  # None: the gen leg is a normal request
        record.mode = Mode.AGGREGATED if ctx is None else Mode.DISAGG
        if ctx is not None:
            kv_prefix = await self.fetch_prefix(request, request_id, ctx, watch, deadline)
            ctx_answer = await self.ctx_phase(request, request_id, ctx, record, watch, deadline, kv_prefix)
            if queued is not None:
                queued.leave()
            if record.ctx is not None:
                headers["x-disagg-ctx-worker"] = record.ctx.worker_id
            answer, raw = ctx_answer or (CtxAnswer(), b"")
            finished = answer.disaggregated_params is not None and answer.disaggregated_params.finished
            if finished and not request.stream and request.ctx_can_answer:
                record.mode = Mode.CTX_ONLY
                self.finish(record, request)
                return JsonAnswer(client_answer(raw), {**headers, "x-disagg-mode": record.mode})
            # None: no ctx answer, finished (streaming client), or a worker without disagg support
            gen_params = answer.gen_params(request.prompt_ids)
            if gen_params is None:
                record.mode = Mode.AGGREGATED
        headers["x-disagg-mode"] = record.mode
        if request.stream:
            return await self.stream_gen(request, request_id, gen, gen_params, record, headers, deadline)
        answer_bytes, gen_worker = await watch(
            self._within(deadline, self.run_gen(request, request_id, gen, gen_params, record)))
        headers["x-disagg-gen-worker"] = gen_worker.worker_id
        self.finish(record, request, answer_bytes)
        return JsonAnswer(answer_bytes, headers)

    async def fetch_prefix(self, request: ParsedRequest, request_id: str, ctx: WorkerRecord, watch: Watch,
                           deadline: float) -> DisaggParams | None:
        """The ``kv_prefix`` of the ctx leg when the KV pool has the prompt's prefix on another worker."""
        if request.scores_prompt:  # its ctx leg computes the whole prompt (api.disaggregation)
            return None
        source = self.pool.source(self.config.kv_pool, request, ctx)
        if source is None:
            return None
        kv_prefix = await watch(self._within(deadline, self.pool.export(source, request, request_id)))
        self.metrics.kv_pool_fetches.labels("parked" if kv_prefix is not None else "failed").inc()
        if kv_prefix is not None:
            self.metrics.kv_pool_tokens.inc(source.gain_tokens)
        return kv_prefix

    async def ctx_phase(self, request: ParsedRequest, request_id: str, ctx: WorkerRecord, record: RequestTrace,
                        watch: Watch, deadline: float, kv_prefix: DisaggParams | None = None
                        ) -> tuple[CtxAnswer, bytes] | None:
        """The ctx answer (what the orchestrator reads of it, and its bytes), or None when the gen
        worker should serve the request alone."""
        try:
            answer, _ = await watch(self._within(deadline, self.run_ctx(request, request_id, ctx, record, kv_prefix)))
        except UpstreamFailedError as exc:
            # Every ctx worker failed (no connection, timeout, 5xx): the gen worker can still do it all.
            log.warning("request %s: no ctx leg (%s); serving it on the gen worker alone", request_id, exc)
            return None
        except UpstreamRejected as exc:
            # Any other 4xx is the client's error: it goes to the client, never to the gen worker.
            if not exc.refuses_the_leg:
                raise
            log.warning("request %s: the ctx worker cannot run a disaggregated leg (%s); serving it on the gen "
                        "worker alone", request_id, exc.body[:200])
            self.metrics.errors.labels(Phase.CTX, "leg_refused").inc()
            return None
        params = answer[0].disaggregated_params
        if record.ctx is not None and params is not None and params.ctx_request_id is not None:
            record.ctx.engine_request_id = params.ctx_request_id  # joins the ctx worker's perf record
        return answer

    async def _within(self, deadline: float, work: Awaitable[T]) -> T:
        return await within(deadline, work, self.config.timeouts.request_seconds)

    def finish(self, record: RequestTrace, request: ParsedRequest, answer_tail: bytes = b"") -> None:
        """``answer_tail``: the answer's JSON or its stream's last bytes, where its usage is."""
        record.end = time.time()
        self.metrics.count_served(request.api, record.mode)
        self.metrics.observe("e2e", record.end - record.arrival)
        self.ends.end(record, 200, answer_tail)
        if not self.view.local_load:  # nothing else in flight: no batch to wait for (orchestrator.metrics)
            self.metrics.flush()

    # -- the one retry loop -----------------------------------------------------------------

    async def attempt(self, phase: Phase, request: ParsedRequest, first: WorkerRecord, record: RequestTrace,
                      leg: Callable[[WorkerRecord, bool], Awaitable[T]]) -> tuple[T, WorkerRecord]:
        """``leg(worker, replay)`` until one succeeds, on the worker ``decide`` names after each
        failure; ``replay``: after a failure (not a refusal) a gen leg goes as a normal request (the
        parked KV may be gone). Any exception but LegFailed (a 4xx, the deadline, a disconnect) ends it at once."""
        attempts = Attempts(phase, self.config.max_retries)
        worker: WorkerRecord | None = first
        replay = False
        while worker is not None:
            attempts.start(worker)
            try:
                return await leg(worker, replay), worker
            except LegFailed as exc:
                failed, worker = worker, self.decide(request, attempts, worker, exc, record)
                replay = replay or not exc.refused  # a worker that refused touched no parked KV
                if worker is failed:  # one of its frontends died: the next connection reaches another
                    await asyncio.sleep(attempts.pause(worker))
        if attempts.all_refused():  # busy, not broken
            self.metrics.errors.labels(phase, "overloaded").inc()
            if phase is Phase.GEN:
                self.metrics.count_refused(Limit.WORKERS)
                raise OverloadedError(f"every generation worker is at an admission limit "
                                      f"({len(attempts.tried)} tried); retry after {RETRY_AFTER_SECONDS} s")
        elif phase is Phase.GEN and attempts.all_unavailable():  # each said so itself (a stalled or dead engine): retryable, not a 502
            self.metrics.errors.labels(phase, "unavailable").inc()
            raise NoWorkerError(f"every generation worker tried is unavailable ({len(attempts.tried)} tried); "
                                f"retry after {RETRY_AFTER_SECONDS} s")
        else:
            self.metrics.errors.labels(phase, "upstream").inc()
        name = "context" if phase is Phase.CTX else "generation"
        raise UpstreamFailedError(f"every {name} worker failed ({len(attempts.tried)} tried)")

    def decide(self, request: ParsedRequest, attempts: Attempts, failed: WorkerRecord, exc: LegFailed,
               record: RequestTrace) -> WorkerRecord | None:
        """Where a failed leg goes next (None: nowhere): the same worker once after a lost connection;
        else another worker of the phase."""
        suspect, again = attempts.failed(failed, exc)
        if suspect:
            self.view.suspect(failed.worker_id)
        record.legs.append(FailedLeg(attempts.phase, failed.worker_id, str(exc)))
        if again:  # another of its frontends: neither one of max_retries nor a retry counted
            return failed
        if not attempts.may_retry():
            return None
        self.metrics.retries.labels(attempts.phase).inc()
        record.retries += 1
        return self.pick(attempts.phase, request, attempts.tried)

    # -- legs -------------------------------------------------------------------------------

    async def _post(self, phase: Phase, worker: WorkerRecord, path: str, body: bytes, request_id: str,
                    tokens: int, record: RequestTrace, start: float) -> bytes:
        self.metrics.count_leg(phase)
        self.view.acquire(worker.worker_id, tokens)
        headers = {"x-request-id": request_id, "content-type": "application/json"}
        span = self.ends.open_leg(record, phase, worker.worker_id, start, headers)
        failure: BaseException | None = None
        try:
            status, content = await self.upstream.call("POST", worker.url + path, body, headers)
        except UpstreamError as exc:
            failure = exc
            raise LegFailed(f"{worker.worker_id}: {type(exc).__name__}: {exc}", unanswered=True,
                            connection_lost=_frontend_lost(exc)) from exc
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self.view.release(worker.worker_id, tokens)
            if span is not None:
                self.ends.close_leg(span, time.time(), failure)
        if status in OVERLOADED_STATUSES:
            raise LegFailed(f"{worker.worker_id} answered {status} (at an admission limit)", refused=True)
        if status >= 500:
            raise LegFailed(f"{worker.worker_id} answered {status}", unavailable=status == 503)
        if status != 200:
            raise UpstreamRejected(status, content)
        return content

    async def run_ctx(self, request: ParsedRequest, request_id: str, first: WorkerRecord, record: RequestTrace,
                      kv_prefix: DisaggParams | None = None) -> tuple[tuple[CtxAnswer, bytes], WorkerRecord]:
        body = ctx_leg_body(request, kv_prefix)

        async def leg(worker: WorkerRecord, replay: bool) -> tuple[CtxAnswer, bytes]:
            start = time.time()
            raw = await self._post(Phase.CTX, worker, request.path, body, f"{request_id}-ctx",
                                   len(request.prompt_ids), record, start)
            record.ctx = CtxLegTrace(worker_id=worker.worker_id, start=start, end=time.time())
            self.metrics.observe(Phase.CTX, record.ctx.end - start)
            try:
                answer = _CTX_ANSWER.decode(raw)
            except msgspec.DecodeError as exc:  # ValidationError too: not a worker of this deployment's
                raise LegFailed(f"{worker.worker_id} answered an unreadable ctx answer: {exc}") from exc
            if answer.disaggregated_params is not None:
                self.pool.observe_ctx_leg(worker, len(request.prompt_ids), answer.disaggregated_params,
                                          record.ctx.end - start)
            return answer, raw

        return await self.attempt(Phase.CTX, request, first, record, leg)

    async def run_gen(self, request: ParsedRequest, request_id: str, first: WorkerRecord,
                      params: DisaggParams | None, record: RequestTrace) -> tuple[bytes, WorkerRecord]:
        async def leg(worker: WorkerRecord, replay: bool) -> bytes:
            start = time.time()
            raw = await self._post(Phase.GEN, worker, request.path, gen_leg_body(request, None if replay else params),
                                   f"{request_id}-gen", len(request.prompt_ids), record, start)
            end = time.time()
            record.gen = GenLegTrace(worker_id=worker.worker_id, start=start, first_byte=end, end=end)
            self.metrics.observe(Phase.GEN, end - start)
            return raw

        return await self.attempt(Phase.GEN, request, first, record, leg)

    async def stream_gen(self, request: ParsedRequest, request_id: str, first: WorkerRecord,
                         params: DisaggParams | None, record: RequestTrace, headers: dict[str, str],
                         deadline: float) -> StreamAnswer:
        tokens = len(request.prompt_ids)
        # A stream of n choices, or one that echoes its prompt, is not moved: its marks name one
        # choice's tokens, and a resumed leg would echo the prompt again.
        migrating = self.config.migration.limit > 0 and request.ctx_can_answer  # (n == 1, no echo)

        async def leg(worker: WorkerRecord, replay: bool
                      ) -> tuple[LegResponse, AsyncGenerator[bytes, None], bytes, Migration | None]:
            leg_params = None if replay else params
            start = time.time()
            self.metrics.count_leg(Phase.GEN)
            self.view.acquire(worker.worker_id, tokens)
            upstream = None
            headers = {"x-request-id": f"{request_id}-gen", "content-type": "application/json"}
            if migrating:
                headers.update(MARKS_HEADERS)
            migration = Migration(self, request, request_id, leg_params) if migrating else None
            span = self.ends.open_leg(record, Phase.GEN, worker.worker_id, start, headers)
            try:
                upstream = await self._within(deadline, self.upstream.post(
                    worker.url + request.path, gen_leg_body(request, leg_params), headers))
                if upstream.status in OVERLOADED_STATUSES:
                    raise LegFailed(f"{worker.worker_id} answered {upstream.status} (at an admission limit)",
                                    refused=True)
                if upstream.status >= 500:
                    raise LegFailed(f"{worker.worker_id} answered {upstream.status}",
                                    unavailable=upstream.status == 503)
                if upstream.status != 200:
                    raise UpstreamRejected(upstream.status, await upstream.read())
                chunks = upstream.chunks()
                first_chunk = await self._within(deadline, chunks.__anext__())  # still retryable until here
                if migration is not None:
                    first_chunk = await self._first_write(worker, migration, chunks, first_chunk, deadline)
            except BaseException as exc:
                self.view.release(worker.worker_id, tokens)
                if span is not None:
                    self.ends.close_leg(span, time.time(), exc)
                if upstream is not None:
                    upstream.close()
                if isinstance(exc, (UpstreamError, StopAsyncIteration)):
                    raise LegFailed(f"{worker.worker_id}: {type(exc).__name__}: {exc}",
                                    unanswered=isinstance(exc, UpstreamError),
                                    connection_lost=isinstance(exc, UpstreamError) and _frontend_lost(exc)) from exc
                raise
            record.gen = GenLegTrace(worker_id=worker.worker_id, start=start, first_byte=time.time())
            if span is not None:
                self.ends.keep_gen_leg(record, span)
            self.metrics.observe("gen_first_byte", record.gen.first_byte - start)
            self.metrics.observe("ttft", record.gen.first_byte - record.arrival)
            return upstream, chunks, first_chunk, migration

        (upstream, chunks, first_chunk, migration), worker = await self.attempt(Phase.GEN, request, first, record,
                                                                                leg)
        relay = Relay(self, request, upstream, chunks, first_chunk, worker, tokens, record, deadline, migration)
        return StreamAnswer(relay, {**headers, "x-disagg-gen-worker": worker.worker_id})

    async def _first_write(self, worker: WorkerRecord, migration: Migration, chunks: AsyncGenerator[bytes, None],
                           chunk: bytes, deadline: float) -> bytes:
        """A marked leg's first whole write (marks stripped), read on until one is complete; a
        leg whose first write is a 5xx error event failed before the client saw a byte (LegFailed:
        retried from the start, as any such failure)."""
        while True:
            data = migration.read(chunk)
            if migration.failed is not None and not data:
                raise LegFailed(f"{worker.worker_id} failed before its first token ({migration.failed})",
                                unavailable="status 503" in migration.failed)
            if migration.failed is not None:
                return data  # the relay moves the stream after relaying this
            if type(chunk) is FinalFrame:
                return FinalFrame(data + migration.rest())
            if data:
                return data
            try:
                chunk = await self._within(deadline, chunks.__anext__())
            except StopAsyncIteration:  # it ended unmarked (a worker that ignores the header): all of it
                rest = migration.rest()
                if not rest:
                    raise
                return FinalFrame(rest)


def _frontend_lost(exc: UpstreamError) -> bool:
    """Whether a leg's failure may be one lost frontend process, not its worker: a connection
    refused (its listening socket lingers a moment after a kill) or lost before anything was
    relayed to the client; not a timeout (the worker is slow, not gone)."""
    return not isinstance(exc, UpstreamTimeout)


async def within(deadline: float, work: Awaitable[T], request_seconds: float) -> T:
    """``await work`` until ``deadline`` (monotonic), else RequestTimeoutError.

    The work runs in the caller's task, not wait_for's: Python 3.11's wait_for runs it in a task of its
    own, and when a client disconnect cancelled that task as its leg failed (a cancel swallowed below,
    by a wait_for whose future had just completed), the leg's exception ended in a task nobody
    awaited: "Task exception was never retrieved ... UpstreamRejected". What asyncio.timeout does, on
    one timer handle (asyncio.timeout's context manager cost three times as much, per request)."""
    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0.001), expire)
    try:
        result = await work
    except asyncio.CancelledError:
        if expired and task.uncancel() <= cancelling:  # ours, not the client's disconnect or a shutdown
            raise RequestTimeoutError(f"the request took longer than {request_seconds} s") from None
        raise
    finally:
        timer.cancel()
    if expired:  # the work absorbed our cancellation and finished anyway: take the request back
        task.uncancel()
    return result
