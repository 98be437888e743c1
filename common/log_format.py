"""Log lines as text or JSON, each naming the request it belongs to.

Every process of a deployment (orchestrator, launcher, attached frontends,
engine, TP ranks) sets its logging up with ``configure_logging`` and one
``log_format``: ``text`` (the default, for a terminal) or ``json`` (one
object a line, for a log shipper). A request's id lives in ``REQUEST_ID``, a
context variable set where the request enters a process (the orchestrator's
``Orchestrator.generate``, a worker frontend's ``api.request_context``).
asyncio copies the context into every task a request's task starts, so the
id follows the request and nothing else; a filter on the handler copies it
onto each record as it is written, so a request costs one ``ContextVar.set``
and a line nobody writes costs nothing.

A line with fields of its own (the access log) passes them as
``extra={"fields": {...}}``: JSON puts them at the top level, text appends
them as ``key=value``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from enum import StrEnum
from types import TracebackType
from typing import Any

__all__ = ["LogFormat", "LOG_FORMATS", "REQUEST_ID", "configure_logging", "JsonFormatter", "TextFormatter",
           "RequestIdFilter", "PollFilter", "POLL_PATHS", "POLL_LOGGER", "stdout_line"]


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


LOG_FORMATS = tuple(f.value for f in LogFormat)

REQUEST_ID: ContextVar[str | None] = ContextVar("disagg_request_id", default=None)
"""The id of the request the running task serves (its x-request-id), None outside one."""


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` from ``REQUEST_ID`` unless the line named one itself (``extra``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """``fmt`` (the process's own), then ``request=ID`` and any ``fields`` as ``key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tail = []
        request_id = getattr(record, "request_id", None)
        fields = getattr(record, "fields", None)
        if request_id is not None and not (fields and "request_id" in fields):
            tail.append(f"request={request_id}")
        if fields:
            tail += [f"{key}={'-' if value is None else value}" for key, value in fields.items()]
        if not tail:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below the line it belongs to
        return f"{head} {' '.join(tail)}{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (ISO 8601, UTC, ms), ``level``, ``logger``, ``process``
    (the role), ``pid``, ``msg``, ``request_id`` when in a request, ``exc`` with a traceback, and
    the line's ``fields``."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "process": self.role, "pid": record.process,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        fields = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


POLL_PATHS = frozenset({"/health", "/metrics", "/prometheus/metrics", "/perf_metrics", "/worker_info",
                        "/kv_cache_events", "/kv_cache_snapshot", "/cluster_info", "/version"})
"""What health checkers, the orchestrator and Prometheus poll, every second or so: no client's request."""
POLL_LOGGER = "disagg.access.polls"


class PollFilter(logging.Filter):
    """On uvicorn's access log: a line of a poll (``POLL_PATHS``) goes to ``POLL_LOGGER`` at DEBUG
    instead, so that the access log holds clients' requests, not a line a second per prober."""

    def __init__(self) -> None:
        super().__init__()
        self.polls = logging.getLogger(POLL_LOGGER)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's: (client, method, path with query, HTTP version, status)
        if not isinstance(args, tuple) or len(args) != 5 or not isinstance(args[2], str):
            return True
        if args[2].partition("?")[0] not in POLL_PATHS:
            return True
        if self.polls.isEnabledFor(logging.DEBUG):
            self.polls.debug(record.msg, *args)
        return False


def _json_everywhere() -> None:
    """What reaches stderr outside logging (an uncaught exception's traceback, in the main thread or
    another; a Python warning) goes through it too, so a JSON log holds nothing but JSON."""
    import threading

    crashes = logging.getLogger("disagg.uncaught")

    def excepthook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        crashes.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, traceback))

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not SystemExit:
            crashes.critical("uncaught %s in thread %s: %s", args.exc_type.__name__,
                             args.thread.name if args.thread else "?", args.exc_value,
                             exc_info=args.exc_value)  # its type and traceback with it

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    logging.captureWarnings(True)


def stdout_line(message: str, log_format: str, role: str) -> str:
    """A line for stdout (the ready line tools wait for): ``message`` itself in text, a JSON object
    whose ``msg`` it is in json, so that a JSON log holds nothing but JSON."""
    if LogFormat(log_format) is LogFormat.TEXT:
        return message
    record = logging.LogRecord("disagg", logging.INFO, __file__, 0, message, None, None)
    return JsonFormatter(role).format(record)


def configure_logging(level: str, log_format: str, role: str, text_format: str | None = None) -> None:
    """The root logger of this process: ``level`` (debug, info, ...), one stderr handler in
    ``log_format`` (``text``: ``text_format``, by default time, role[pid], level, logger, message)."""
    handler = logging.StreamHandler(sys.stderr)
    if LogFormat(log_format) is LogFormat.JSON:
        handler.setFormatter(JsonFormatter(role))
        _json_everywhere()
    else:
        handler.setFormatter(TextFormatter(
            text_format or f"%(asctime)s {role}[%(process)d] %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, PollFilter) for f in access.filters):
        access.addFilter(PollFilter())
