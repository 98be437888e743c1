"""What the orchestrator reads from a client body: the prompt's token ids, the session,
and the two legs' bodies (``workers.http_protocol``).

The orchestrator validates and tokenizes once, with the frontends' own code
(``orchestrator.validation``: the same checks and chat template rendering the
workers use), before any worker is chosen; it needs token ids to route by
prefix, and the ctx leg then gets those ids (every API), so no worker renders or tokenizes the
body again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from api.anthropic_api import MessagesApi
from api.errors import InvalidRequestError
from api.openai_api import ChatApi, CompletionApi
from api.prepare import ApiRequest, check_request
from api.request_fields import check_fields
from api.schemas_anthropic import MessagesRequest
from api.schemas_openai import ChatCompletionRequest, CompletionRequest
from orchestrator.validation import RequestValidator
from workers.disagg_params import DisaggParams, RequestType
from workers.http_protocol import CTX_DROPPED, CtxLegFields, GenLegFields, with_fields

__all__ = ["ParsedRequest", "parse_request", "ctx_leg_body", "gen_leg_body", "API_PATHS"]

API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages"}


@dataclass(frozen=True)
class ParsedRequest:
    api: str
    """completions | chat | messages."""
    body: dict[str, Any]
    prompt_ids: list[int]
    stream: bool
    session_id: str | None
    max_tokens: int | None
    raw: bytes = b""
    """The client's body as it came: the gen leg forwards these bytes (with its params appended)."""
    ignored_fields: tuple[str, ...] = ()
    """Unknown top-level fields of the client's body, named in the answer's ``Warning`` header."""
    ctx_can_answer: bool = True
    """A ctx leg that finished on its first token is the whole answer (not with ``n`` > 1: the ctx leg
    makes choice 0 only; nor with ``echo``: the ctx leg's prompt is token ids)."""
    scores_prompt: bool = False
    """It asks for prompt logprobs (``echo`` with ``logprobs``, ``prompt_logprobs``): its ctx leg computes
    the whole prompt, so a prefix parked elsewhere (the KV pool) would not be used."""
    block_hashes: dict[tuple[int, int], list[int]] = field(default_factory=dict, compare=False)
    """The prompt's block hashes by (block size, seed), computed once for all routing decisions."""

    @property
    def path(self) -> str:
        return API_PATHS[self.api]


def parse_request(api: str, raw: bytes, validator: RequestValidator, session_header: str | None) -> ParsedRequest:
    """The body checked whole as a worker would check it (raises the API's errors), and its prompt ids."""
    body = msgspec.json.decode(raw)
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    if "disaggregated_params" in body:
        raise InvalidRequestError("disaggregated_params is set by the orchestrator, not by clients",
                                  param="disaggregated_params")
    request: ApiRequest
    if api == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # one prompt in a list: the ctx leg sends its ids
        request = CompletionApi(msgspec.convert({**body, "prompt": prompt}, CompletionRequest))
    elif api == "chat":
        request = ChatApi(msgspec.convert(body, ChatCompletionRequest))
    else:
        request = MessagesApi(msgspec.convert(body, MessagesRequest))
    ignored = check_fields(body, type(request.body), validator.config.strict_request_fields)
    valid = check_request(validator, request)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ParsedRequest(api, body, valid.prompt_ids, bool(body.get("stream", False)),
                         _session_id(api, body, session_header), max_tokens if isinstance(max_tokens, int) else None,
                         raw, ignored, (body.get("n") or 1) == 1 and not body.get("echo"),
                         _scores_prompt(api, body))


def _scores_prompt(api: str, body: dict[str, Any]) -> bool:
    echoed = api == "completions" and bool(body.get("echo")) and body.get("logprobs") is not None
    return echoed or body.get("prompt_logprobs") is not None


def _session_id(api: str, body: dict[str, Any], header: str | None) -> str | None:
    if header:
        return header
    if api == "messages":
        metadata = body.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
    else:
        user = body.get("user")
    return user if isinstance(user, str) and user else None


def ctx_leg_body(request: ParsedRequest, kv_prefix: DisaggParams | None = None) -> bytes:
    """The context_only leg: one token, no streaming, the orchestrator's prompt ids in its params
    (every API: the ctx worker renders and tokenizes nothing again, and does not echo them back).
    ``kv_prefix``: where the prompt's leading blocks are parked for it (``orchestrator.kv_pool``)."""
    kept = {k: v for k, v in request.body.items() if k not in CTX_DROPPED}
    prompt = kept.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        kept["prompt"] = prompt[0]  # one prompt in a list (completions): one prompt, as ``parse_request`` read it
    params = DisaggParams(RequestType.CONTEXT_ONLY, kv_prefix=kv_prefix, prompt_token_ids=request.prompt_ids)
    return with_fields(msgspec.json.encode(kept), CtxLegFields(params))


def gen_leg_body(request: ParsedRequest, params: DisaggParams | None) -> bytes:
    """A gen leg: the client's own bytes, with ``params`` (generation_only, resume) when given; a
    normal request without."""
    raw = request.raw or msgspec.json.encode(request.body)
    return raw if params is None else with_fields(raw, GenLegFields(params))

