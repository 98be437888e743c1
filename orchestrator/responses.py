"""The Responses API at the orchestrator: ``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

Design: the orchestrator translates each /v1/responses request into the
chat request it means (``api.responses``: the conversation of
``previous_response_id`` loaded from the orchestrator's own store, then this
request's input) and runs that through its normal disaggregated chat flow
(ctx leg + gen leg, retries, streaming), then renders the chat answer as a
response object or event stream with the workers' own renderer. Workers
therefore see plain chat requests and keep nothing: the orchestrator's
store (one SQLite file in its state directory, shared by its processes)
holds every conversation, so a conversation continues on any worker, and
survives any worker's restart.

Every turn of a conversation has one session id (``x-session-id``, else
``user``, else the conversation's first item id), so session-affinity
routing keeps a conversation where its KV is. Perf records say
``api: responses``; request counters count these as ``chat`` (what ran).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.errors import FrontendError, NotFoundError
from api.request_fields import IGNORED_FIELDS_SCOPE_KEY, warning_header
from api.responses import ResponseEventStream, begin_turn, input_items_page, store_turn
from api.responses.render import ResponseTurn
from api.responses.schemas import Item
from api.responses.translate import rename_fields, rename_param, responses_param
from api.streaming import EventStreamResponse
from common.log_format import REQUEST_ID
from orchestrator.answers import disconnect_watch
from orchestrator.errors import UpstreamRejected
from orchestrator.prompt import ParsedRequest, parse_request
from orchestrator.state_protocol import RequestTrace

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator

__all__ = ["create_response", "retrieve_response", "list_input_items", "delete_response", "turn_answer", "finish_turn"]

_JSON = "application/json"


def _renamed(exc: UpstreamRejected) -> UpstreamRejected:
    """A worker's 4xx to the chat request, in Responses terms."""
    try:
        body = msgspec.json.decode(exc.body)
        error = body["error"]
        error["param"] = responses_param(error.get("param"))
        error["message"] = rename_fields(error.get("message") or "")
    except (msgspec.DecodeError, KeyError, TypeError):
        return exc
    return UpstreamRejected(exc.status, msgspec.json.encode(body))


async def turn_answer(orch: Orchestrator, raw: bytes, session_header: str | None, run: Callable[[ParsedRequest], Awaitable[Any]],
                      fields: dict[str, Any] | None = None) -> tuple[ResponseTurn, Any]:
    """The chat request a /v1/responses body means, and ``run``'s answer to it (its errors in
    Responses terms). Shared by ``create_response`` and the OpenAI Batches (``orchestrator.openai_batches``).
    ``fields``: where the unknown top-level fields it ignored are noted (``api.request_fields``)."""
    turn = await begin_turn(raw, orch.responses, orch.config.strict_request_fields, {} if fields is None else fields)
    try:
        # A conversation is a session (affinity routing) unless the client names one.
        session = session_header or turn.body.user or turn.session_id
        parsed = parse_request("chat", msgspec.json.encode(turn.chat_body()), orch.validator, session)
        return turn, await run(parsed)
    except FrontendError as exc:
        raise rename_param(exc) from None
    except UpstreamRejected as exc:
        raise _renamed(exc) from None


async def finish_turn(orch: Orchestrator, turn: ResponseTurn, chat_answer: bytes) -> bytes:
    """A non-streamed chat answer as the response object, stored (when the body asks) and encoded."""
    response, output = turn.from_chat(msgspec.json.decode(chat_answer))
    encoded = msgspec.json.encode(response)
    await store_turn(turn, orch.responses, encoded, output)
    return encoded


async def create_response(orch: Orchestrator, request: Request) -> Response:
    request_id = request.headers.get("x-request-id") or orch.new_request_id()
    REQUEST_ID.set(request_id)  # every log line of this request's task (common.log_format)
    record = RequestTrace(request_id=request_id, api="responses", arrival=time.time())
    orch.ends.begin(record, request.headers.get("traceparent"))

    async def run(parsed: ParsedRequest) -> Response:
        record.tokenized = time.time()
        return await orch.flow.handle(parsed, request_id, disconnect_watch(request.receive), record)

    try:
        fields: dict[str, Any] = {}  # the unknown fields it ignores (api.request_fields)
        turn, answer = await turn_answer(orch, await request.body(), request.headers.get("x-session-id"), run, fields)
    except Exception as exc:
        orch.failed(record, exc, False)
        raise
    if isinstance(answer, EventStreamResponse):  # its headers (x-disagg-*) stay
        store = orch.responses

        async def keep(response_json: bytes, output: list[Item]) -> None:
            await store_turn(turn, store, response_json, output)

        answer.events = ResponseEventStream(turn, keep).run(answer.events)
        answer.raw_headers += [warning_header(fields[IGNORED_FIELDS_SCOPE_KEY])] if fields else []
        return answer
    encoded = await finish_turn(orch, turn, answer.body)
    headers = {k: v for k, v in answer.headers.items() if k.startswith("x-")}
    if fields:
        name, value = warning_header(fields[IGNORED_FIELDS_SCOPE_KEY])
        headers[name.decode()] = value.decode()
    return Response(encoded, media_type=_JSON, headers=headers)


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"No response found with id '{response_id}'.", param="response_id")


async def retrieve_response(orch: Orchestrator, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    record = await orch.responses.get(response_id)
    if record is None:
        raise _not_found(response_id)
    return Response(bytes(record.response), media_type=_JSON)


async def list_input_items(orch: Orchestrator, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    record = await orch.responses.get(response_id)
    if record is None:
        raise _not_found(response_id)
    return Response(msgspec.json.encode(input_items_page(record, request.query_params)), media_type=_JSON)


async def delete_response(orch: Orchestrator, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not await orch.responses.delete(response_id):
        raise _not_found(response_id)
    return Response(msgspec.json.encode({"id": response_id, "object": "response", "deleted": True}),
                    media_type=_JSON)
