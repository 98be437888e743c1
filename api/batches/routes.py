"""HTTP handlers of the Message Batches API (the launcher serves them; attached
frontends forward ``/v1/messages/batches*`` to it verbatim).

    POST   /v1/messages/batches                 create          -> message_batch
    GET    /v1/messages/batches                 list            -> {data, has_more, first_id, last_id}
    GET    /v1/messages/batches/{id}            retrieve        -> message_batch
    GET    /v1/messages/batches/{id}/results    results (JSONL, once ended)
    POST   /v1/messages/batches/{id}/cancel     cancel          -> message_batch
    DELETE /v1/messages/batches/{id}            delete (ended)  -> message_batch_deleted

Errors have the Anthropic shape. At create time only the envelope is
validated (400 naming the index: a missing or duplicate ``custom_id``, a
``params`` that is not an object); ``params`` themselves are validated when
they run (see ``api.batches.runner``). ``results_url`` is a path
relative to the server root, so it stays right behind any proxy (the
``anthropic`` client resolves it against its base URL).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from api.batches.runner import BatchRunner
from api.batches.schemas import BatchList, CreateBatchRequest, DeletedBatch, MessageBatch, rfc3339
from api.batches.store import BatchRecord
from api.errors import ApiError, InvalidRequestError, NotFoundError, anthropic_error_body, http_error

__all__ = ["batch_routes", "api_endpoint", "list_limit", "MAX_REQUESTS_PER_BATCH", "RESULTS_MEDIA_TYPE"]

logger = logging.getLogger(__name__)

MAX_REQUESTS_PER_BATCH = 100_000  # Anthropic's limit
MAX_LIST_LIMIT = 1000
DEFAULT_LIST_LIMIT = 20
RESULTS_MEDIA_TYPE = "application/x-jsonl"
RESULTS_PAGE = 1000  # result rows read from the store per chunk of the JSONL stream
_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # Anthropic's custom_id rule

Handler = Callable[[BatchRunner, Request], Awaitable[Response]]
T = TypeVar("T")


def _json(payload: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


def message_batch(record: BatchRecord) -> MessageBatch:
    results_url = f"/v1/messages/batches/{record.id}/results" if record.processing_status == "ended" else None
    return MessageBatch(
        id=record.id,
        processing_status=record.processing_status,
        request_counts=record.request_counts,
        created_at=rfc3339(record.created_at),
        expires_at=rfc3339(record.expires_at),
        ended_at=rfc3339(record.ended_at),
        cancel_initiated_at=rfc3339(record.cancel_initiated_at),
        archived_at=rfc3339(record.archived_at),
        results_url=results_url,
    )


def _batch_items(body: bytes) -> list[tuple[str, bytes]]:
    request = msgspec.json.decode(body, type=CreateBatchRequest)
    if not request.requests:
        raise InvalidRequestError("requests must not be empty", param="requests")
    if len(request.requests) > MAX_REQUESTS_PER_BATCH:
        raise InvalidRequestError(f"a batch holds at most {MAX_REQUESTS_PER_BATCH} requests, got "
                                  f"{len(request.requests)}", param="requests")
    seen: set[str] = set()
    items: list[tuple[str, bytes]] = []
    for idx, item in enumerate(request.requests):
        if not _CUSTOM_ID.match(item.custom_id):
            raise InvalidRequestError(f"requests[{idx}].custom_id must be 1 to 64 letters, digits, '-' or '_', "
                                      f"got {item.custom_id!r}", param=f"requests[{idx}].custom_id")
        if item.custom_id in seen:
            raise InvalidRequestError(f"requests[{idx}].custom_id {item.custom_id!r} is not unique in the batch",
                                      param=f"requests[{idx}].custom_id")
        seen.add(item.custom_id)
        params = bytes(item.params)
        if not params.lstrip().startswith(b"{"):
            raise InvalidRequestError(f"requests[{idx}].params must be an object", param=f"requests[{idx}].params")
        items.append((item.custom_id, params))
    return items


async def _create(runner: BatchRunner, request: Request) -> Response:
    items = _batch_items(await request.body())
    return _json(message_batch(await runner.create(items)))


async def _existing(runner: BatchRunner, batch_id: str) -> BatchRecord:
    record = await asyncio.to_thread(runner.store.get, batch_id)
    if record is None:
        raise NotFoundError(f"no message batch {batch_id!r}")
    return record


async def _retrieve(runner: BatchRunner, request: Request) -> Response:
    return _json(message_batch(await _existing(runner, request.path_params["batch_id"])))


def list_limit(request: Request, default: int = DEFAULT_LIST_LIMIT, most: int = MAX_LIST_LIMIT) -> int:
    """The ``limit`` query parameter of a list route (a 400 naming it when it is not 1 to ``most``)."""
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    try:
        limit = int(raw)
    except ValueError:
        raise InvalidRequestError(f"limit must be an integer, got {raw!r}", param="limit") from None
    if not 1 <= limit <= most:
        raise InvalidRequestError(f"limit must be between 1 and {most}, got {limit}", param="limit")
    return limit


async def _list(runner: BatchRunner, request: Request) -> Response:
    limit = list_limit(request)
    before_id = request.query_params.get("before_id")
    after_id = request.query_params.get("after_id")
    if before_id is not None and after_id is not None:
        raise InvalidRequestError("give before_id or after_id, not both", param="before_id")
    page = await asyncio.to_thread(runner.store.list, limit, before_id, after_id)
    if page is None:
        cursor = "before_id" if before_id is not None else "after_id"
        raise InvalidRequestError(f"{cursor}: no message batch {before_id or after_id!r}", param=cursor)
    records, has_more = page
    data = [message_batch(record) for record in records]
    first_id, last_id = (data[0].id, data[-1].id) if data else (None, None)
    return _json(BatchList(data=data, has_more=has_more, first_id=first_id, last_id=last_id))


async def _results(runner: BatchRunner, request: Request) -> Response:
    record = await _existing(runner, request.path_params["batch_id"])
    if record.processing_status != "ended":
        raise InvalidRequestError(f"message batch {record.id!r} is still {record.processing_status}; its results "
                                  "are available once it has ended")
    return StreamingResponse(_result_lines(runner, record.id), media_type=RESULTS_MEDIA_TYPE)


async def _result_lines(runner: BatchRunner, batch_id: str) -> AsyncIterator[bytes]:
    after_idx: int | None = None
    while True:
        rows = await asyncio.to_thread(runner.store.results, batch_id, after_idx, RESULTS_PAGE)
        if not rows:
            return
        yield b"".join(b'{"custom_id":' + msgspec.json.encode(row.custom_id) + b',"result":' + row.result + b"}\n"
                       for row in rows)
        after_idx = rows[-1].idx


async def _cancel(runner: BatchRunner, request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    record = await runner.cancel(batch_id)
    if record is None:
        raise NotFoundError(f"no message batch {batch_id!r}")
    return _json(message_batch(record))


async def _delete(runner: BatchRunner, request: Request) -> Response:
    record = await _existing(runner, request.path_params["batch_id"])
    if record.processing_status != "ended":
        raise InvalidRequestError(f"message batch {record.id!r} is {record.processing_status}; only an ended batch "
                                  "can be deleted (cancel it first)")
    if not await asyncio.to_thread(runner.store.delete, record.id):
        raise NotFoundError(f"no message batch {record.id!r}")
    return _json(DeletedBatch(id=record.id))


def api_endpoint(owner: T, handler: Callable[[T, Request], Awaitable[Response]],
                 render: Callable[[ApiError], bytes] = anthropic_error_body) -> Callable[[Request], Awaitable[Response]]:
    """``handler(owner, request)`` as a route endpoint whose every error is a ``render``ed body
    (the Anthropic shape here; the OpenAI Batches' routes pass ``openai_error_body``)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(owner, request)
        except Exception as exc:  # always the API's error shape
            error = http_error(exc)
            if error.status >= 500:
                logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
            return Response(render(error), status_code=error.status, media_type="application/json")

    return endpoint



def batch_routes(runner: BatchRunner) -> list[Route]:
    """The Message Batches routes over ``runner`` (the caller starts and closes the runner)."""
    base = "/v1/messages/batches"
    return [
        Route(base, api_endpoint(runner, _create), methods=["POST"]),
        Route(base, api_endpoint(runner, _list), methods=["GET"]),
        Route(base + "/{batch_id}", api_endpoint(runner, _retrieve), methods=["GET"]),
        Route(base + "/{batch_id}", api_endpoint(runner, _delete), methods=["DELETE"]),
        Route(base + "/{batch_id}/results", api_endpoint(runner, _results), methods=["GET"]),
        Route(base + "/{batch_id}/cancel", api_endpoint(runner, _cancel), methods=["POST"]),
    ]
