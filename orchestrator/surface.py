"""Client routes the orchestrator answers itself, with no worker leg: the rest of a worker's surface.

    POST /v1/messages/count_tokens   Anthropic: {"input_tokens"}
    POST /tokenize, POST /detokenize vLLM's shapes (``api.tokenize_api``)
    GET  /v1/models                  the served model, with ``max_model_len``
    GET  /v1/models/{model_id}       ... one model card; 404 (``model_not_found``) for any other id
    GET  /version                    the version every worker reports

The orchestrator tokenizes with the workers' own code and template, so each
answer is the one a worker would give. ``max_model_len`` is the smallest
that any known worker reported in /worker_info (a prompt must fit wherever it
is routed); null until the first worker has been heard from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.anthropic_api import message_prompt_ids
from api.schemas_anthropic import CountTokensRequest
from api.serving import FrontendConfig
from api.tokenize_api import TokenizerSurface, detokenize, model_card, retrieve_model, tokenize
from api.tool_prompt import PromptContext

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator

__all__ = ["count_tokens", "tokenize_route", "detokenize_route", "list_models", "retrieve_model_route",
           "version", "max_model_len", "vocab_size"]

VERSION = FrontendConfig.version  # what every worker's /version reports


def _json(payload: Any) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


def max_model_len(orch: Orchestrator) -> int | None:
    known = [w.max_model_len for w in orch.view.workers.values() if w.max_model_len is not None]
    return min(known) if known else None


def vocab_size(orch: Orchestrator) -> int | None:
    """The smallest engine vocabulary any known worker reported (None until one has)."""
    known = [w.vocab_size for w in orch.view.workers.values() if w.vocab_size is not None]
    return min(known) if known else None


def _surface(orch: Orchestrator) -> TokenizerSurface:
    tokenizer = orch.tokenizer
    return TokenizerSurface(tokenizer, orch.config.model_name, max_model_len(orch),
                            tokenizer.backend.get_vocab_size(with_added_tokens=True))


async def count_tokens(orch: Orchestrator, request: Request) -> Response:
    body = msgspec.json.decode(await request.body(), type=CountTokensRequest)
    _surface(orch).check_model(body.model)
    ids = message_prompt_ids(PromptContext.for_tokenizer(orch.tokenizer), body)
    return _json({"input_tokens": len(ids)})


async def tokenize_route(orch: Orchestrator, request: Request) -> Response:
    return _json(tokenize(_surface(orch), await request.body()))


async def detokenize_route(orch: Orchestrator, request: Request) -> Response:
    return _json(detokenize(_surface(orch), await request.body()))


async def list_models(orch: Orchestrator, request: Request) -> Response:
    return _json({"object": "list", "data": [model_card(orch.config.model_name, max_model_len(orch))]})


async def retrieve_model_route(orch: Orchestrator, request: Request) -> Response:
    return _json(retrieve_model(_surface(orch), request.path_params["model_id"]))


async def version(orch: Orchestrator, request: Request) -> Response:
    return _json({"version": VERSION})
