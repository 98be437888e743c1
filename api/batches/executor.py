"""What runs one batch request: the ``BatchExecutor`` interface and the worker's own.

A ``BatchRunner`` (``api.batches.runner``) owns the store and the
dispatch policy; an executor only turns one request's ``params`` into its
result. The launcher's is ``EngineBatchExecutor`` (its own engine, the path of
``POST /v1/messages``); the orchestrator's runs each request through its
two-phase flow (``orchestrator.batches``).
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec

from api.anthropic_api import generate_message
from api.errors import EngineDeadError, InvalidRequestError, anthropic_error_body, http_error
from api.schemas_anthropic import MessagesRequest
from api.serving import ServingContext

__all__ = ["BatchExecutor", "EngineBatchExecutor", "Outcome", "errored", "errored_by", "succeeded", "batch_body"]

logger = logging.getLogger(__name__)

Outcome = tuple[str, bytes]
"""(final request state, the result JSON exactly as a results line carries it)."""


class BatchExecutor(Protocol):
    def is_ready(self) -> bool:
        """Whether a request could run now (the runner waits, starting nothing, while not)."""
        ...

    async def execute(self, params: bytes, request_id: str) -> Outcome | None:
        """One request's outcome; None leaves it pending, to run again after a restart.
        ``request_id``: the runner's ``<batch id>[<index>]``, the x-request-id of its perf records."""
        ...


def succeeded(message: bytes) -> Outcome:
    return "succeeded", b'{"type":"succeeded","message":' + message + b"}"


def errored(error_body: bytes) -> Outcome:
    """``error_body``: an Anthropic error body (``{"type": "error", "error": {...}}``)."""
    return "errored", b'{"type":"errored","error":' + error_body + b"}"


def errored_by(exc: BaseException) -> Outcome:
    error = http_error(exc)
    if error.status >= 500:
        logger.error("batch request failed", exc_info=exc)
    return errored(anthropic_error_body(error))


def batch_body(params: bytes) -> MessagesRequest:
    """A request's params as a /v1/messages body (raises the 400 that route would answer)."""
    body = msgspec.json.decode(params, type=MessagesRequest)
    if body.stream:
        raise InvalidRequestError("stream: batch requests cannot stream", param="stream")
    return body


class EngineBatchExecutor:
    """The launcher's: this worker's engine, through the same path as ``POST /v1/messages``."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def is_ready(self) -> bool:
        return self.ctx.client.is_healthy

    async def execute(self, params: bytes, request_id: str) -> Outcome | None:
        try:
            message = await generate_message(self.ctx, batch_body(params), request_id)
        except EngineDeadError:
            logger.warning("batch request left pending: the engine is not running")
            return None
        except Exception as exc:  # noqa: BLE001 - every failure is this request's errored result
            return errored_by(exc)
        return succeeded(message)
