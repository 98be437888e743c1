"""The worker side of disaggregated serving in a frontend (docs/architecture.md, "A request's path").

A request body's ``disaggregated_params`` (``workers.disagg_params``) turns it
into one leg of a disaggregated request:

- ``context_only`` (ctx or both role): the engine prefills, samples ONE token
  and parks the prompt's KV; the answer is the API's normal non-streaming
  body plus ``disaggregated_params`` (signed: ctx request id, KV endpoint,
  token count, first token, expiry) and ``prompt_token_ids``. When the first
  token ended the request (EOS, a stop token or string) nothing is parked and
  the params say ``finished: true``.
- ``generation_only`` (gen or both role): the params are verified under the
  cluster key BEFORE anything reaches the engine (unsigned, forged or expired:
  400, no connection made); the prompt ids come from the params, never from
  re-tokenizing; the engine pulls the KV and decodes after the first token,
  which the answer's text starts with, so the client sees one seamless answer.
  That first token (the ctx leg's) is the leg's ``early_tokens``: a streamed
  answer sends it as soon as the request is handed to the engine, so neither
  the KV pull nor the gen engine's first step is in the time to first token.
  A pull that fails after that is not an error the client sees: the gen
  engine prefills the prompt itself (``Scheduler.recompute_remote``).

- ``resume`` (gen or both role; a stream migrated from a worker that failed mid-answer,
  ``orchestrator.migration``): the prompt ids and the output tokens the client already holds come
  in the params; the engine prefills both (``AddResumedRequest``) and samples on from the next
  position, and the stream replays the output tokens through the detokenizer, stop strings,
  tool-call parser and encoder without writing them (``generation.replay_start``), so what it
  writes is exactly what the failed worker would have written next. Needs no cluster key.

Cached prompt tokens (usage ``prompt_tokens_details.cached_tokens``,
Anthropic ``cache_read_input_tokens``) are the prompt tokens whose prefill a
prefix cache saved. A disaggregated request's prefill runs on the ctx leg, so
it reports the ctx engine's hits: the ctx answer carries them in
``disaggregated_params.num_cached_tokens`` and the gen leg reports them. The
gen engine's own hits (KV it did not have to pull) count in its perf record
and its ``disagg_prompt_cached_tokens_total``, as every leg's do.

Plain requests never touch this module (the hot path is unchanged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from api.errors import InvalidRequestError
from workers.disagg_params import DisaggParams, DisaggParamsError, RequestType, signed_params, verify_params
from workers.http_protocol import CtxAnswer, Role, with_fields
from workers.protocol import (
    AddContextRequest,
    AddRemoteRequest,
    AddResumedRequest,
    EngineRequest,
    IngressMessage,
    KVTransferStats,
    ParkedKV,
    RemotePrefix,
    RequestOutput,
    TokenLogprobs,
)
from workers.sampling_params import SamplingParams

__all__ = ["DisaggConfig", "DisaggLeg", "start_leg", "engine_params", "add_ctx_fields",
           "add_ctx_fields_json"]

log = logging.getLogger("disagg.disaggregation")


@dataclass(frozen=True)
class DisaggConfig:
    """What a frontend needs to serve disaggregated legs (from the engine handshake and CLI)."""

    role: Role = Role.BOTH
    cluster_key: bytes | None = field(default=None, repr=False)  # None: this worker serves no legs
    kv_park_seconds: float = 60.0
    kv_endpoint: str | None = None
    block_size: int | None = None
    hash_seed: int | None = None


class DisaggLeg:
    """One leg's engine message and its view of the engine outputs: the ``OutputHook``
    (``api.generation``) of its request's generation."""

    def __init__(self, params: DisaggParams, config: DisaggConfig) -> None:
        self.params = params
        self.config = config
        self.is_context = params.request_type == RequestType.CONTEXT_ONLY
        self.is_resume = params.request_type == RequestType.RESUME
        # A ctx leg's prompt as the orchestrator tokenized it: used as is, and not echoed in the answer
        # (the orchestrator holds them; the signature binds them to the gen leg all the same).
        self.given_prompt_ids = list(params.prompt_token_ids) if self.is_context and params.prompt_token_ids \
            else None
        self.request_id: int | None = None  # the engine's request id (the ctx request id of a ctx leg)
        self.kv_parked: ParkedKV | None = None
        self.first_token_id: int | None = None
        self.first_logprobs: TokenLogprobs | None = None  # a ctx leg's first token's, when asked for
        self.num_cached_tokens = 0  # a ctx leg's prefix-cache hits (on its engine's first output)
        self.kv_pull: KVTransferStats | None = None  # a ctx leg's pull of its kv_prefix
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # a ctx leg's, when asked for
        # the gen leg's first token is not reported by its engine
        self._first_pending = not self.is_context and not self.is_resume

    def message(self, request: EngineRequest) -> IngressMessage:
        if self.is_context:
            return AddContextRequest(request, self.config.kv_park_seconds, self._remote_prefix(request))
        if self.is_resume:
            return AddResumedRequest(request, self.replay_tokens())
        first_token_id, ctx_request_id, kv_endpoint = self.kv_source()
        return AddRemoteRequest(request, first_token_id, int(ctx_request_id), kv_endpoint)

    def _remote_prefix(self, request: EngineRequest) -> RemotePrefix | None:
        """A ctx leg's ``kv_prefix`` when start_leg verified it and it is this prompt's prefix (else the
        engine computes the prefix: never a wrong answer, at worst a lost saving)."""
        prefix = self.params.kv_prefix
        if prefix is None or prefix.prompt_token_ids is None or prefix.ctx_request_id is None:
            return None
        if request.sampling_params.prompt_logprobs is not None:  # pulled KV has no logits to score it by
            return None
        prompt, num_tokens = request.prompt_token_ids, len(prefix.prompt_token_ids)
        if num_tokens >= len(prompt) or prompt[:num_tokens] != prefix.prompt_token_ids or prefix.kv_endpoint is None:
            log.warning("a ctx leg's kv_prefix is not a prefix of its prompt: computing it instead")
            return None
        return RemotePrefix(int(prefix.ctx_request_id), prefix.kv_endpoint, num_tokens)

    def signed_prompt_ids(self) -> list[int]:
        """A gen leg's prompt: the ids the ctx leg signed (never re-tokenized); a resumed leg's, unsigned."""
        return list(self.params.prompt_token_ids or ())

    def carried_ids(self) -> list[int]:
        """The tokens past the prompt the engine gets with it: a gen leg's first, a resumed leg's output."""
        return self.replay_tokens() if self.is_resume else [self.kv_source()[0]]

    def replay_tokens(self) -> list[int]:
        """A resumed leg's output tokens, which the client already holds (empty for any other leg)."""
        return list(self.params.output_token_ids or ()) if self.is_resume else []

    def kv_source(self) -> tuple[int, str, str]:
        """A gen leg's first token id, ctx request id and KV endpoint: start_leg verified them set."""
        params = self.params
        if params.first_token_id is None or params.ctx_request_id is None or params.kv_endpoint is None:
            raise AssertionError("a generation_only leg is used before verify_params checked it")
        return params.first_token_id, params.ctx_request_id, params.kv_endpoint

    def early_tokens(self) -> tuple[list[int], list[TokenLogprobs] | None] | None:
        """A gen leg's first token, the ctx leg's, with its logprobs when asked for; ``on_output``
        then reports only the engine's tokens."""
        if not self._first_pending:
            return None
        self._first_pending = False
        first_token_id, _, _ = self.kv_source()
        first_logprobs = self.params.first_token_logprobs
        return [first_token_id], None if first_logprobs is None else [first_logprobs]

    def on_output(self, output: RequestOutput) -> RequestOutput:
        """Called on every output before the generation reads it."""
        self.request_id = output.request_id
        if self.is_context:
            self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
            if output.new_token_ids and self.first_token_id is None:
                self.first_token_id = output.new_token_ids[0]
                self.first_logprobs = output.new_logprobs[0] if output.new_logprobs else None
            if output.prompt_logprobs is not None:
                self.prompt_logprobs = output.prompt_logprobs
            if output.kv_parked is not None:
                self.kv_parked = output.kv_parked
            if output.kv_transfer is not None and not output.kv_transfer.recomputed:
                self.kv_pull = output.kv_transfer
            return output
        if self._first_pending and output.finish_reason != "abort":
            self._first_pending = False
            logprobs, first_logprobs = output.new_logprobs, self.params.first_token_logprobs
            if logprobs is not None and first_logprobs is not None:
                logprobs = [first_logprobs, *logprobs]
            return msgspec.structs.replace(output, new_token_ids=[self.params.first_token_id, *output.new_token_ids],
                                           new_logprobs=logprobs)
        return output

    def carried_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """A gen leg's prompt logprobs, the ctx leg's (its own engine computes none: ``engine_params``)."""
        return self.params.prompt_logprobs if not self.is_context and not self.is_resume else None

    def usage_cached_tokens(self, own: int) -> int:
        """The cached prompt tokens usage reports (module doc); ``own``: this engine's hits."""
        if not self.is_context and self.params.num_cached_tokens is not None:
            return self.params.num_cached_tokens
        if self.is_resume:  # its prefill may hit its own output's blocks: those are no prompt tokens
            return min(own, len(self.params.prompt_token_ids or ()))
        return own

    def answer_fields(self, prompt_token_ids: list[int]) -> CtxAnswer:
        """The ctx answer's own fields: its ``disaggregated_params`` and ``prompt_token_ids`` (left out when
        the leg came with them: the sender holds them)."""
        echoed = None if self.given_prompt_ids is not None else list(prompt_token_ids)
        if self.kv_parked is None or self.request_id is None or self.first_token_id is None:
            finished = DisaggParams(RequestType.CONTEXT_ONLY, finished=True, first_token_id=self.first_token_id)
            return CtxAnswer(finished, echoed)
        assert self.config.cluster_key is not None and self.config.kv_endpoint is not None
        params = signed_params(self.config.cluster_key, str(self.request_id), self.config.kv_endpoint,
                               self.kv_parked.num_tokens, self.first_token_id, self.kv_parked.expires_at,
                               prompt_token_ids)
        pull = self.kv_pull
        params = msgspec.structs.replace(
            params, prompt_token_ids=None,  # top-level in the answer
            first_token_logprobs=self.first_logprobs, num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            kv_pulled_blocks=None if pull is None else pull.num_blocks,
            kv_pull_seconds=None if pull is None else pull.seconds)
        return CtxAnswer(params, echoed)


def start_leg(config: DisaggConfig | None, params: DisaggParams | None, stream: bool) -> DisaggLeg | None:
    """Check a request's ``disaggregated_params`` against this worker's ``config`` (None: it serves
    no legs); None for a plain request.

    A ``generation_only`` leg is verified here, before its prompt is read or
    anything is sent to the engine.
    """
    if params is None:
        return None
    config = config or DisaggConfig()
    try:
        params.validate_type()
    except DisaggParamsError as exc:
        raise InvalidRequestError(str(exc), param="disaggregated_params") from exc
    if params.request_type == RequestType.RESUME:
        if config.role == Role.CTX:
            raise InvalidRequestError("this is a ctx worker: it does not serve resume requests",
                                      param="disaggregated_params")
        if not stream:  # the client holds the start of the answer only when it streams
            raise InvalidRequestError("a resume request must stream", param="stream")
        return DisaggLeg(params, config)
    if config.cluster_key is None or config.kv_endpoint is None:
        raise InvalidRequestError("this worker does not serve disaggregated requests (no cluster key)",
                                  param="disaggregated_params")
    wanted = Role.CTX if params.request_type == RequestType.CONTEXT_ONLY else Role.GEN
    if config.role not in (Role.BOTH, wanted) and not params.prefix_export:
        raise InvalidRequestError(f"this is a {config.role} worker: it does not serve {params.request_type} "
                                  f"requests", param="disaggregated_params")
    if params.request_type == RequestType.CONTEXT_ONLY and stream:
        raise InvalidRequestError("a context_only request cannot stream", param="stream")
    if params.request_type == RequestType.GENERATION_ONLY:
        try:
            verify_params(config.cluster_key, params)
        except DisaggParamsError as exc:
            raise InvalidRequestError(str(exc), param="disaggregated_params") from exc
    elif params.kv_prefix is not None:
        try:
            verify_params(config.cluster_key, params.kv_prefix)
        except DisaggParamsError as exc:  # e.g. expired on the way: the prefix is computed here instead
            log.warning("a ctx leg's kv_prefix is unusable (%s): computing it instead", exc)
            params = msgspec.structs.replace(params, kv_prefix=None)
    return DisaggLeg(params, config)


def engine_params(leg: DisaggLeg, params: SamplingParams) -> SamplingParams:
    """A ctx leg samples exactly one token (min_tokens capped so EOS stays masked as it would be); the
    prompt logprobs are the ctx leg's to compute: a gen leg carries them, a resumed one's client has them."""
    if leg.is_context:
        return msgspec.structs.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    params = msgspec.structs.replace(params, prompt_logprobs=None)
    if leg.is_resume:
        if params.max_tokens <= len(leg.replay_tokens()):
            raise InvalidRequestError("a resume request needs max_tokens above its output_token_ids' count",
                                      param="max_tokens")
        return params
    if params.max_tokens < 2:
        raise InvalidRequestError("a generation_only request needs max_tokens >= 2: the first token is the ctx "
                                  "leg's", param="max_tokens")
    return params


def add_ctx_fields(payload: dict[str, Any], leg: DisaggLeg | None, prompt_token_ids: list[int]) -> dict[str, Any]:
    """A ctx leg's answer: the API body plus ``disaggregated_params`` and ``prompt_token_ids``."""
    if leg is not None and leg.is_context:
        fields = leg.answer_fields(prompt_token_ids)
        payload["disaggregated_params"] = fields.disaggregated_params  # encoded with the payload (msgspec)
        if fields.prompt_token_ids is not None:
            payload["prompt_token_ids"] = fields.prompt_token_ids
    return payload


def add_ctx_fields_json(body: bytes, leg: DisaggLeg | None, prompt_token_ids: list[int]) -> bytes:
    """``add_ctx_fields`` on an already encoded body (the Anthropic encoder writes bytes): appended to
    its bytes, which are not decoded again."""
    if leg is None or not leg.is_context:
        return body
    return with_fields(body, leg.answer_fields(prompt_token_ids))
