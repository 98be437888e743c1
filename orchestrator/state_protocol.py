"""Every message between the orchestrator's processes, its state owner and registering workers.

The state owner's Unix-socket app (``orchestrator.state``), the processes'
``StateLink`` (``orchestrator.view``) and a worker's registration loop
(``disagg.worker_registration``) encode and decode these Structs only, each
with ``msgspec.json.Decoder(type=...)``, so a malformed body is refused with a
400 that names the field (``state.typed_route``), never a 500.

    POST /register      Registration       -> RegistrationAck
    POST /heartbeat     WorkerIdBody       -> Ok   (404: register again)
    POST /deregister    WorkerIdBody       -> Ok
    POST /drain         DrainRequest       -> DrainAck  (once every process holds the change)
    POST /settings      a LiveSettings mapping -> SettingsAck (the same; a bad key is a 400 naming it)
    POST /load          LoadPush           -> Ok
    POST /perf          PerfPush           -> Ok
    GET  /snapshot      -> Snapshot
"""

from __future__ import annotations

import msgspec

from orchestrator.config import LiveSettings
from orchestrator.registry import WorkerRecord
from workers.http_protocol import Mode, Phase

__all__ = ["Registration", "WorkerIdBody", "RegistrationAck", "Ok", "WorkerRef", "DrainRequest", "DrainAck", "SettingsAck", "LoadPush", "CtxLegTrace", "GenLegTrace",
           "FailedLeg", "RequestTrace", "PerfPush", "Snapshot"]


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """POST /workers/register: a worker announcing itself (it must then heartbeat within the TTL)."""

    role: str
    """ctx, gen or both."""
    url: str
    kv_endpoint: str | None = None
    worker_id: str | None = None
    """A restarted worker keeps its id."""


class WorkerIdBody(msgspec.Struct, frozen=True):
    """POST /workers/heartbeat and /workers/deregister."""

    worker_id: str


class WorkerRef(msgspec.Struct, frozen=True):
    """POST /workers/drain and /workers/undrain (``disagg drain``): which worker, by id or URL."""

    worker: str


class DrainRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The state owner's POST /drain: what a process's /workers/drain or /workers/undrain asks."""

    worker: str
    draining: bool


class DrainAck(msgspec.Struct, frozen=True, kw_only=True):
    """The drained (or undrained) worker as the registry holds it, once ``processes_confirmed`` of the
    ``processes`` orchestrator processes route with the change (all of them, unless one is down)."""

    worker: WorkerRecord
    processes_confirmed: int
    processes: int


class SettingsAck(msgspec.Struct, frozen=True, kw_only=True):
    """The settings every process now serves with (``processes_confirmed`` of ``processes`` hold them)."""

    settings: LiveSettings
    processes_confirmed: int
    processes: int


class RegistrationAck(msgspec.Struct, frozen=True):
    worker_id: str
    ttl_seconds: float
    heartbeat_seconds: float


class Ok(msgspec.Struct, frozen=True):
    ok: bool = True


class LoadPush(msgspec.Struct, frozen=True):
    """POST /load: one process's in-flight load, ``worker_id -> [requests, tokens]``."""

    process: int
    loads: dict[str, list[int]]
    pid: int = 0
    """The pushing process: the owner drops these loads once it is dead."""


class CtxLegTrace(msgspec.Struct, kw_only=True):
    """The ctx leg that answered: its worker and times (orchestrator clock)."""

    worker_id: str
    start: float
    end: float
    engine_request_id: str | None = None
    """The ctx engine's request id (its answer's ``ctx_request_id``): joins that worker's perf record."""


class GenLegTrace(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The gen (or aggregated) leg that answered: its worker and times (orchestrator clock)."""

    worker_id: str
    start: float
    first_byte: float
    end: float | None = None
    """None while a stream is still relayed."""


class FailedLeg(msgspec.Struct):
    """A leg that failed and was retried elsewhere (or not at all)."""

    phase: Phase
    worker_id: str
    error: str


class RequestTrace(msgspec.Struct, kw_only=True):
    """One request's orchestrator timings (filled in as it goes), joined by ``orchestrator.perf``
    with the workers' ``workers.protocol.PerfRecord``s for GET /perf_metrics."""

    request_id: str
    api: str
    arrival: float
    num_prompt_tokens: int = 0
    mode: Mode = Mode.DISAGG
    tokenized: float | None = None
    ctx: CtxLegTrace | None = None
    gen: GenLegTrace | None = None
    end: float | None = None
    retries: int = 0
    error: str | None = None
    legs: list[FailedLeg] = msgspec.field(default_factory=list)


class PerfPush(msgspec.Struct, frozen=True):
    """POST /perf: finished requests' traces."""

    records: list[RequestTrace]


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """GET /snapshot: the state once newer than the caller's version (a long poll)."""

    version: int
    kv_version: int
    workers: list[WorkerRecord]
    kv: dict[str, list[int]] | None
    """The KV index (``KVIndex.export``), only when it changed after the caller's ``kv_after``."""
    kv_lower: dict[str, list[int]] | None = None
    """Its host- and disk-tier blocks (``KVIndex.export_lower``), sent with ``kv``."""
    loads: dict[str, dict[str, list[int]]]
    """Each process's pushed load by its index (a string: a JSON object key)."""
    settings: LiveSettings | None = None
    """The live settings, only when they changed after the caller's ``settings_after``."""
    settings_version: int = 0
    """Bumped by every POST /settings."""
    epoch: int = 0
    """The owner's: another epoch is another leader (``orchestrator.leadership``)."""
