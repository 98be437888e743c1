"""The Message Batches API at the orchestrator: one store, owned by the leader, run through the flow.

The leader (``orchestrator.leadership``) opens ``<state_dir>/batches.sqlite3`` (``api.batches``' store
and runner, the workers' own code) and mounts the batch routes on the state
owner's Unix-socket app; every process, the leader included, replays
``/v1/messages/batches*`` to it verbatim (``batch_forward``). So one client
sees one set of batches whichever process answers, and the file outlives the
orchestrator: batches left running continue after a restart or a hand-over. The OpenAI
Files and Batches (``/v1/files*``, ``/v1/batches*``; ``orchestrator.openai_batches``)
are owned, replayed and run the same way, with ``through_flow``'s policy.

Each batch request runs through the leader's ``Flow`` exactly like a client's
non-streaming ``POST /v1/messages`` (ctx leg, then gen leg, retries), so a
batch belongs to no worker. Policy of ``FlowBatchExecutor``:

- params that /v1/messages would reject (here or at a worker: a 4xx) are an
  ``errored`` result carrying that error;
- a cluster that cannot serve (no healthy worker, every worker failed, a
  timeout) fails nothing: the request waits until a gen worker is healthy
  again and retries, so a worker restart only delays a batch; after
  ``MAX_ATTEMPTS`` failures while workers looked healthy it is ``errored``
  (a request that breaks every worker must not retry forever).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from starlette.requests import Request
from starlette.responses import Response

from api.batches import BATCHES_FILE, BatchRunner, BatchStore
from api.batches.executor import Outcome, batch_body, errored, errored_by, succeeded
from api.errors import NotFoundError
from orchestrator.answers import unwatched
from orchestrator.errors import LegFailed, NoWorkerError, RequestTimeoutError, UpstreamFailedError, UpstreamRejected
from orchestrator.http_client import UpstreamError
from orchestrator.prompt import ParsedRequest, parse_request
from orchestrator.state_protocol import RequestTrace
from workers.http_protocol import Phase

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator

__all__ = ["FlowExecutor", "FlowBatchExecutor", "open_batch_runner", "batch_forward", "through_flow", "MAX_ATTEMPTS"]

log = logging.getLogger("disagg.orchestrator.batches")

MAX_ATTEMPTS = 8
RETRY_SECONDS = 1.0
_TRANSIENT = (NoWorkerError, UpstreamFailedError, RequestTimeoutError, LegFailed, UpstreamError)


class FlowExecutor:
    """A batch executor over the orchestrator's flow: ready while a gen worker is healthy."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch

    def is_ready(self) -> bool:
        return self.orch.view.has_healthy(Phase.GEN)


class FlowBatchExecutor(FlowExecutor):
    """Runs one Message Batch request through the orchestrator's flow (module doc: the policy)."""

    async def execute(self, params: bytes, request_id: str) -> Outcome | None:
        try:
            batch_body(params)  # the batch's own rule (no streaming) before the API's
            parsed = parse_request("messages", params, self.orch.validator, None)
            response = await through_flow(self.orch, parsed, request_id, "messages")
            return succeeded(bytes(response.body))
        except UpstreamRejected as exc:  # the worker's own Anthropic error body
            return errored(exc.body)
        except Exception as exc:  # noqa: BLE001 - the 4xx /v1/messages would answer, or the cluster's failure
            return errored_by(exc)


async def through_flow(orch: Orchestrator, parsed: ParsedRequest, request_id: str, api: str) -> Response:
    """A batch request's non-streamed answer from the flow, retried while the cluster cannot serve
    (module doc: the policy); its perf records say ``api``. Raises the request's own failure."""
    failures = 0
    while True:
        record = RequestTrace(request_id=request_id, api=api, arrival=time.time())
        try:
            return await orch.flow.handle(parsed, request_id, unwatched, record)  # no client to lose
        except _TRANSIENT as exc:
            failures += 1
            if failures >= MAX_ATTEMPTS:
                raise UpstreamFailedError(f"the cluster failed this request {failures} times; last: {exc}") from exc
            log.warning("batch request %s: %s; retrying when a gen worker is healthy", request_id, exc)
        await asyncio.sleep(RETRY_SECONDS)
        while not orch.view.has_healthy(Phase.GEN):
            await asyncio.sleep(RETRY_SECONDS)


def open_batch_runner(orch: Orchestrator) -> BatchRunner:
    """Process 0's runner over ``<state_dir>/batches.sqlite3`` (raises BatchStoreBusyError if taken)."""
    return BatchRunner(BatchStore(Path(orch.config.state_dir) / BATCHES_FILE), FlowBatchExecutor(orch))


async def batch_forward(orch: Orchestrator, request: Request) -> Response:
    """Any process: replay a /v1/messages/batches*, /v1/files* or /v1/batches* request to the owner
    and its answer back."""
    body = await request.body() if request.method in ("POST", "PUT", "PATCH") else b""
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    content_type = request.headers.get("content-type")  # a multipart upload's boundary is in it
    try:
        answer = await orch.link.forward(request.method, path, body,
                                         {"content-type": content_type} if content_type else None)
    except httpx.HTTPError as exc:
        raise UpstreamFailedError(f"the batch store's owner (the leader) did not answer: {exc}") from exc
    if answer.status_code in (404, 405) and answer.headers.get("content-type", "").startswith("text/plain"):
        # The owner's router itself: no such batch route (the routes' own errors are JSON).
        raise NotFoundError(f"no route {request.method} {request.url.path}")
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type", "application/json"))
