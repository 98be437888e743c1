"""The two apps of a worker's frontends: the launcher's and an attached frontend's.

Both are ``frontends.app.build_app`` with the same API routes; they differ in
who answers the launcher-owned routes (``api.route_table``):

- the launcher (frontend 0) mounts their handlers (``launcher_routes``, the
  Anthropic Message Batches routes, ``api.batches``, and the stored
  responses' admin routes, ``api.responses``), keeps the perf
  store (its own records go straight in, attached frontends' arrive on
  perf.sock) and writes the engine gauges;
- an attached frontend mounts forwarders to the launcher's admin socket
  before everything else, and ships its perf records to the launcher.

Every frontend serves ``/prometheus/metrics`` itself and counts its own
requests; ``disagg serve`` builds these apps through ``make_launcher_app`` /
``make_attached_app``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from api.admission import QueueBound
from api.batches import BATCHES_FILE, BatchRunner, BatchStore, EngineBatchExecutor, batch_routes
from api.responses import RESPONSES_FILE, LauncherResponses, LocalResponses, ResponseStore, admin_routes
from api.route_table import LAUNCHER_PREFIXES, LAUNCHER_ROUTES
from api.serving import FrontendConfig, ServingContext
from api.tokenizer import Tokenizer
from frontends.admin_forwarder import FORWARDED_BY_HEADER, LauncherForwarder
from frontends.app import build_app
from frontends.engine_client import EngineClient
from frontends.launcher_routes import Control, LauncherState, launcher_routes
from frontends.perf_records import PerfReceiver, PerfRecorder, PerfSender, PerfStore
from frontends.prometheus import CONTENT_TYPE, FrontendMetrics, LauncherMetrics
from workers.attach import AttachInfo
from workers.protocol import PerfRecord

if TYPE_CHECKING:
    from api.tracing import Tracing

__all__ = ["make_launcher_app", "make_attached_app", "ForwardedCounter"]

log = logging.getLogger("disagg.worker_app")


class ForwardedCounter:
    """Counts (in Prometheus) every request an attached frontend replayed to the launcher."""

    def __init__(self, app: ASGIApp, metrics: LauncherMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self.header = FORWARDED_BY_HEADER.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = self.header
            for key, _ in scope["headers"]:  # a plain loop: this runs on every request
                if key == header:
                    self._count(scope["path"])
                    break
        await self.app(scope, receive, send)

    def _count(self, path: str) -> None:
        route = path if path in LAUNCHER_ROUTES else next(
            (p + "*" for p in LAUNCHER_PREFIXES if path.startswith(p)), "other")
        self.metrics.forwarded.labels(route).inc()


def _prometheus_route(metrics: FrontendMetrics, before: Callable[[], Any] | None = None) -> Route:
    async def scrape(request: Request) -> Response:
        if before is not None:
            await before()
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return Route("/prometheus/metrics", scrape, methods=["GET"])


def _safe(observe: Callable[[Any], None]) -> Callable[[Any], None]:
    """Metrics must never fail a request (e.g. the group is being torn down around us)."""

    def call(record: Any) -> None:
        try:
            observe(record)
        except Exception as exc:  # noqa: BLE001 - metrics are best effort: never fail the request's bookkeeping
            log.warning("could not record request metrics: %s", exc)

    return call


def _observer(metrics: FrontendMetrics, client: EngineClient) -> Callable[[PerfRecord], None]:
    """Each ended request into the metrics (batched), written at once when it was the last one in
    flight: a lone request is in the next scrape of any frontend, a busy one's within FLUSH_SECONDS."""

    def observe(record: PerfRecord) -> None:
        metrics.observe(record)
        if client.num_in_flight == 0:
            metrics.flush()

    return _safe(observe)


def _tracing(client: EngineClient, config: FrontendConfig) -> Tracing | None:
    """With an OTLP endpoint: this frontend's tracer, drawing the spans of each request that came with a
    ``traceparent`` once it ends (``EngineClient.on_traced_request``). None (nothing imported): off."""
    if config.otlp_endpoint is None:
        return None
    from api.tracing import Tracing

    tracing = Tracing(config.otlp_endpoint, config.trace_service_name,
                      {"disagg.role": config.role, "disagg.frontend_id": str(config.frontend_id)})
    role = config.role

    def spans(record: PerfRecord, traceparent: str) -> None:
        try:
            tracing.worker_spans(record, traceparent, role)
        except Exception as exc:  # noqa: BLE001 - tracing is best effort: never fail the request's bookkeeping
            log.warning("could not record a request's spans: %s", exc)

    client.on_traced_request = spans
    return tracing


def _queue_bound(config: FrontendConfig, metrics: FrontendMetrics) -> QueueBound:
    return QueueBound(config.max_queued_requests, config.max_queued_prompt_tokens, "this worker",
                      metrics.count_refused)


def make_launcher_app(client: EngineClient, tokenizer: Tokenizer, config: FrontendConfig, attach: AttachInfo,
                      control: Control, config_labels: dict[str, str], state_dir: Path) -> ASGIApp:
    """Frontend 0's app. ``control``: ``WorkerGroup.control``. ``state_dir``: where the
    launcher keeps state that outlives it (the Message Batches database)."""
    metrics = FrontendMetrics(tokenizer.piece_cache, process="launcher")
    metrics.process.watch("engine", attach.engine_pid)  # the engine exports nothing itself
    launcher_metrics = LauncherMetrics(metrics.registry, config_labels)
    store = PerfStore(config.max_perf_records, config.perf_record_seconds)
    recorder = PerfRecorder(store.extend, _observer(metrics, client))
    client.on_request_done = recorder.add
    client.queue = _queue_bound(config, metrics)
    tracing = _tracing(client, config)
    state = LauncherState(control, store, launcher_metrics, recorder, attach.engine.kind)
    # Opened here, before serving: a second worker on the same state dir fails at start-up.
    batches = BatchRunner(BatchStore(state_dir / BATCHES_FILE),
                          EngineBatchExecutor(ServingContext(client, tokenizer, config)))
    responses = LocalResponses(ResponseStore(state_dir / RESPONSES_FILE))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        receiver = PerfReceiver(attach.paths.perf, attach.key, store)
        receiver.start()
        metrics.process.start()
        gauges = asyncio.create_task(state.refresh_gauges_forever(), name="engine-gauges")
        try:
            async with batches:
                yield
        finally:
            gauges.cancel()
            await asyncio.gather(gauges, return_exceptions=True)
            await receiver.close()
            responses.store.close()
            metrics.flush()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)

    app = build_app(client, tokenizer, config, lifespan=lifespan,
                    prefix_routes=[*launcher_routes(state), *batch_routes(batches), *admin_routes(responses)],
                    extra_routes=[_prometheus_route(metrics, state.refresh_gauges)], responses_store=responses,
                    on_refused=metrics.count_refused)
    app.state.launcher = state
    app.state.serving.frontends_down_file = attach.paths.frontends_down
    return ForwardedCounter(app, launcher_metrics)


def make_attached_app(client: EngineClient, tokenizer: Tokenizer, config: FrontendConfig, attach: AttachInfo,
                      *, admin_timeout: float = 30.0) -> Starlette:
    """An attached frontend's app: launcher-owned routes forwarded, perf records shipped."""
    metrics = FrontendMetrics(tokenizer.piece_cache)
    forwarder = LauncherForwarder(str(attach.paths.launcher_admin), attach.frontend_id, read_timeout=admin_timeout)
    sender = PerfSender(attach.paths.perf, attach.key, attach.frontend_id)
    recorder = PerfRecorder(sender.send, _observer(metrics, client))
    client.on_request_done = recorder.add
    client.queue = _queue_bound(config, metrics)
    tracing = _tracing(client, config)
    responses = LauncherResponses(str(attach.paths.launcher_admin), timeout=admin_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sender.open()
        metrics.process.start()
        try:
            yield
        finally:
            recorder.flush()
            metrics.flush()
            sender.close()
            await forwarder.aclose()
            await responses.aclose()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)

    app = build_app(client, tokenizer, config, lifespan=lifespan, prefix_routes=forwarder.routes(),
                    extra_routes=[_prometheus_route(metrics)], responses_store=responses,
                    on_refused=metrics.count_refused)
    app.state.forwarder = forwarder
    app.state.serving.frontends_down_file = attach.paths.frontends_down
    return app
