"""Token-exact mid-stream migration: a streamed answer whose gen worker fails goes on elsewhere.

With ``migration.limit`` > 0 every streamed gen leg is sent with ``x-disagg-stream-marks: 1``:
the worker ends each write with the output tokens it consumed (``api.stream_marks``). The
relay (``orchestrator.relay``) passes only whole writes to the client, marks stripped, and this
carries their tokens. When the leg then fails (the connection drops: the worker or one of its
frontends died; or a write is a 5xx error event: its engine died or stalled), the client has
received exactly the writes of the tokens carried, and the request goes on as a ``resume`` leg
on another gen worker: the prompt's ids and the carried tokens
(``workers.disagg_params.RequestType.RESUME``). That worker prefills both, replays the tokens through its
detokenizer, stop strings, tool-call parser and grammar without writing them, and samples on
from the next position, so the client's stream goes on as the failed worker's would have:

- greedy decoding: the same tokens (the same model and weights on every gen worker);
- seeded sampling: the same draws, the sampler's noise being a function of (seed, output
  position) alone (``workers.engine.sampler.position_seed``);
- structured outputs and forced tool calls: the grammar advanced past the carried tokens;
- usage counted once: the resumed worker counts the carried tokens as its output.

The client sees a pause, never an error event, unless no move is possible: past ``limit``
moves, past ``max_carried_tokens``, past the request's deadline, or no other gen worker takes
the resume leg (each counted in ``disagg_orchestrator_migrations_total`` and logged).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from api.stream_marks import MARKS_HEADER, MarkReader
from orchestrator.http_client import LegResponse, UpstreamError
from orchestrator.prompt import ParsedRequest, gen_leg_body
from workers.disagg_params import DisaggParams, RequestType
from workers.http_protocol import Phase

if TYPE_CHECKING:
    from orchestrator.flow import Flow
    from orchestrator.registry import WorkerRecord

__all__ = ["Migration", "MARKS_HEADERS"]

log = logging.getLogger("disagg.orchestrator.migration")

MARKS_HEADERS = {MARKS_HEADER: "1"}

_SERVER_ERROR = 500  # a write that is an error event of this status or above: the worker failed, not the request


class Migration:
    """One streamed request's marks, carried tokens and moves."""

    __slots__ = ("flow", "request", "request_id", "prompt_ids", "reader", "carried", "moves", "tried", "failed",
                 "head")

    def __init__(self, flow: Flow, request: ParsedRequest, request_id: str, params: DisaggParams | None) -> None:
        """``params``: the gen leg's (None: a normal request), whose prompt ids it ran on."""
        self.flow = flow
        self.request = request
        self.request_id = request_id
        # The prompt ids the gen leg ran on: a disaggregated leg's signed ones, else the orchestrator's.
        signed = None if params is None else params.prompt_token_ids
        self.prompt_ids = request.prompt_ids if signed is None else signed
        self.reader = MarkReader()
        self.carried: list[int] = []  # the output tokens of every write relayed to the client
        self.moves = 0
        self.tried: set[str] = set()
        self.head: _EventHead | None = None  # the first relayed event's id and creation time
        self.failed: str | None = None
        """Set by ``read`` when the leg ended with a 5xx error event: the worker failed. The relay
        moves the stream (or ends it) and clears it."""

    def read(self, data: bytes) -> bytes:
        """The writes ``data`` completes, to relay. A 5xx error event (``failed`` set) is not
        relayed, nor anything after it."""
        out = []
        for write, mark in self.reader.feed(data):
            if mark.error is not None and mark.error >= _SERVER_ERROR:
                self.failed = f"its error event, status {mark.error}"
                self.reader.rest()
                break
            out.append(write)
            self.carried.extend(mark.tokens)
            if self.head is None and write:
                self.head = _event_head(write)
        return b"".join(out)

    def take_failure(self) -> str | None:
        failed, self.failed = self.failed, None
        return failed

    def rest(self) -> bytes:
        """An ended leg's bytes after its last mark (none from a worker that marks every write)."""
        return self.reader.rest()

    def refusal(self, deadline_passed: bool) -> str | None:
        """Why the stream may not move now (None: it may)."""
        config = self.flow.config.migration
        if deadline_passed:
            return "the request's deadline passed"
        if self.moves >= config.limit:
            return f"it moved {self.moves} times (migration.limit)"
        if len(self.carried) > config.max_carried_tokens:
            return f"it holds {len(self.carried)} tokens (migration.max_carried_tokens {config.max_carried_tokens})"
        if not self.carried:
            return "no write carried a token yet"
        return None

    async def move(self, failed: WorkerRecord, why: str, deadline_passed: bool
                   ) -> tuple[WorkerRecord, LegResponse] | None:
        """The resume leg's answer, its head read (status 200), on another gen worker; None when
        the stream cannot move (then it ends with the API's error event)."""
        flow, metrics = self.flow, self.flow.metrics
        self.tried.add(failed.worker_id)
        if not deadline_passed:  # our own timer cut it, not the worker
            flow.view.suspect(failed.worker_id)
        refusal = self.refusal(deadline_passed)
        if refusal is not None:
            metrics.migrations.labels("refused").inc()
            log.warning("request %s: gen worker %s failed mid-stream (%s); not migrated: %s",
                        self.request_id, failed.worker_id, why, refusal)
            return None
        body = self.resume_body()
        headers = {"x-request-id": f"{self.request_id}-gen", "content-type": "application/json", **MARKS_HEADERS}
        while self.moves < flow.config.migration.limit:
            worker = flow.pick(Phase.GEN, self.request, self.tried)
            if worker is None:
                break
            self.moves += 1
            self.tried.add(worker.worker_id)
            flow.metrics.count_leg(Phase.GEN)
            try:
                upstream = await flow.upstream.post(worker.url + self.request.path, body, headers)
            except UpstreamError as exc:
                flow.view.suspect(worker.worker_id)
                log.warning("request %s: resume on %s failed: %s", self.request_id, worker.worker_id, exc)
                continue
            if upstream.status == 200:
                metrics.migrations.labels("moved").inc()
                log.warning("request %s: gen worker %s failed mid-stream (%s); migrated to %s with %d tokens "
                            "(move %d of %d)", self.request_id, failed.worker_id, why, worker.worker_id,
                            len(self.carried), self.moves, flow.config.migration.limit)
                return worker, upstream
            answer = (await upstream.read())[:200]
            upstream.close()
            log.warning("request %s: resume on %s answered %d: %r", self.request_id, worker.worker_id,
                        upstream.status, answer)
            if upstream.status < _SERVER_ERROR and upstream.status != 429:
                break  # the worker refuses the leg itself: another would too
        metrics.migrations.labels("failed").inc()
        log.warning("request %s: gen worker %s failed mid-stream (%s); no gen worker took it over (%d tried)",
                    self.request_id, failed.worker_id, why, len(self.tried))
        return None

    def resume_body(self) -> bytes:
        head = self.head or _EventHead()
        params = DisaggParams(RequestType.RESUME, prompt_token_ids=self.prompt_ids, output_token_ids=self.carried,
                              response_id=head.id, created=head.created)
        return gen_leg_body(self.request, params)


class _EventHead(msgspec.Struct):
    """What the events after a move must repeat of the first: OpenAI's chunk ``id`` and ``created``
    (Anthropic's message id is in ``message_start`` alone, which a resumed stream does not repeat)."""

    id: str | None = None
    created: int | None = None


_HEAD = msgspec.json.Decoder(_EventHead)


def _event_head(write: bytes) -> _EventHead:
    line = write.split(b"\n", 1)[0]
    if not line.startswith(b"data: {"):
        return _EventHead()
    try:
        head = _HEAD.decode(line[6:])
    except msgspec.DecodeError:  # not an OpenAI chunk (an Anthropic event has no such fields)
        return _EventHead()
    return head if isinstance(head.id, str) else _EventHead()

