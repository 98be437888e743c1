"""The OpenAI Files and Batches APIs at the orchestrator: the leader's, run through the flow.

Owned like the Message Batches (``orchestrator.batches``): the leader opens
``<state_dir>/openai/`` (``api.batches.OpenAIBatches``: the files, the
batches and their requests, on disk, so they outlive a restart) and mounts
the routes on the state owner's app; every process replays ``/v1/files*``
and ``/v1/batches*`` to it (``batch_forward``). Each input line runs through
the leader's ``Flow`` exactly like a client's non-streaming request to its
``url`` (``/v1/chat/completions``, ``/v1/completions``, or ``/v1/responses``,
translated to chat as ``orchestrator.responses`` does), with the Message
Batches' retry policy (``through_flow``). Its answer, 200 or the 4xx the
endpoint would have sent, is the line's ``response``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from api.batches.executor import Outcome
from api.batches.openai_batches import OpenAIBatches
from api.batches.openai_lines import response_line
from api.batches.openai_schemas import BatchEndpoint, InputLine
from api.errors import InvalidRequestError, http_error, openai_error_body
from orchestrator.batches import FlowExecutor, through_flow
from orchestrator.errors import UpstreamRejected
from orchestrator.prompt import ParsedRequest, parse_request
from orchestrator.responses import finish_turn, turn_answer

if TYPE_CHECKING:
    from starlette.responses import Response

    from orchestrator.app import Orchestrator

__all__ = ["FlowLineExecutor", "open_openai_batches", "OPENAI_DIR"]

log = logging.getLogger("disagg.orchestrator.openai_batches")

OPENAI_DIR = "openai"
_APIS = {BatchEndpoint.CHAT.value: "chat", BatchEndpoint.COMPLETIONS.value: "completions"}


def _no_stream(parsed: ParsedRequest) -> ParsedRequest:
    if parsed.stream:
        raise InvalidRequestError("stream: batch requests cannot stream", param="stream")
    return parsed


class FlowLineExecutor(FlowExecutor):
    """Runs one input line (checked when the batch was validated) through the orchestrator's flow."""

    async def execute(self, params: bytes, request_id: str) -> Outcome | None:
        line = msgspec.json.decode(params, type=InputLine)
        try:
            answer = await self._answer(line.url, bytes(line.body), request_id)
        except UpstreamRejected as exc:  # the worker's own OpenAI error body
            return response_line(line.custom_id, exc.status, request_id, exc.body)
        except Exception as exc:  # the 4xx the endpoint would answer, or the cluster's failure
            error = http_error(exc)
            if error.status >= 500:
                log.error("batch request %s failed", request_id, exc_info=exc)
            return response_line(line.custom_id, error.status, request_id, openai_error_body(error))
        return response_line(line.custom_id, 200, request_id, answer)

    async def _answer(self, url: str, body: bytes, request_id: str) -> bytes:
        orch = self.orch
        if url == BatchEndpoint.RESPONSES.value:

            async def run(parsed: ParsedRequest) -> Response:
                return await through_flow(orch, _no_stream(parsed), request_id, "responses")

            turn, answer = await turn_answer(orch, body, None, run)
            return await finish_turn(orch, turn, answer.body)
        api = _APIS[url]
        parsed = _no_stream(parse_request(api, body, orch.validator, None))
        return bytes((await through_flow(orch, parsed, request_id, api)).body)


def open_openai_batches(orch: Orchestrator) -> OpenAIBatches:
    """The leader's Files and Batches over ``<state_dir>/openai/`` (raises BatchStoreBusyError if taken)."""
    return OpenAIBatches(Path(orch.config.state_dir) / OPENAI_DIR, FlowLineExecutor(orch))
