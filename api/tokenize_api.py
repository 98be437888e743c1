"""Tokenizer and model routes, vLLM's shapes; served by every worker frontend and the orchestrator.

    POST /tokenize    {"model"?, "prompt", "add_special_tokens"?: true}
                      {"model"?, "messages", "add_generation_prompt"?: true, "tools"?, "chat_template_kwargs"?}
                      -> {"tokens": [...], "count", "max_model_len", "token_strs"}
    POST /detokenize  {"model"?, "tokens": [...]} -> {"prompt"}
    GET  /v1/models/{model_id}                   -> the model card with ``max_model_len``

``messages`` are rendered exactly as /v1/chat/completions renders them
(``api.openai_api.chat_prompt_ids``), so ``count`` is the chat request's
``prompt_tokens``. The chat template writes its own special tokens: with
``messages``, ``add_special_tokens: true`` is a 400 rather than a second BOS.
``model`` is optional (vLLM's rule); when given it must be the served one.
Handlers take a ``TokenizerSurface`` and raw bytes, so the orchestrator, which
has no engine, answers them with its own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.errors import InvalidRequestError, ModelNotFoundError
from api.openai_api import chat_prompt_ids
from api.schemas_openai import ChatCompletionRequest
from api.serving import ServingContext
from api.tokenizer import Tokenizer
from api.tool_prompt import PromptContext

__all__ = ["TokenizerSurface", "TokenizeRequest", "DetokenizeRequest", "tokenize", "detokenize", "model_card",
           "retrieve_model", "tokenize_route", "detokenize_route", "retrieve_model_route"]


@dataclass(frozen=True)
class TokenizerSurface:
    """What these routes read: the tokenizer, the served model and its limits."""

    tokenizer: Tokenizer
    model_name: str
    max_model_len: int | None
    """None: not known yet (an orchestrator that has not heard from a worker)."""
    vocab_size: int

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"the model {model!r} does not exist; this server serves "
                                     f"{self.model_name!r}", param="model")


class TokenizeRequest(msgspec.Struct, frozen=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # checked as /v1/chat/completions checks them
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, frozen=True):
    tokens: list[int]
    model: str | None = None


def _prompt_ids(surface: TokenizerSurface, body: TokenizeRequest, raw: bytes) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        return surface.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    if body.add_special_tokens:
        raise InvalidRequestError("add_special_tokens must be false with messages: the chat template writes "
                                  "the special tokens itself", param="add_special_tokens")
    # The whole body as a chat request: tools, chat_template_kwargs, ... render as they would there.
    chat = msgspec.convert({**msgspec.json.decode(raw), "model": surface.model_name}, ChatCompletionRequest)
    return chat_prompt_ids(PromptContext.for_tokenizer(surface.tokenizer), chat)


def tokenize(surface: TokenizerSurface, raw: bytes) -> dict[str, Any]:
    body = msgspec.json.decode(raw, type=TokenizeRequest)
    surface.check_model(body.model)
    ids = _prompt_ids(surface, body, raw)
    token_strs = [surface.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": surface.max_model_len, "tokens": ids, "token_strs": token_strs}


def detokenize(surface: TokenizerSurface, raw: bytes) -> dict[str, Any]:
    body = msgspec.json.decode(raw, type=DetokenizeRequest)
    surface.check_model(body.model)
    for i, token_id in enumerate(body.tokens):
        if not 0 <= token_id < surface.vocab_size:
            raise InvalidRequestError(f"tokens[{i}] = {token_id} is outside the vocabulary [0, {surface.vocab_size})",
                                      param="tokens")
    return {"prompt": surface.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def model_card(model_name: str, max_model_len: int | None) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "disagg", "root": model_name,
            "max_model_len": max_model_len}


def retrieve_model(surface: TokenizerSurface, model_id: str) -> dict[str, Any]:
    """GET /v1/models/{model_id}: 404 (OpenAI's ``model_not_found``) for any other id."""
    if model_id != surface.model_name:
        raise ModelNotFoundError(f"the model {model_id!r} does not exist; this server serves {surface.model_name!r}",
                            param="model")
    return model_card(surface.model_name, surface.max_model_len)


# -- a worker frontend's handlers (frontends.app) ---------------------------------------------------


def _surface(ctx: ServingContext) -> TokenizerSurface:
    return TokenizerSurface(ctx.tokenizer, ctx.model_name, ctx.client.max_model_len, ctx.client.vocab_size)


def _json(payload: Any) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


async def tokenize_route(ctx: ServingContext, request: Request) -> Response:
    return _json(tokenize(_surface(ctx), await request.body()))


async def detokenize_route(ctx: ServingContext, request: Request) -> Response:
    return _json(detokenize(_surface(ctx), await request.body()))


async def retrieve_model_route(ctx: ServingContext, request: Request) -> Response:
    return _json(retrieve_model(_surface(ctx), request.path_params["model_id"]))
