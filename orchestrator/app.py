"""The orchestrator's ASGI app (one per process): ``build_app(config, process_index, tokenizer)``.

Client APIs (OpenAI, Anthropic) run through ``orchestrator.flow``; the rest
of a worker's client surface (count_tokens, tokenize, models, version) is
answered here (``orchestrator.surface``); cluster routes read this process's
``ClusterView``; registration, perf, Message Batches and OpenAI Files and Batches routes are
forwarded to the state owner (the leader, ``orchestrator.leadership``; ``orchestrator.batches``,
``orchestrator.openai_batches``). Every error has the API's shape
(``api.errors``), also those outside a handler and streams cut short
(``orchestrator.clean_ends``). With ``api_key`` set, every route but /health
needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (401 otherwise;
``api.api_key``): the cluster view, the metrics and perf records name the
workers and describe the traffic. The API's description (/openapi.json, /docs,
/redoc) stays open: it holds no state. With ``worker_key_file`` set, every
call to a worker presents the deployment's worker key.
The app is a ``api.openapi.DocumentedApp``: FastAPI's ``/openapi.json``
and ``/docs`` (``orchestrator.openapi_routes``), Starlette's request path.
The generation routes' requests mostly never reach it: ``orchestrator.fast_http``
serves them in the HTTP protocol itself, with the same checks (one admission
gate, ``Orchestrator.admission``) and ``Orchestrator.generate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.admission import AdmissionGate, AdmissionMiddleware, QueueBound, per_frontend_limit
from api.api_key import RequiredKey, bearer_header, read_key_file
from api.body_limit import BodyLimitMiddleware
from api.errors import InvalidRequestError, anthropic_error_body, http_error, openai_error_body
from api.openapi import DocumentedApp
from api.responses import RESPONSES_FILE, LocalResponses, ResponseStore
from api.route_errors import route_error_response
from api.streaming import ClientDisconnected
from api.tokenizer import Tokenizer
from common.log_format import REQUEST_ID
from orchestrator import responses, surface
from orchestrator.answers import Answer, Watch, disconnect_watch, to_response
from orchestrator.batches import batch_forward
from orchestrator.clean_ends import CleanEndsMiddleware
from orchestrator.config import LiveSettings, OrchestratorConfig
from orchestrator.errors import NoWorkerError, UpstreamRejected
from orchestrator.flow import Flow
from orchestrator.http_client import HttpClient
from orchestrator.metrics import CONTENT_TYPE, Metrics
from orchestrator.openapi_routes import DESCRIPTION, OPEN_PATHS, ORCHESTRATOR_DOCS
from orchestrator.prompt import parse_request
from orchestrator.request_end import RequestEnds
from orchestrator.state_protocol import DrainRequest, RequestTrace, WorkerRef
from orchestrator.validation import RequestValidator
from orchestrator.view import ClusterView, StateLink
from workers.http_protocol import Phase

if TYPE_CHECKING:
    from api.tracing import Tracing

__all__ = ["build_app", "Orchestrator", "error_parts", "worker_key_headers", "CLIENT_CLOSED_REQUEST"]

log = logging.getLogger("disagg.orchestrator")

CLIENT_CLOSED_REQUEST = 499
FIRST_SNAPSHOT_WAIT_SECONDS = 10.0
"""How long a request may wait for a fresh process's first view of the cluster (normally milliseconds)."""


class Orchestrator:
    """What one process serves from: config, tokenizer, view, link to the owner, flow."""

    def __init__(self, config: OrchestratorConfig, process_index: int, tokenizer: Tokenizer) -> None:
        self.config = config
        self.process_index = process_index
        self.tokenizer = tokenizer
        self.view = ClusterView(process_index, config.default_block_size, config.default_hash_seed)
        # Every client body is checked whole here, by the workers' own code, before any leg.
        self.validator = RequestValidator(tokenizer, config.model_name, _KnownLimits(self),
                                          config.strict_request_fields)
        self.link = StateLink(config.state_socket, self.view, push_loads=config.processes > 1)
        self.metrics = Metrics(tokenizer.piece_cache)
        self.metrics.process.on_sample(self._sample_in_flight)
        # One count per process of the generation requests in flight, for the app and the fast lane.
        self.admission = AdmissionGate(config.max_concurrent_requests or None, "this orchestrator process", "")
        # What clients present (None: open), and what this process presents to every worker.
        self.api_key = RequiredKey(config.api_key) if config.api_key is not None else None
        worker_headers = worker_key_headers(config)
        self.admission.on_refused = self.metrics.count_refused
        # This process's share of the orchestrator's bound on requests without a first token yet.
        self.queue = QueueBound(per_frontend_limit(config.max_queued_requests, config.processes),
                                per_frontend_limit(config.max_queued_prompt_tokens, config.processes),
                                "the orchestrator", self.metrics.count_refused)
        timeouts = config.timeouts
        self.legs = HttpClient(timeouts.connect_seconds, timeouts.idle_seconds,  # request legs: the hot path
                               headers=worker_headers)
        # Health, worker info, KV events, perf: a few calls a second.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeouts.idle_seconds, connect=timeouts.connect_seconds),
                                        headers=worker_headers)
        self.tracing = _tracing(config)
        # Every client request's end: its perf record, access line and spans (orchestrator.request_end).
        self.ends = RequestEnds(self.link, config.access_log, self.tracing)
        self.flow = Flow(config, self.view, self.link, self.legs, self.metrics, self.ends)
        self.view.on_settings = self.apply_settings
        # Stored responses (/v1/responses): one file that every process shares (orchestrator.responses).
        self.responses = LocalResponses(ResponseStore(Path(config.state_dir) / RESPONSES_FILE))
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_counter = itertools.count()

    def _sample_in_flight(self) -> None:
        # Read on the sampling thread too: copy before summing (the loop may change the dict meanwhile).
        self.metrics.in_flight.set(sum(load[0] for load in list(self.view.local_load.values())))

    def new_request_id(self) -> str:
        """Unique across processes and restarts: a random prefix per process, then a counter
        (a uuid4 per request cost about 10 µs, as much as its metrics)."""
        return f"req-{self._id_prefix}{next(self._id_counter):x}"

    async def generate(self, api: str, read_body: Callable[[], Awaitable[bytes]], request_id: str | None,
                       session_header: str | None, watch: Watch, traceparent: str | None = None) -> Answer:
        """A client's generation request (API ``api``), read, checked, tokenized and run through the
        flow; a failure is counted and leaves a perf record, then propagates. ``traceparent``: the
        client's W3C header, the parent of the request's spans."""
        request_id = request_id or self.new_request_id()
        REQUEST_ID.set(request_id)  # every log line of this request's task (common.log_format)
        record = RequestTrace(request_id=request_id, api=api, arrival=time.time())
        self.ends.begin(record, traceparent)
        try:
            parsed = parse_request(api, await read_body(), self.validator, session_header)
            record.tokenized = time.time()
            if not self.link.first_snapshot.is_set():
                # A process that has just (re)started shares the port before the owner's first
                # snapshot reaches it: its view is empty, not the cluster. Wait, do not answer 503.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.link.first_snapshot.wait(), FIRST_SNAPSHOT_WAIT_SECONDS)
            queued = self.queue.enter(len(parsed.prompt_ids))
            try:
                return await self.flow.answer(parsed, request_id, watch, record, queued)
            finally:
                if queued is not None:
                    queued.leave()  # a stream's first byte is out, or the request ended
        except Exception as exc:
            self.failed(record, exc, api == "messages")
            raise

    def failed(self, record: RequestTrace, exc: Exception, anthropic: bool) -> None:
        """A request that ends in ``exc``: counted, and ended with the status its client gets."""
        self.metrics.count_failure(exc)
        record.error, record.end = f"{type(exc).__name__}: {exc}", time.time()
        status = CLIENT_CLOSED_REQUEST if isinstance(exc, ClientDisconnected) else error_parts(exc, anthropic)[0]
        self.ends.end(record, status)

    def apply_settings(self, live: LiveSettings) -> None:
        """The owner's live settings (``disagg reload``), for the next request: routers, conditional
        disaggregation, timeouts, retries, the admission limit, the log level."""
        if live == self.config.live():
            return
        self.config = self.config.with_live(live)
        self.flow.apply(self.config)
        if self.admission.limit is not None and live.max_concurrent_requests:  # 0 <-> N: refused by the owner
            self.admission.limit = live.max_concurrent_requests
        self.legs.connect_timeout = live.timeouts.connect_seconds
        self.legs.idle_timeout = live.timeouts.idle_seconds
        for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(live.log_level.upper())
        log.info("process %d: live settings applied (%s)", self.process_index, live)

    async def start(self) -> None:
        self.link.start()
        self.metrics.process.start()

    async def close(self) -> None:
        self.metrics.flush()
        await self.link.close()
        self.legs.close()
        await self.client.aclose()
        self.responses.store.close()
        if self.tracing is not None:  # the spans still batched go out (a thread: it posts them)
            await asyncio.to_thread(self.tracing.shutdown)


class _KnownLimits:
    """The workers' limits as this process's view knows them (``orchestrator.validation``)."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch

    def max_model_len(self) -> int | None:
        return surface.max_model_len(self.orch)

    def vocab_size(self) -> int | None:
        return surface.vocab_size(self.orch)


def _tracing(config: OrchestratorConfig) -> Tracing | None:
    """This process's tracer, None (nothing imported) while ``tracing.otlp_endpoint`` is unset."""
    settings = config.tracing
    if settings.otlp_endpoint is None:
        return None
    from api.tracing import Tracing

    return Tracing(settings.otlp_endpoint, f"{settings.service_name}-orchestrator", {"disagg.role": "orchestrator"},
                   settings.sample_ratio)


def error_parts(exc: BaseException, anthropic: bool) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) of the error a route answers ``exc`` with, in the API's shape;
    a worker's own 4xx (``UpstreamRejected``) as the worker wrote it."""
    if isinstance(exc, UpstreamRejected):
        return exc.status, exc.body, {}
    error = http_error(exc)
    body = anthropic_error_body(error) if anthropic else openai_error_body(error)
    return error.status_for(anthropic), body, error.headers()


def _error(exc: BaseException, anthropic: bool) -> Response:
    status, body, headers = error_parts(exc, anthropic)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


def worker_key_headers(config: OrchestratorConfig) -> dict[str, str]:
    """The header that presents the deployment's worker key to a worker (none without one)."""
    if config.worker_key_file is None:
        return {}
    return bearer_header(read_key_file(config.worker_key_file))


Handler = Callable[[Orchestrator, Request], Awaitable[Response]]


def _endpoint(handler: Handler, anthropic: bool = False,
              protected: bool = True) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        orch: Orchestrator = request.app.state.orchestrator
        try:
            key = orch.api_key
            if protected and key is not None and not key.accepts_headers(request.scope["headers"]):
                raise key.refusal("a valid API key")
            return await handler(orch, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:  # always the API's error shape
            if not isinstance(exc, UpstreamRejected) and http_error(exc).status == 500:
                log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
            return _error(exc, anthropic)

    return endpoint


def _generate(api: str) -> Handler:
    async def handler(orch: Orchestrator, request: Request) -> Response:
        headers = request.headers
        answer = await orch.generate(api, request.body, headers.get("x-request-id"), headers.get("x-session-id"),
                                     disconnect_watch(request.receive), headers.get("traceparent"))
        return to_response(answer)

    return handler


async def _health(orch: Orchestrator, request: Request) -> Response:
    missing = [phase for phase in Phase if not orch.view.has_healthy(phase)]
    if missing:
        raise NoWorkerError(f"no healthy {' or '.join(missing)} worker yet")
    # Which process answered: `disagg up` waits until every one of them has (orchestrator.readiness).
    return _json({"status": "ok", "process_index": orch.process_index, "processes": orch.config.processes})


async def _cluster_info(orch: Orchestrator, request: Request) -> Response:
    view = orch.view
    workers = []
    for worker in sorted(view.workers.values(), key=lambda w: w.worker_id):
        requests, tokens = view.load(worker.worker_id)
        workers.append({**msgspec.to_builtins(worker), "in_flight_requests": requests, "in_flight_tokens": tokens,
                        "num_cached_blocks": len(view.kv.blocks.get(worker.worker_id, ()))})
    config = orch.config
    return _json({"model": config.model_name, "process_index": orch.process_index, "processes": config.processes,
                  "state_version": view.version, "ctx_router": msgspec.to_builtins(config.ctx_router.__dict__),
                  "gen_router": msgspec.to_builtins(config.gen_router.__dict__),
                  "conditional": msgspec.to_builtins(config.conditional.__dict__), "workers": workers})


async def _prometheus(orch: Orchestrator, request: Request) -> Response:
    workers = [(w.worker_id, w.url, w.role, w.healthy, w.degraded)
               for w in sorted(orch.view.workers.values(), key=lambda w: w.worker_id)]
    return Response(orch.metrics.render(workers), media_type=CONTENT_TYPE)


async def _perf(orch: Orchestrator, request: Request) -> Response:
    await orch.link.flush_perf()
    response = await orch.link.forward("GET", "/perf", b"")
    return Response(response.content, status_code=response.status_code, media_type="application/json")


def _forward(path: str) -> Handler:
    async def handler(orch: Orchestrator, request: Request) -> Response:
        body = await request.body() if request.method == "POST" else b""
        try:
            msgspec.json.decode(body) if body else None
        except msgspec.DecodeError as exc:
            raise InvalidRequestError(f"malformed JSON body: {exc}") from None
        response = await orch.link.forward(request.method, path, body)
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    return handler


def _drain(draining: bool) -> Handler:
    """POST /workers/drain and /workers/undrain ``{"worker": ID or URL}``: the state owner's /drain."""

    async def handler(orch: Orchestrator, request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=WorkerRef)
        except msgspec.DecodeError as exc:
            raise InvalidRequestError(f"invalid request body: {exc}", param="worker") from None
        forwarded = msgspec.json.encode(DrainRequest(worker=body.worker, draining=draining))
        response = await orch.link.forward("POST", "/drain", forwarded)
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    return handler


async def _settings(orch: Orchestrator, request: Request) -> Response:
    """GET /settings: the live settings; POST: new ones (``LiveSettings``'s keys, all optional) for
    every process, validated by the state owner (a bad key is a 400 naming it)."""
    body = await request.body() if request.method == "POST" else b""
    response = await orch.link.forward(request.method, "/settings", body)
    return Response(response.content, status_code=response.status_code, media_type="application/json")


async def _workers(orch: Orchestrator, request: Request) -> Response:
    return _json({"workers": msgspec.to_builtins(sorted(orch.view.workers.values(), key=lambda w: w.worker_id))})


async def _http_exception(request: Request, exc: Exception) -> Response:
    # Starlette's router raises these for unknown paths (404) and methods (405, with Allow).
    return route_error_response(request, exc)


def build_app(orch: Orchestrator) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await orch.start()
        try:
            yield
        finally:
            await orch.close()

    routes = [
        Route("/v1/completions", _endpoint(_generate("completions")), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(_generate("chat")), methods=["POST"]),
        Route("/v1/messages", _endpoint(_generate("messages"), anthropic=True), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint(surface.count_tokens, anthropic=True), methods=["POST"]),
        Route("/v1/messages/batches", _endpoint(batch_forward, anthropic=True), methods=["GET", "POST"]),
        Route("/v1/messages/batches/{rest:path}", _endpoint(batch_forward, anthropic=True),
              methods=["GET", "POST", "DELETE"]),
        # The OpenAI Files and Batches, owned by the leader like the Message Batches (orchestrator.openai_batches).
        Route("/v1/files", _endpoint(batch_forward), methods=["GET", "POST"]),
        Route("/v1/files/{rest:path}", _endpoint(batch_forward), methods=["GET", "DELETE"]),
        Route("/v1/batches", _endpoint(batch_forward), methods=["GET", "POST"]),
        Route("/v1/batches/{rest:path}", _endpoint(batch_forward), methods=["GET", "POST"]),
        Route("/v1/models", _endpoint(surface.list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _endpoint(surface.retrieve_model_route), methods=["GET"]),
        Route("/tokenize", _endpoint(surface.tokenize_route), methods=["POST"]),
        Route("/detokenize", _endpoint(surface.detokenize_route), methods=["POST"]),
        Route("/version", _endpoint(surface.version), methods=["GET"]),
        Route("/v1/responses", _endpoint(responses.create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", _endpoint(responses.retrieve_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", _endpoint(responses.delete_response), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", _endpoint(responses.list_input_items), methods=["GET"]),
        Route("/health", _endpoint(_health, protected=False), methods=["GET"]),
        Route("/cluster_info", _endpoint(_cluster_info), methods=["GET"]),
        Route("/prometheus/metrics", _endpoint(_prometheus), methods=["GET"]),
        # The same text where scrapers look by default (a ServiceMonitor, aiperf). A worker's /metrics
        # stays its engine's iteration stats (JSON, drained by routers).
        Route("/metrics", _endpoint(_prometheus), methods=["GET"]),
        Route("/perf_metrics", _endpoint(_perf), methods=["GET"]),
        Route("/workers", _endpoint(_workers), methods=["GET"]),
        Route("/workers/register", _endpoint(_forward("/register")), methods=["POST"]),
        Route("/workers/heartbeat", _endpoint(_forward("/heartbeat")), methods=["POST"]),
        Route("/workers/deregister", _endpoint(_forward("/deregister")), methods=["POST"]),
        Route("/settings", _endpoint(_settings), methods=["GET", "POST"]),
        Route("/workers/drain", _endpoint(_drain(True)), methods=["POST"]),
        Route("/workers/undrain", _endpoint(_drain(False)), methods=["POST"]),
    ]
    app = DocumentedApp(ORCHESTRATOR_DOCS, title="disagg orchestrator", version=surface.VERSION,
                        description=DESCRIPTION, open_paths=OPEN_PATHS if orch.config.api_key else None,
                        routes=routes, exception_handlers={HTTPException: _http_exception}, lifespan=lifespan,
                        middleware=[Middleware(CleanEndsMiddleware),  # outermost: it sees every end
                                    Middleware(AdmissionMiddleware, gate=orch.admission),
                                    Middleware(BodyLimitMiddleware, max_bytes=orch.config.max_request_bytes,
                                               path_limits={"/v1/files": (orch.config.max_upload_bytes,
                                                                          "max_upload_bytes")})])
    app.state.orchestrator = orch
    return app
