"""What happens when a client's request ends at the orchestrator: its perf record is queued for
the state owner, its access-log line written (``access_log``), its spans ended (``tracing``).

Every end goes through ``RequestEnds.end``: an answer (``Flow.finish``: a JSON answer written, a
relayed stream closed) and a failure (``Orchestrator.generate``, ``create_response``), so the
access log has exactly one line per client request, with the status the client got. Health and
metrics polls never get one (uvicorn's own lines for them go to DEBUG, ``common.log_format``); a
request refused before it reached the flow (429 at the admission gate, 401) has uvicorn's line.

The access line, on the ``disagg.access`` logger (its fields top-level in JSON):
``POST /v1/chat/completions 200 41.3ms`` then ``method``, ``path``, ``request_id``, ``status``,
``latency_ms``, ``mode``, ``ctx_worker``, ``gen_worker``, ``prompt_tokens``, ``completion_tokens``,
``retries`` and ``error``. The orchestrator relays a stream's bytes without decoding them: its
completion tokens are read from the last events, where a usage is when the client asked for one
(OpenAI's ``stream_options.include_usage``; Anthropic's always); else ``completion_tokens`` is
None and the gen worker's perf record has them. Only read while the access log or tracing is on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from common.log_format import REQUEST_ID

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from api.tracing import Tracing
    from orchestrator.state_protocol import RequestTrace
    from orchestrator.view import StateLink

__all__ = ["RequestEnds", "RequestSpans", "API_PATHS", "ACCESS_LOGGER", "not_a_client_request"]

ACCESS_LOGGER = "disagg.access"
API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages",
             "responses": "/v1/responses"}

access_log = logging.getLogger(ACCESS_LOGGER)


def not_a_client_request(record: logging.LogRecord) -> bool:
    """A filter for uvicorn's access log: a generation request that reached the flow (its id is set in
    the task's context, ``Orchestrator.generate``) has its own line here, with more in it; one refused
    before (429 at the admission gate, 401) keeps uvicorn's."""
    args = record.args  # uvicorn's: (client, method, path with query, HTTP version, status)
    return not (isinstance(args, tuple) and len(args) == 5 and args[2] in _CLIENT_PATHS
                and REQUEST_ID.get() is not None)


_CLIENT_PATHS = frozenset(API_PATHS.values())


class RequestSpans:
    """One request's open spans at the orchestrator: its root, and the gen leg a stream keeps open."""

    __slots__ = ("root", "gen_leg")

    def __init__(self, root: Span) -> None:
        self.root = root
        self.gen_leg: Span | None = None


class RequestEnds:
    """``access_log``: write the line; ``tracing``: None when off (then no span exists)."""

    def __init__(self, link: StateLink, access_log: bool, tracing: Tracing | None) -> None:
        self.link = link
        self.access_log = access_log
        self.tracing = tracing
        self._spans: dict[int, RequestSpans] = {}  # by id(record): open while the request runs

    # -- tracing ------------------------------------------------------------------------------

    def begin(self, record: RequestTrace, traceparent: str | None) -> None:
        """The request's root span, under the client's ``traceparent`` when it sent one."""
        tracing = self.tracing
        if tracing is None:
            return
        root = tracing.start("request", record.arrival, tracing.remote_parent(traceparent), tracing.SERVER,
                             {"disagg.request_id": record.request_id, "disagg.api": record.api})
        if root.is_recording():  # not sampled: no more spans, and the legs go without a traceparent
            self._spans[id(record)] = RequestSpans(root)

    def open_leg(self, record: RequestTrace, phase: str, worker_id: str, start: float,
                 headers: dict[str, str]) -> Span | None:
        """A ``ctx_leg`` / ``gen_leg`` span under the request's root, named in the leg's ``headers``
        as its ``traceparent``; None while tracing is off."""
        tracing = self.tracing
        if tracing is None:  # off: the hot path's whole cost here
            return None
        spans = self._spans.get(id(record))
        if spans is None:
            return None
        from api.tracing import traceparent_of

        span = tracing.start(f"{phase}_leg", start, spans.root, tracing.CLIENT,
                             {"disagg.worker": worker_id, "disagg.x_request_id": headers.get("x-request-id")})
        headers["traceparent"] = traceparent_of(span)
        return span

    def close_leg(self, span: Span, end: float, error: BaseException | None = None) -> None:
        if self.tracing is not None:
            self.tracing.finish(span, end, None if error is None else f"{type(error).__name__}: {error}")

    def keep_gen_leg(self, record: RequestTrace, span: Span) -> None:
        """A streamed gen leg's span: open until the relay ends the request."""
        spans = self._spans.get(id(record))
        if spans is not None:
            spans.gen_leg = span

    # -- the end ------------------------------------------------------------------------------

    def end(self, record: RequestTrace, status: int, answer_tail: bytes = b"") -> None:
        """``answer_tail``: a JSON answer, or the last bytes of a stream: its completion tokens when
        they hold the usage (a stream's only with OpenAI's ``include_usage``, or Anthropic's)."""
        self.link.perf_queue.append(record)
        if self.access_log or self.tracing is not None:  # the usage is read only for them
            fields = _fields(record, status, output_tokens(answer_tail))
            if self.access_log:
                _log_access(record, fields)
            if self.tracing is not None:
                self._end_spans(record, fields)

    def _end_spans(self, record: RequestTrace, fields: dict[str, Any]) -> None:
        spans = self._spans.pop(id(record), None)
        tracing = self.tracing
        if spans is None or tracing is None:
            return
        end = record.end or record.arrival
        if record.tokenized is not None:
            tracing.span("orchestrator.prepare", record.arrival, record.tokenized, spans.root)
        if spans.gen_leg is not None:
            gen = record.gen
            tracing.finish(spans.gen_leg, gen.end if gen is not None and gen.end is not None else end,
                           record.error if fields["status"] == 200 else None)
        root = spans.root
        for key, value in fields.items():
            if value is not None and key != "request_id":
                root.set_attribute(f"disagg.{key}", value)
        tracing.finish(root, end, record.error if record.error is not None else None)


def _fields(record: RequestTrace, status: int, completion_tokens: int | None) -> dict[str, Any]:
    end = record.end or record.arrival
    return {
        "method": "POST", "path": API_PATHS.get(record.api, record.api), "request_id": record.request_id,
        "status": status, "latency_ms": round((end - record.arrival) * 1000, 1), "mode": record.mode,
        "ctx_worker": record.ctx.worker_id if record.ctx is not None else None,
        "gen_worker": record.gen.worker_id if record.gen is not None else None,
        "prompt_tokens": record.num_prompt_tokens, "completion_tokens": completion_tokens,
        "retries": record.retries, "error": record.error,
    }


def _log_access(record: RequestTrace, fields: dict[str, Any]) -> None:
    access_log.info("POST %s %d %.1fms", fields["path"], fields["status"], fields["latency_ms"],
                    extra={"fields": fields, "request_id": record.request_id})


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None  # OpenAI
    output_tokens: int | None = None  # Anthropic


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)


def output_tokens(tail: bytes) -> int | None:
    """The completion tokens of the last usage in ``tail``: a JSON answer, or SSE events whose last
    ``data:`` with a usage has them (None: no usage there)."""
    if b'"usage"' not in tail:
        return None
    pieces = [tail] if tail.lstrip().startswith(b"{") else [
        line[5:] for line in tail.split(b"\n") if line.startswith(b"data:") and b'"usage"' in line]
    for piece in reversed(pieces):
        try:
            usage = _usage_decoder.decode(piece).usage
        except msgspec.DecodeError:
            continue
        if usage is not None:
            count = usage.completion_tokens if usage.completion_tokens is not None else usage.output_tokens
            if count is not None:
                return count
    return None
