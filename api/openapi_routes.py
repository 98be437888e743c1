"""What each of a worker's routes takes and answers: the ``RouteDoc`` table of ``/openapi.json``.

Grouped so that the orchestrator documents the same client surface from the
same entries (``orchestrator.openapi_routes``). Every frontend of a worker
documents the whole worker (the launcher-owned routes too: an attached
frontend forwards them), so ``/openapi.json`` is the same whichever answers.
"""

from __future__ import annotations

from typing import Any

from api.openapi import RouteDoc
from api.openapi_types import (
    AnthropicMessage,
    BatchList,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    CreateBatchRequest,
    DeletedBatch,
    DeletedResponse,
    DetokenizeResult,
    EmptyBody,
    Health,
    InputTokens,
    MessageBatch,
    MessageStreamEvent,
    ModelCard,
    ModelList,
    ProfileStatus,
    ResponseItemList,
    ResponseObject,
    ResponseStreamEvent,
    TokenizeResult,
    Version,
    WorkerInfo,
)
from api.responses.schemas import ResponsesRequest
from api.schemas_anthropic import CountTokensRequest, MessagesRequest
from api.schemas_openai import ChatCompletionRequest, CompletionRequest
from api.tokenize_api import DetokenizeRequest, TokenizeRequest
from workers.engine.kv_events import KVCacheSnapshot

__all__ = ["GENERATION_DOCS", "SURFACE_DOCS", "BATCH_DOCS", "WORKER_DOCS", "PROMETHEUS_DOC", "JSONL"]

JSONL = "application/x-jsonl"
Records = list[dict[str, Any]]  # per-step stats and per-request perf records: see docs/operations.md

_OPENAI, _ANTHROPIC, _RESPONSES = "OpenAI", "Anthropic", "Responses"

# The inference routes: the orchestrator runs them through its flow, a worker through its engine.
GENERATION_DOCS: tuple[RouteDoc, ...] = (
    RouteDoc("POST", "/v1/chat/completions", "Create a chat completion", _OPENAI, ChatCompletionRequest,
             ChatCompletion, stream_event=ChatCompletionChunk),
    RouteDoc("POST", "/v1/completions", "Create a completion", _OPENAI, CompletionRequest, Completion,
             stream_event=CompletionChunk),
    RouteDoc("POST", "/v1/messages", "Create a message", _ANTHROPIC, MessagesRequest, AnthropicMessage,
             stream_event=MessageStreamEvent, anthropic=True),
    RouteDoc("POST", "/v1/responses", "Create a response", _RESPONSES, ResponsesRequest, ResponseObject,
             stream_event=ResponseStreamEvent),
    RouteDoc("GET", "/v1/responses/{response_id}", "Retrieve a stored response", _RESPONSES,
             response=ResponseObject),
    RouteDoc("DELETE", "/v1/responses/{response_id}", "Delete a stored response", _RESPONSES,
             response=DeletedResponse),
    RouteDoc("GET", "/v1/responses/{response_id}/input_items", "List a stored response's input items",
             _RESPONSES, response=ResponseItemList),
)

# Answered from the tokenizer and the model's facts, with no engine step.
SURFACE_DOCS: tuple[RouteDoc, ...] = (
    RouteDoc("POST", "/v1/messages/count_tokens", "Count a message's input tokens", _ANTHROPIC,
             CountTokensRequest, InputTokens, anthropic=True),
    RouteDoc("GET", "/v1/models", "List the served model", _OPENAI, response=ModelList),
    RouteDoc("GET", "/v1/models/{model_id}", "Retrieve the served model's card", _OPENAI, response=ModelCard),
    RouteDoc("POST", "/tokenize", "Tokenize a prompt or chat messages (vLLM's shape)", "Tokenizer",
             TokenizeRequest, TokenizeResult),
    RouteDoc("POST", "/detokenize", "Turn token ids into text (vLLM's shape)", "Tokenizer", DetokenizeRequest,
             DetokenizeResult),
    RouteDoc("GET", "/version", "The server's version", "Operations", response=Version),
)

_BATCHES = "/v1/messages/batches"
BATCH_DOCS: tuple[RouteDoc, ...] = (
    RouteDoc("POST", _BATCHES, "Create a message batch", _ANTHROPIC, CreateBatchRequest, MessageBatch,
             anthropic=True),
    RouteDoc("GET", _BATCHES, "List message batches (limit, before_id, after_id)", _ANTHROPIC,
             response=BatchList, anthropic=True),
    RouteDoc("GET", _BATCHES + "/{batch_id}", "Retrieve a message batch", _ANTHROPIC, response=MessageBatch,
             anthropic=True),
    RouteDoc("DELETE", _BATCHES + "/{batch_id}", "Delete an ended message batch", _ANTHROPIC,
             response=DeletedBatch, anthropic=True),
    RouteDoc("GET", _BATCHES + "/{batch_id}/results", "An ended batch's results, one JSON object a line",
             _ANTHROPIC, media_type=JSONL, anthropic=True),
    RouteDoc("POST", _BATCHES + "/{batch_id}/cancel", "Cancel a message batch", _ANTHROPIC, EmptyBody,
             MessageBatch, anthropic=True),
)

PROMETHEUS_DOC = RouteDoc("GET", "/prometheus/metrics", "Prometheus exposition", "Operations",
                          media_type="text/plain")

_OPS = "Operations"
WORKER_DOCS: tuple[RouteDoc, ...] = (
    *GENERATION_DOCS, *SURFACE_DOCS, *BATCH_DOCS, PROMETHEUS_DOC,
    RouteDoc("GET", "/health", "200 while the engine is alive and responsive, 503 otherwise", _OPS,
             response=Health),
    RouteDoc("GET", "/worker_info", "What an orchestrator needs to route to this worker", _OPS,
             response=WorkerInfo),
    RouteDoc("GET", "/metrics", "The engine's per-step stats since the last poll (drained)", _OPS,
             response=Records),
    RouteDoc("GET", "/kv_cache_events", "KV-cache events since the last poll (drained)", _OPS,
             response=list[Any]),
    RouteDoc("POST", "/kv_cache_events", "KV-cache events since the last poll (drained)", _OPS, EmptyBody,
             list[Any]),
    RouteDoc("GET", "/kv_cache_snapshot", "Every cached block hash, the id of the next KV event and the pool size "
             "(not drained): what a router resynchronises from after missed events", _OPS,
             response=KVCacheSnapshot),
    RouteDoc("POST", "/start_profile", "Start the engine's profiler", _OPS, EmptyBody, ProfileStatus),
    RouteDoc("POST", "/stop_profile", "Stop the engine's profiler and write its trace", _OPS, EmptyBody,
             ProfileStatus),
    RouteDoc("GET", "/perf_metrics", "Per-request timing records since the last poll (drained)", _OPS,
             response=Records),
)
