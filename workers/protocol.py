"""Wire types of the frontend <-> engine boundary (and the EngineCore API).

Every struct here is MessagePack on a ZeroMQ socket (inside an HMAC-checked
frame, see ``workers.ipc``) and the argument/return type of ``EngineCore``.
Hot-path structs are ``array_like`` and ``gc=False`` as in vLLM v1.
Torch-free.
"""

from __future__ import annotations

import msgspec

from workers.sampling_params import SamplingParams

__all__ = [
    "EngineRequest",
    "TokenLogprobs",
    "RequestOutput",
    # ingress.sock (every frontend -> engine)
    "AddRequest",
    "AbortRequests",
    "FrontendHello",
    "IngressMessage",
    # lane-<i>.sock (engine -> frontend i)
    "OutputBatch",
    # status.sock (engine and attached frontends -> launcher)
    "EngineInfo",
    "EngineReady",
    "EngineFailed",
    "FrontendReady",
    "FrontendFailed",
    "StatusMessage",
    # control.sock (launcher <-> engine)
    "HealthPing",
    "Shutdown",
    "DrainStats",
    "DrainKVEvents",
    "StartProfile",
    "StopProfile",
    "ControlRequest",
    "EngineHealth",
    "DrainReply",
    "ControlAck",
    "ControlReply",
]


class EngineRequest(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True, gc=False):
    """One generation request, already tokenized.

    ``request_id`` is the client id: a uint64 whose top 16 bits name the
    frontend that owns the request (``request_id >> 48``).
    """

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0  # frontend's time.time() when the request arrived


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Logprob of a sampled token and the top-n alternatives at its position."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class RequestOutput(msgspec.Struct, omit_defaults=True, array_like=True, gc=False):
    """What one engine step produced for one request.

    ``finish_reason`` is one of ``stop``, ``length``, ``abort`` (see
    ``workers.engine.request.FINISH_REASONS``) or None while it runs.
    ``error`` is set when the engine rejected the request (e.g. prompt longer
    than ``max_model_len``); then ``finish_reason`` is ``abort``.
    """

    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


# --- ingress.sock: every frontend PUSHes, the engine PULLs -------------------


class AddRequest(msgspec.Struct, frozen=True, array_like=True, gc=False, tag="add"):
    request: EngineRequest


class AbortRequests(msgspec.Struct, frozen=True, array_like=True, gc=False, tag="abort"):
    """Abort these requests in whatever state they are (unknown ids are ignored)."""

    request_ids: list[int]


class FrontendHello(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    """A frontend's lane is bound; the engine answers with an empty OutputBatch on it,
    which proves the path engine -> lane works before the frontend reports ready."""

    frontend_id: int


IngressMessage = AddRequest | AbortRequests | FrontendHello


# --- lane-<i>.sock: the engine PUSHes, frontend i PULLs ----------------------


class OutputBatch(msgspec.Struct, array_like=True, gc=False):
    """Everything one engine step produced for one frontend (at most one per lane
    per step). An empty batch is a heartbeat: the engine is alive."""

    outputs: list[RequestOutput]
    timestamp: float  # engine's time.time() when the batch was sent


# --- status.sock: readiness reports to the launcher --------------------------


class EngineInfo(msgspec.Struct, frozen=True):
    """What a frontend needs to know about the engine it serves (the handshake)."""

    kind: str  # torch | synthetic
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_blocks: int


class EngineReady(msgspec.Struct, frozen=True, tag="engine_ready"):
    info: EngineInfo
    pid: int


class EngineFailed(msgspec.Struct, frozen=True, tag="engine_failed"):
    error: str  # the exception and the last lines of its traceback


class FrontendReady(msgspec.Struct, frozen=True, tag="frontend_ready"):
    frontend_id: int
    pid: int


class FrontendFailed(msgspec.Struct, frozen=True, tag="frontend_failed"):
    frontend_id: int
    error: str


StatusMessage = EngineReady | EngineFailed | FrontendReady | FrontendFailed


# --- control.sock: the launcher's private channel to the engine --------------


class HealthPing(msgspec.Struct, frozen=True, tag="health"):
    pass


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


class DrainStats(msgspec.Struct, frozen=True, tag="drain_stats"):
    pass


class DrainKVEvents(msgspec.Struct, frozen=True, tag="drain_kv_events"):
    pass


class StartProfile(msgspec.Struct, frozen=True, tag="start_profile"):
    dir: str | None = None  # None: EngineConfig.profile_dir


class StopProfile(msgspec.Struct, frozen=True, tag="stop_profile"):
    pass


ControlRequest = HealthPing | Shutdown | DrainStats | DrainKVEvents | StartProfile | StopProfile


class EngineHealth(msgspec.Struct, frozen=True, tag="health"):
    """The engine loop's own counters (the reply to HealthPing)."""

    num_unfinished: int
    num_steps: int
    num_rejected_frames: int  # ingress + control messages dropped for a bad HMAC
    num_lane_drops: int  # lane batches dropped because a frontend's queue was full
    num_lane_aborts: int  # requests aborted because their lane was full
    timestamp: float


class DrainReply(msgspec.Struct, frozen=True, tag="drain"):
    """``items`` is the MessagePack of a list of ``IterationStats`` (DrainStats)
    or of ``KVEvent`` (DrainKVEvents): the launcher decodes it with the right type."""

    items: msgspec.Raw


class ControlAck(msgspec.Struct, frozen=True, tag="ack"):
    error: str | None = None  # None: done


ControlReply = EngineHealth | DrainReply | ControlAck
