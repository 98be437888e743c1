"""OpenTelemetry spans of a request, exported over OTLP/HTTP; off unless a collector is configured.

One trace per request across processes: the client's W3C ``traceparent``
(if it sent one) is the parent of the orchestrator's ``request`` span, each
leg the orchestrator sends to a worker is a ``ctx_leg`` / ``gen_leg`` span
whose id goes out in the leg's ``traceparent`` header, and the worker's
``worker.request`` span hangs under it, with the engine's phases below
(``engine.queue``, ``engine.kv_transfer``, ``engine.prefill``,
``engine.decode``). The engine process runs no OpenTelemetry: a worker's
spans are drawn after the request ends from its perf record
(``frontends.perf_records``), whose times the engine already reports.

Off (no endpoint), nothing here is imported by anyone: the apps hold
``tracing = None`` and the request path tests that, so no span is made and
the SDK never loads. On, spans are batched and exported by the SDK's
background thread (``BatchSpanProcessor``; ``OTEL_BSP_SCHEDULE_DELAY`` sets
its delay, 5 s by default) and flushed at exit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from workers.protocol import PerfRecord

__all__ = ["Tracing", "traceparent_of", "nanos", "require_sdk", "EXTRA_HINT"]

TRACES_PATH = "/v1/traces"
EXPORT_TIMEOUT_SECONDS = 3.0  # a collector that is down delays a process's shutdown this long, not the SDK's 10 s


EXTRA_HINT = "tracing needs the OpenTelemetry SDK and OTLP exporter: pip install 'disagg[tracing]'"


def require_sdk(key: str) -> None:
    """A ConfigError naming ``key`` (the setting that turns tracing on) when the packages are missing:
    said when the deployment is checked, not as an ImportError in every process it starts."""
    import importlib.util

    from common.config_errors import ConfigError

    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ModuleNotFoundError, ValueError):  # a parent package is missing
            found = False
        if not found:
            raise ConfigError(key, EXTRA_HINT)


def nanos(seconds: float) -> int:
    """OpenTelemetry's timestamps: integer nanoseconds of ``time.time()``."""
    return int(seconds * 1e9)


def traceparent_of(span: Span) -> str:
    """The W3C ``traceparent`` header naming ``span`` as the parent."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class Tracing:
    """This process's tracer: ``service_name`` as ``service.name``, spans to ``endpoint``/v1/traces."""

    def __init__(self, endpoint: str, service_name: str, attributes: dict[str, str] | None = None,
                 sample_ratio: float = 1.0) -> None:
        """``sample_ratio``: of the traces this process starts (no sampled parent); a remote parent's
        sampled flag decides for its children (a worker follows the orchestrator's choice)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name, **(attributes or {})}),
                                        sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        exporter = OTLPSpanExporter(endpoint.rstrip("/") + TRACES_PATH, timeout=EXPORT_TIMEOUT_SECONDS)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("disagg")
        self._propagator = TraceContextTextMapPropagator()
        self._set_span = _set_span_in_context()
        self.SERVER, self.CLIENT, self.INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
        self._status, self._code = Status, StatusCode

    def remote_parent(self, traceparent: str | None) -> Context | None:
        """The context a ``traceparent`` header names (None: none or malformed: a new trace)."""
        if not traceparent:
            return None
        return self._propagator.extract({"traceparent": traceparent}) or None

    def start(self, name: str, start: float, parent: Context | Span | None = None, kind: Any = None,
              attributes: dict[str, Any] | None = None) -> Span:
        """A span from ``start`` (``time.time()``); ``parent``: a remote context or a span of ours."""
        context = parent if parent is None or isinstance(parent, dict) else self._set_span(parent)  # Context: a dict
        return self._tracer.start_span(name, context=context, kind=kind if kind is not None else self.INTERNAL,
                                       attributes=_clean(attributes), start_time=nanos(start))

    def span(self, name: str, start: float, end: float, parent: Context | Span | None, kind: Any = None,
             attributes: dict[str, Any] | None = None, error: str | None = None) -> Span:
        """A span already over: ``start`` to ``end``."""
        span = self.start(name, start, parent, kind, attributes)
        self.finish(span, end, error)
        return span

    def finish(self, span: Span, end: float, error: str | None = None) -> None:
        if error is not None:
            span.set_status(self._status(self._code.ERROR, error[:200]))
        span.end(end_time=nanos(max(end, 0.0)))

    def worker_spans(self, record: PerfRecord, traceparent: str, role: str) -> None:
        """A worker frontend's request, drawn from its perf record once it ended: ``worker.request``
        under the orchestrator's leg, its tokenizing and the engine's phases below it."""
        parent = self.remote_parent(traceparent)
        root = self.start("worker.request", record.frontend_arrival, parent, self.SERVER, {
            "disagg.role": role, "disagg.x_request_id": record.x_request_id,
            "disagg.engine_request_id": str(record.request_id), "disagg.prompt_tokens": record.num_prompt_tokens,
            "disagg.output_tokens": record.num_output_tokens, "disagg.cached_tokens": record.num_cached_tokens,
            "disagg.finish_reason": record.finish_reason,
            "disagg.kv_recomputed": record.kv_recomputed or None})  # the pull failed: prefilled here
        self.span("frontend.prepare", record.frontend_arrival, record.tokenized, root)
        arrival, scheduled, first = record.engine_arrival, record.first_scheduled, record.first_token
        if arrival is not None and record.kv_transfer_seconds is not None:
            # "From the pull request sent to the last block imported": the engine pulls on arrival.
            self.span("engine.kv_transfer", arrival, arrival + record.kv_transfer_seconds, root,
                      attributes={"disagg.kv_bytes": record.kv_transfer_bytes,
                                  "disagg.kv_blocks": record.kv_transfer_blocks})
        if arrival is not None and scheduled is not None:
            self.span("engine.queue", arrival, scheduled, root)
        if scheduled is not None and first is not None:
            self.span("engine.prefill", scheduled, first, root)
        last = record.last_token
        if first is not None and last is not None and last > first and record.num_output_tokens > 1:
            self.span("engine.decode", first, last, root, attributes={"disagg.output_tokens": record.num_output_tokens})
        self.finish(root, record.finished, None if record.finish_reason != "abort" else "aborted")

    def shutdown(self) -> None:
        """Export what is left (at exit)."""
        self._provider.shutdown()


def _set_span_in_context() -> Callable[..., Any]:
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context


def _clean(attributes: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenTelemetry refuses None values (with a warning a span): left out."""
    if not attributes:
        return None
    return {key: value for key, value in attributes.items() if value is not None}
