"""What the orchestrator reads from a client body: the prompt's token ids, the session,
and the two legs' bodies.

The orchestrator tokenizes once, with the frontends' own code (the same chat
template rendering the workers use), because it needs token ids to route by
prefix; for /v1/completions the ctx leg then gets those ids as its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from frontends.anthropic_api import message_prompt_ids
from frontends.errors import InvalidRequestError
from frontends.openai_api import chat_prompt_ids
from frontends.schemas_anthropic import MessagesRequest
from frontends.schemas_openai import ChatCompletionRequest
from frontends.tokenizer import Tokenizer
from frontends.tool_prompt import PromptContext

__all__ = ["ParsedRequest", "parse_request", "ctx_body", "gen_body", "client_answer", "API_PATHS"]


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

    @property
    def path(self) -> str:
        return API_PATHS[self.api]



def parse_request(api: str, raw: bytes, tokenizer: Tokenizer, session_header: str | None) -> ParsedRequest:
    body = msgspec.json.decode(raw)
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    if "disaggregated_params" in body:
        raise InvalidRequestError("disaggregated_params is set by the orchestrator, not by clients",
                                  param="disaggregated_params")
    holder = PromptContext.for_tokenizer(tokenizer)  # what chat_prompt_ids/message_prompt_ids read
    if api == "completions":
        prompt_ids = _completion_prompt_ids(body.get("prompt"), tokenizer)
    elif api == "chat":
        prompt_ids = chat_prompt_ids(holder, msgspec.convert(body, ChatCompletionRequest))  # type: ignore[arg-type]
    else:
        prompt_ids = message_prompt_ids(holder, msgspec.convert(body, MessagesRequest))  # type: ignore[arg-type]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ParsedRequest(api, body, prompt_ids, bool(body.get("stream", False)),
                         _session_id(api, body, session_header), max_tokens if isinstance(max_tokens, int) else None)


def _completion_prompt_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise InvalidRequestError("prompt must be a string or a list of token ids (one prompt per request)",
                              param="prompt")


def _session_id(api: str, body: dict[str, Any], header: str | None) -> str | None:
    if header:
        return header
    if api == "messages":
        metadata = body.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
    else:
        user = body.get("user")
    return user if isinstance(user, str) and user else None


def ctx_body(request: ParsedRequest) -> dict[str, Any]:
    """The context_only leg: one token, no streaming; completions get the token ids."""
    body = {k: v for k, v in request.body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    body["max_tokens"] = 1
    body["stream"] = False
    if request.api == "completions":
        body["prompt"] = request.prompt_ids
    body["disaggregated_params"] = {"request_type": "context_only"}
    return body


def gen_body(request: ParsedRequest, ctx_answer: dict[str, Any]) -> dict[str, Any] | None:
    """The generation_only leg, or None when the ctx answer carries no usable params."""
    params = ctx_answer.get("disaggregated_params")
    prompt_ids = ctx_answer.get("prompt_token_ids")
    if not isinstance(params, dict) or not isinstance(prompt_ids, list):
        return None
    body = dict(request.body)
    body["disaggregated_params"] = {**params, "request_type": "generation_only", "prompt_token_ids": prompt_ids}
    return body


def client_answer(ctx_answer: dict[str, Any]) -> dict[str, Any]:
    """A ctx answer shown to the client as is (the request finished on its first token)."""
    return {k: v for k, v in ctx_answer.items() if k not in ("disaggregated_params", "prompt_token_ids")}

