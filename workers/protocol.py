"""Wire types of the frontend <-> engine boundary (and the EngineCore API).

Every struct here is MessagePack on a ZeroMQ socket (inside an HMAC-checked
frame, see ``workers.ipc``) and the argument/return type of ``EngineCore``.
Hot-path structs are ``array_like`` and ``gc=False`` as in vLLM v1.
Torch-free.
"""

from __future__ import annotations

import enum

import msgspec

from workers.engine.kv_tiers import TierStats
from workers.sampling_params import SamplingParams

__all__ = [
    "RemotePrefix",
    "EngineRequest",
    "TokenLogprobs",
    "EngineTiming",
    "RequestOutput",
    "FinishReason",
    "RejectReason",
    "CLIENT_REJECTIONS",
    # ingress.sock (every frontend -> engine)
    "AddRequest",
    "AddContextRequest",
    "AddRemoteRequest",
    "AddResumedRequest",
    "ParkedKV",
    "KVTransferStats",
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
    "SnapshotKVCache",
    "StartProfile",
    "StopProfile",
    "ControlRequest",
    "EngineHealth",
    "DrainReply",
    "ControlAck",
    "ControlReply",
    # perf.sock (attached frontends -> launcher)
    "PerfRecord",
    "PerfRecordBatch",
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
    # The HTTP request's x-request-id: the engine's log lines about this request name it (common.log_format).
    x_request_id: str | None = None


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Logprob of a sampled (or prompt) token and the top-n alternatives at its position."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None  # a prompt token's rank in its distribution (1: the likeliest); None otherwise


class EngineTiming(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Engine-side times of one request (the engine's ``time.time()``), sent on its
    finishing ``RequestOutput`` for the per-request perf records."""

    arrival: float  # the engine took the request off ingress
    first_scheduled: float | None  # None: never scheduled (rejected, aborted while waiting)
    first_token: float | None
    finished: float  # the finishing output left the engine


class ParkedKV(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Disaggregated ctx side, on a request's finishing output: its prompt's KV is parked
    in the engine (not freed, not evictable) until a gen engine pulls it or ``expires_at``."""

    num_tokens: int
    expires_at: float  # unix time


class KVTransferStats(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Disaggregated gen side, on a request's finishing output: how its KV was pulled."""

    num_blocks: int
    num_bytes: int
    seconds: float  # from the pull request sent to the last block imported
    recomputed: bool = False
    """The pull failed (the ctx engine died, its parked KV expired) and the gen engine prefilled the
    prompt itself (vLLM's ``kv_load_failure_policy=recompute``); the other fields are then zero."""

    @property
    def bytes_per_second(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0


class FinishReason(enum.StrEnum):
    """Why a request ended (``workers.engine.request.FINISH_REASONS`` maps the engine's states)."""

    STOP = "stop"  # EOS, a stop token or string
    LENGTH = "length"  # max_tokens or the model's length
    ABORT = "abort"  # aborted, or rejected (``RequestOutput.reject_reason``)


class RejectReason(enum.StrEnum):
    """Why the engine ended a request with an error, whose words are ``RequestOutput.error``.

    Those in ``CLIENT_REJECTIONS`` are the request's own fault, a 400 for its client; any other
    is the engine's (an exception while adding the request, an invariant broken): a 500, which the
    orchestrator retries on another worker."""

    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"
    INVALID_SAMPLING_PARAMS = "invalid_sampling_params"
    TOKEN_OUT_OF_VOCABULARY = "token_out_of_vocabulary"
    GUIDED_DECODING_OFF = "guided_decoding_off"  # this engine found no tokenizer.json for grammars
    GRAMMAR_DOES_NOT_COMPILE = "grammar_does_not_compile"
    GRAMMAR_REJECTS_OUTPUT = "grammar_rejects_output"  # a resumed request's output tokens
    # The engine's own failures.
    KV_STILL_PARKED = "kv_still_parked"  # a ctx request id whose earlier KV is still parked
    SAMPLED_OUTSIDE_GRAMMAR = "sampled_outside_grammar"  # a sampled token the grammar's mask should have barred
    INTERNAL = "internal"  # an exception in the engine's add_request path (logged with its traceback)

    @property
    def is_client_error(self) -> bool:
        return self in CLIENT_REJECTIONS


CLIENT_REJECTIONS = frozenset({
    RejectReason.EMPTY_PROMPT, RejectReason.PROMPT_TOO_LONG, RejectReason.INVALID_SAMPLING_PARAMS,
    RejectReason.TOKEN_OUT_OF_VOCABULARY, RejectReason.GUIDED_DECODING_OFF, RejectReason.GRAMMAR_DOES_NOT_COMPILE,
    RejectReason.GRAMMAR_REJECTS_OUTPUT,
})


class RequestOutput(msgspec.Struct, omit_defaults=True, array_like=True, gc=False):
    """What one engine step produced for one request.

    ``finish_reason`` is None while it runs. ``error`` and ``reject_reason`` are set when the
    engine rejected the request (e.g. prompt longer than ``max_model_len``); then
    ``finish_reason`` is ``abort``.
    """

    request_id: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    kv_parked: ParkedKV | None = None  # ctx side of disaggregation: set on the finishing output
    kv_transfer: KVTransferStats | None = None  # gen side: set on the finishing output
    timing: EngineTiming | None = None  # set by the engine process on the finishing output only
    reject_reason: RejectReason | None = None  # with ``error``
    # On the first output of a request that asked for ``prompt_logprobs``: prompt tokens 1.. given their
    # prefix (the first token has none), collected across its prefill chunks.
    prompt_logprobs: list[TokenLogprobs] | None = None


# --- ingress.sock: every frontend PUSHes, the engine PULLs -------------------


class AddRequest(msgspec.Struct, frozen=True, array_like=True, gc=False, tag="add"):
    request: EngineRequest


class RemotePrefix(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The first ``num_tokens`` of a ctx leg's prompt (whole blocks), parked on another engine as its
    request ``ctx_request_id``: pulled from ``kv_endpoint`` instead of computed (the KV pool)."""

    ctx_request_id: int
    kv_endpoint: str
    num_tokens: int


class AddContextRequest(msgspec.Struct, frozen=True, array_like=True, gc=False, tag="add_ctx"):
    """Disaggregated ctx leg: prefill, sample, then park the prompt's KV for ``park_kv_seconds``
    (the finishing output carries ``kv_parked``; nothing is parked when it ends with ``stop``).
    With ``kv_prefix`` the prompt's first blocks are pulled from a peer first."""

    request: EngineRequest
    park_kv_seconds: float
    kv_prefix: RemotePrefix | None = None


class AddRemoteRequest(msgspec.Struct, frozen=True, array_like=True, gc=False, tag="add_remote"):
    """Disaggregated gen leg: pull the prompt's KV from ``kv_endpoint`` (the ctx engine's
    request ``ctx_request_id``), then decode after ``first_token_id`` (not reported again)."""

    request: EngineRequest
    first_token_id: int
    ctx_request_id: int
    kv_endpoint: str


class AddResumedRequest(msgspec.Struct, frozen=True, array_like=True, gc=False, tag="add_resumed"):
    """A stream migrated from a worker that failed mid-answer (``api.disaggregation``):
    prefill the prompt and ``output_token_ids`` (the tokens another engine already sampled), then
    decode on from there as if this engine had sampled them: they count toward ``max_tokens``
    and the sampling positions, the grammar is advanced past them, and they are not reported again."""

    request: EngineRequest
    output_token_ids: list[int]


class AbortRequests(msgspec.Struct, frozen=True, array_like=True, gc=False, tag="abort"):
    """Abort these requests in whatever state they are (unknown ids are ignored)."""

    request_ids: list[int]


class FrontendHello(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    """A frontend's lane is bound; the engine answers with an empty OutputBatch on it,
    which proves the path engine -> lane works before the frontend reports ready."""

    frontend_id: int


IngressMessage = (AddRequest | AddContextRequest | AddRemoteRequest | AddResumedRequest | AbortRequests
                  | FrontendHello)


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
    role: str = "both"  # both | ctx | gen (disaggregated serving)
    kv_endpoint: str | None = None  # tcp://host:port of the KV-transfer agent; None without one
    hash_seed: int = 0  # the block-hash seed (routers must use the same)


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


class SnapshotKVCache(msgspec.Struct, frozen=True, tag="snapshot_kv_cache"):
    """Every cached block hash now, and the id the next KV event will carry (a router resynchronises
    from it when it missed events)."""


class StartProfile(msgspec.Struct, frozen=True, tag="start_profile"):
    dir: str | None = None  # None: EngineConfig.profile_dir


class StopProfile(msgspec.Struct, frozen=True, tag="stop_profile"):
    pass


ControlRequest = HealthPing | Shutdown | DrainStats | DrainKVEvents | SnapshotKVCache | StartProfile | StopProfile


class EngineHealth(msgspec.Struct, frozen=True, tag="health"):
    """The engine loop's own counters (the reply to HealthPing)."""

    num_unfinished: int
    num_steps: int
    num_rejected_frames: int  # ingress + control messages dropped for a bad HMAC
    num_lane_drops: int  # lane batches dropped because a frontend's queue was full
    num_lane_aborts: int  # requests aborted because their lane was full
    timestamp: float
    # The scheduler and block pool now (Prometheus gauges; /metrics drains are not touched).
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tiers: TierStats | None = None  # the host and disk KV tiers (None: none configured)
    # Speculative decoding since the engine started: drafts verified, and the ones confirmed.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class DrainReply(msgspec.Struct, frozen=True, tag="drain"):
    """``items`` is the MessagePack of a list of ``IterationStats`` (DrainStats)
    or of ``KVEvent`` (DrainKVEvents), or a ``KVCacheSnapshot`` (SnapshotKVCache): the launcher
    decodes it with the right type."""

    items: msgspec.Raw


class ControlAck(msgspec.Struct, frozen=True, tag="ack"):
    error: str | None = None  # None: done
    error_type: str | None = None  # the exception's class name (e.g. ProfilingUnsupported)
    detail: str | None = None  # e.g. the trace file StopProfile wrote


ControlReply = EngineHealth | DrainReply | ControlAck


# --- perf.sock: attached frontends PUSH their perf records to the launcher ----


class PerfRecord(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One request's timeline (``time.time()`` of the frontend, or of the engine
    for the ``engine_*`` fields) and token counts, for ``GET /perf_metrics``."""

    request_id: int
    frontend_id: int
    frontend_arrival: float  # the HTTP request arrived
    tokenized: float  # the prompt was tokenized and sent to the engine
    engine_arrival: float | None  # None: the engine never reported on it (e.g. it died)
    first_scheduled: float | None
    first_token: float | None  # the engine produced the first token
    last_token: float | None  # the frontend received the last token
    finished: float  # the frontend saw the request end
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    finish_reason: str | None  # stop | length | abort | None (the client left first)
    # Disaggregated gen leg: the KV pulled from the ctx engine (None / 0: no transfer).
    kv_transfer_seconds: float | None = None
    kv_transfer_bytes: int = 0
    kv_transfer_blocks: int = 0
    kv_transfer_bytes_per_second: float | None = None
    kv_recomputed: bool = False  # the pull failed and the gen engine prefilled the prompt itself
    # The HTTP request's x-request-id header (the orchestrator's "<id>-ctx" / "<id>-gen" per leg):
    # what the orchestrator joins its own record on. None: no header.
    x_request_id: str | None = None


class PerfRecordBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    records: list[PerfRecord]
