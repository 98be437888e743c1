"""The ``disaggregated_params`` of a request body, and the cluster key that signs them.

The ctx worker answers a ``context_only`` request with params naming where its
KV is parked; the orchestrator copies them into the ``generation_only``
request. The gen worker trusts them only when their HMAC-SHA256 under the
cluster key checks: a forged endpoint or request id would make its engine
connect to, or pull from, anything. Signed message (the wire format, shared
with the orchestrator)::

    HMAC-SHA256(cluster_key, msgpack([ctx_request_id, kv_endpoint, num_tokens,
                                      first_token_id, expires_at, prompt_hash]))

``prompt_hash``: hex sha256 of the prompt ids as little-endian int64 bytes.
Torch-free; the orchestrator imports this module.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import stat
import struct
import time
from pathlib import Path

import msgspec

from workers.protocol import TokenLogprobs

__all__ = [
    "CLUSTER_KEY_FILE_ENV",
    "RequestType",
    "DisaggParams",
    "DisaggParamsError",
    "ClusterKeyError",
    "prompt_hash",
    "sign_params",
    "verify_params",
    "signed_params",
    "load_cluster_key",
]

CLUSTER_KEY_FILE_ENV = "DISAGG_CLUSTER_KEY_FILE"


class RequestType(enum.StrEnum):
    """Which leg of a disaggregated request a body is (``disaggregated_params.request_type``)."""

    CONTEXT_ONLY = "context_only"  # prefill, sample one token, park the prompt's KV
    GENERATION_ONLY = "generation_only"  # pull the parked KV, decode on from the ctx leg's token
    # A stream migrated mid-answer (orchestrator.migration): the worker prefills the prompt and the
    # tokens already sent itself, replays them through its detokenizer, stop strings, tool-call parser
    # and grammar without writing them, and writes what follows. Unsigned: it moves no KV and names no
    # endpoint, so it can do nothing a client's own token-id prompt could not.
    RESUME = "resume"

MIN_KEY_BYTES = 16


class DisaggParamsError(ValueError):
    """The params are missing a field, unsigned, forged or expired (an HTTP 400)."""


class ClusterKeyError(ValueError):
    """The cluster key file is missing, readable by others, or too short."""


class DisaggParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """``disaggregated_params`` of a request or of a ctx answer (see the module doc)."""

    # Kept a str on the wire's way in, so that an unknown type is the 400 ``validate_type`` words.
    request_type: str
    ctx_request_id: str | None = None  # the ctx engine's request id, a decimal string
    kv_endpoint: str | None = None  # tcp://host:port of the ctx engine's KV-transfer agent
    num_tokens: int | None = None  # prompt tokens whose KV is parked on the ctx engine
    first_token_id: int | None = None
    expires_at: float | None = None  # unix time: the ctx engine frees the parked KV then
    signature: str | None = None  # hex HMAC-SHA256 (module doc)
    prompt_token_ids: list[int] | None = None  # generation_only: never re-tokenized
    finished: bool = False  # ctx answer: the first token ended the request; no gen leg, nothing parked
    # ctx answer -> gen leg: the first token's logprobs when the request asks for logprobs, so the
    # gen leg reports every token's. Not signed: it only reports, the engine never reads it.
    first_token_logprobs: TokenLogprobs | None = None
    # ctx answer -> gen leg: the prompt logprobs the ctx leg computed when the request asks for them
    # (its gen leg reports these and its engine computes none). Not signed: it only reports.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # ctx answer -> gen leg: the ctx engine's prefix-cache hits, which the gen leg reports as the
    # request's cached prompt tokens (api.disaggregation). Not signed: it only reports.
    num_cached_tokens: int | None = None
    # context_only leg that only parks its prompt's KV for another worker's ctx leg (the KV pool,
    # ``orchestrator.kv_pool``): any role serves it, as every engine keeps a prefix cache.
    prefix_export: bool = False
    # context_only leg: an export's answer (signed, with its prompt ids) naming where the leading
    # blocks of this prompt are parked: pulled instead of computed.
    kv_prefix: DisaggParams | None = None
    # ctx answer of a leg that pulled a kv_prefix: the blocks pulled and how long it took, which the
    # orchestrator's cost model measures the transfer path by. Not signed: it only reports.
    kv_pulled_blocks: int | None = None
    kv_pull_seconds: float | None = None
    # resume: the output tokens the client's stream already holds (with ``prompt_token_ids``), and
    # the answer's id and creation time as its events carried them (the resumed events carry the same).
    output_token_ids: list[int] | None = None
    response_id: str | None = None
    created: int | None = None

    def validate_type(self) -> None:
        if self.request_type not in tuple(RequestType):
            raise DisaggParamsError(
                f"disaggregated_params.request_type must be {', '.join(repr(t.value) for t in RequestType)}, "
                f"got {self.request_type!r}")
        if self.request_type == RequestType.RESUME and (not self.prompt_token_ids or not self.output_token_ids):
            raise DisaggParamsError("disaggregated_params for resume need prompt_token_ids and output_token_ids")


def prompt_hash(prompt_token_ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(prompt_token_ids)}q", *prompt_token_ids)).hexdigest()


def sign_params(key: bytes, ctx_request_id: str, kv_endpoint: str, num_tokens: int, first_token_id: int,
                expires_at: float, prompt_token_ids: list[int]) -> str:
    message = msgspec.msgpack.encode(
        [ctx_request_id, kv_endpoint, num_tokens, first_token_id, expires_at, prompt_hash(prompt_token_ids)])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signed_params(key: bytes, ctx_request_id: str, kv_endpoint: str, num_tokens: int, first_token_id: int,
                  expires_at: float, prompt_token_ids: list[int]) -> DisaggParams:
    """The ``context_only`` params of a ctx answer, signed."""
    signature = sign_params(key, ctx_request_id, kv_endpoint, num_tokens, first_token_id, expires_at,
                            prompt_token_ids)
    return DisaggParams(RequestType.CONTEXT_ONLY, ctx_request_id, kv_endpoint, num_tokens, first_token_id, expires_at,
                        signature, list(prompt_token_ids))


def verify_params(key: bytes, params: DisaggParams, now: float | None = None) -> list[int]:
    """Check a ``generation_only`` request's params; its prompt ids. Raises DisaggParamsError."""
    ctx_request_id, kv_endpoint, num_tokens = params.ctx_request_id, params.kv_endpoint, params.num_tokens
    first_token_id, expires_at, signature = params.first_token_id, params.expires_at, params.signature
    prompt = params.prompt_token_ids
    if (ctx_request_id is None or kv_endpoint is None or num_tokens is None or first_token_id is None
            or expires_at is None or signature is None or prompt is None):
        missing = [name for name in ("ctx_request_id", "kv_endpoint", "num_tokens", "first_token_id", "expires_at",
                                     "signature", "prompt_token_ids") if getattr(params, name) is None]
        raise DisaggParamsError(f"disaggregated_params for generation_only lack {', '.join(missing)}")
    expected = sign_params(key, ctx_request_id, kv_endpoint, num_tokens, first_token_id, expires_at, prompt)
    if not hmac.compare_digest(expected, signature):
        raise DisaggParamsError("disaggregated_params.signature does not check under the cluster key")
    if not ctx_request_id.isdigit() or not kv_endpoint.startswith("tcp://"):
        raise DisaggParamsError("disaggregated_params name an invalid ctx request id or KV endpoint")
    if num_tokens != len(prompt):
        raise DisaggParamsError(
            f"disaggregated_params.num_tokens is {num_tokens} but the prompt has {len(prompt)} tokens")
    if expires_at <= (time.time() if now is None else now):
        raise DisaggParamsError("disaggregated_params expired: the ctx worker has freed that KV")
    return prompt


def load_cluster_key(path: str | Path) -> bytes:
    """The key in ``path``: a file of mode 0600 (no group or other bits), hex or raw bytes."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise ClusterKeyError(f"cannot read the cluster key file {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterKeyError(f"the cluster key file {path} has mode {stat.S_IMODE(mode):o}; it must be 0600")
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = data  # raw bytes
    if len(key) < MIN_KEY_BYTES:
        raise ClusterKeyError(f"the cluster key in {path} has {len(key)} bytes; at least {MIN_KEY_BYTES} needed")
    return key
