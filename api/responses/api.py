"""The Responses API on a worker: ``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

``begin_turn`` and ``store_turn`` are what the worker and the orchestrator
share: decode and validate the body, load the conversation that
``previous_response_id`` continues (an unknown or expired id is the
reference's 400 ``previous_response_not_found``), and store the answer
(``store`` defaults to true). In between, a worker runs the request as a
chat request through its chat handler (``serve_chat_completion``) and
renders the answer (``api.responses.render``).

The stored-response routes read the app's ``ResponsesClient``
(``app.state.responses``): on the launcher and on a plain app, the local
store; attached frontends forward ``/v1/responses/*`` to the launcher
(``api.route_table``). ``admin_routes`` are the launcher's answers to
its attached frontends' reads and writes: on the admin Unix socket only.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.errors import FrontendError, InvalidRequestError, NotFoundError
from api.openai_api import serve_chat_completion
from api.request_context import enter_request
from api.request_fields import decode_request
from api.responses.items import input_items_page
from api.responses.render import ResponseEventStream, ResponseTurn
from api.responses.schemas import Item, ResponsesRequest, StoredResponse, with_defaults
from api.responses.store import ADMIN_PREFIX, LocalResponses, ResponsesClient
from api.responses.translate import parse_input, rename_param, validate_request
from api.route_table import over_admin_socket
from api.schemas_openai import ChatCompletionRequest
from api.serving import ServingContext
from api.streaming import EventStreamResponse

__all__ = ["PreviousResponseNotFoundError", "begin_turn", "store_turn", "create_response", "retrieve_response",
           "list_input_items", "delete_response", "admin_routes"]

_JSON = "application/json"


class PreviousResponseNotFoundError(InvalidRequestError):
    code = "previous_response_not_found"


async def begin_turn(raw: bytes, store: ResponsesClient, strict_fields: bool = False,
                     scope: MutableMapping[str, Any] | None = None) -> ResponseTurn:
    """The request's turn; ``strict_fields`` and ``scope``: ``api.request_fields.decode_request``'s."""
    body = with_defaults(decode_request(raw, ResponsesRequest, strict_fields, scope))
    items = parse_input(body.input)
    history: list[Item] = []
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id)
        if previous is None:
            raise PreviousResponseNotFoundError(f"Previous response with id '{body.previous_response_id}' not "
                                                "found.", param="previous_response_id")
        history = previous.conversation
    validate_request(body, items, history)
    return ResponseTurn(body, history, items)


async def store_turn(turn: ResponseTurn, store: ResponsesClient, response_json: bytes, output: list[Item]) -> None:
    if turn.body.store:
        await store.put(StoredResponse(turn.id, time.time(), msgspec.Raw(response_json),
                                       turn.conversation_after(output), len(output)))


def _store(request: Request) -> ResponsesClient:
    store: ResponsesClient = request.app.state.responses
    return store


async def create_response(ctx: ServingContext, request: Request) -> Response:
    arrival_time = time.time()
    x_request_id = enter_request(request.scope)
    store = _store(request)
    turn = await begin_turn(await request.body(), store, ctx.config.strict_request_fields, request.scope)
    chat = msgspec.convert(turn.chat_body(), ChatCompletionRequest)
    try:
        answer = await serve_chat_completion(ctx, chat, request.receive, arrival_time, x_request_id)
    except FrontendError as exc:
        raise rename_param(exc) from None
    if isinstance(answer, EventStreamResponse):

        async def keep(response_json: bytes, output: list[Item]) -> None:
            await store_turn(turn, store, response_json, output)

        return EventStreamResponse(ResponseEventStream(turn, keep).run(answer.events))
    response, output = turn.from_chat(msgspec.json.decode(answer.body))
    encoded = msgspec.json.encode(response)
    await store_turn(turn, store, encoded, output)
    return Response(encoded, media_type=_JSON)


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"No response found with id '{response_id}'.", param="response_id")


async def retrieve_response(ctx: ServingContext, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    record = await _store(request).get(response_id)
    if record is None:
        raise _not_found(response_id)
    return Response(bytes(record.response), media_type=_JSON)


async def list_input_items(ctx: ServingContext, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    record = await _store(request).get(response_id)
    if record is None:
        raise _not_found(response_id)
    return Response(msgspec.json.encode(input_items_page(record, request.query_params)), media_type=_JSON)


async def delete_response(ctx: ServingContext, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not await _store(request).delete(response_id):
        raise _not_found(response_id)
    return Response(msgspec.json.encode({"id": response_id, "object": "response", "deleted": True}),
                    media_type=_JSON)


def admin_routes(store: LocalResponses) -> list[Route]:
    """The launcher's store, for its attached frontends: GET / PUT / DELETE a whole record."""

    async def record(request: Request) -> Response:
        if not over_admin_socket(request.scope):
            return Response(status_code=404)
        response_id = request.path_params["response_id"]
        if request.method == "PUT":
            await store.put(msgspec.json.decode(await request.body(), type=StoredResponse))
            return Response(status_code=204)
        if request.method == "DELETE":
            return Response(status_code=204 if await store.delete(response_id) else 404)
        found = await store.get(response_id)
        return Response(status_code=404) if found is None else Response(msgspec.json.encode(found),
                                                                         media_type=_JSON)

    return [Route(ADMIN_PREFIX + "{response_id}", record, methods=["GET", "PUT", "DELETE"])]
