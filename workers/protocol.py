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
