"""What each of the orchestrator's routes takes and answers: the ``RouteDoc`` table of its ``/openapi.json``.

The client surface is the workers' own entries (``api.openapi_routes``):
the orchestrator answers the same requests with the same bodies. The rest is
the cluster's: health, routing state, metrics and worker registration, whose
answers (written as dicts by their handlers) the Structs below describe.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from api.batches.openai_schemas import (
    CreateBatchBody,
    FileDeleted,
    FileList,
    FileObject,
    FileUpload,
    OpenAIBatch,
    OpenAIBatchList,
)
from api.openapi import RouteDoc
from api.openapi_routes import BATCH_DOCS, GENERATION_DOCS, PROMETHEUS_DOC, SURFACE_DOCS
from api.openapi_types import EmptyBody
from orchestrator.config import LiveSettings
from orchestrator.state_protocol import (
    DrainAck,
    Ok,
    Registration,
    RegistrationAck,
    SettingsAck,
    WorkerIdBody,
    WorkerRef,
)

__all__ = ["ORCHESTRATOR_DOCS", "OPENAI_BATCH_DOCS", "DESCRIPTION", "OPEN_PATHS"]

DESCRIPTION = ("The one URL of a disagg deployment: OpenAI, Anthropic and Responses APIs over context and "
               "generation workers.")
# With an API key configured, what needs none: the readiness probe (``orchestrator.app``'s protected=False).
# Scrapers present the key (``orchestrator.prometheus_sd`` writes it into Prometheus' scrape config).
OPEN_PATHS = frozenset({"/health"})


class OrchestratorHealth(msgspec.Struct):
    status: Literal["ok"]
    process_index: int
    """Which of the orchestrator's processes answered."""
    processes: int


class ClusterInfo(msgspec.Struct, kw_only=True):
    model: str
    process_index: int
    processes: int
    state_version: int
    ctx_router: dict[str, Any]
    gen_router: dict[str, Any]
    conditional: dict[str, Any]
    workers: list[dict[str, Any]]
    """Each worker's record (``orchestrator.registry.WorkerRecord``) with its load and cached blocks."""


class JoinedPerfRecords(msgspec.Struct):
    records: list[dict[str, Any]]
    """Each request's orchestrator timings with its ctx and gen workers' records on one clock."""


class WorkerList(msgspec.Struct):
    workers: list[dict[str, Any]]
    """Each worker's record (``orchestrator.registry.WorkerRecord``)."""


_FILES, _BATCHES = "OpenAI Files", "OpenAI Batches"
OPENAI_BATCH_DOCS: tuple[RouteDoc, ...] = (
    RouteDoc("POST", "/v1/files", "Upload a file (purpose batch: a batch's JSONL input; at most max_upload_bytes)",
             _FILES, FileUpload, FileObject, request_media_type="multipart/form-data"),
    RouteDoc("GET", "/v1/files", "List files (purpose, limit, order, after)", _FILES, response=FileList),
    RouteDoc("GET", "/v1/files/{file_id}", "Retrieve a file's description", _FILES, response=FileObject),
    RouteDoc("DELETE", "/v1/files/{file_id}", "Delete a file", _FILES, response=FileDeleted),
    RouteDoc("GET", "/v1/files/{file_id}/content", "A file's bytes", _FILES, media_type="application/octet-stream"),
    RouteDoc("POST", "/v1/batches", "Create a batch of an uploaded input file's requests", _BATCHES, CreateBatchBody,
             OpenAIBatch),
    RouteDoc("GET", "/v1/batches", "List batches, newest first (limit, after)", _BATCHES, response=OpenAIBatchList),
    RouteDoc("GET", "/v1/batches/{batch_id}", "Retrieve a batch", _BATCHES, response=OpenAIBatch),
    RouteDoc("POST", "/v1/batches/{batch_id}/cancel", "Cancel a batch", _BATCHES, EmptyBody, OpenAIBatch),
)

_CLUSTER, _WORKERS = "Cluster", "Workers"
ORCHESTRATOR_DOCS: tuple[RouteDoc, ...] = (
    *GENERATION_DOCS, *SURFACE_DOCS, *BATCH_DOCS, *OPENAI_BATCH_DOCS, PROMETHEUS_DOC,
    RouteDoc("GET", "/metrics", "Prometheus exposition (the same as /prometheus/metrics: where scrapers look by "
             "default)", PROMETHEUS_DOC.tag, media_type=PROMETHEUS_DOC.media_type),
    RouteDoc("GET", "/health", "200 once every process has a healthy ctx and gen worker, 503 before", _CLUSTER,
             response=OrchestratorHealth),
    RouteDoc("GET", "/cluster_info", "Workers, their load and the routers' settings, as this process sees them",
             _CLUSTER, response=ClusterInfo),
    RouteDoc("GET", "/perf_metrics", "Per-request timing records, joined with the workers' (drained)", _CLUSTER,
             response=JoinedPerfRecords),
    RouteDoc("GET", "/settings", "The settings that change live (routers, timeouts, retries, limits, log level)",
             _CLUSTER, response=SettingsAck),
    RouteDoc("POST", "/settings", "Change live settings in every process (keys left out keep their value); "
             "answers once every process holds them", _CLUSTER, LiveSettings, SettingsAck),
    RouteDoc("GET", "/workers", "The registered and static workers", _WORKERS, response=WorkerList),
    RouteDoc("POST", "/workers/register", "Register a worker (then heartbeat within the TTL)", _WORKERS,
             Registration, RegistrationAck),
    RouteDoc("POST", "/workers/heartbeat", "Keep a registered worker in the rotation (404: register again)",
             _WORKERS, WorkerIdBody, Ok),
    RouteDoc("POST", "/workers/deregister", "Take a registered worker out of the rotation", _WORKERS,
             WorkerIdBody, Ok),
    RouteDoc("POST", "/workers/drain", "Route nothing new to a worker (by id or URL); answers once every "
             "orchestrator process holds the drain", _WORKERS, WorkerRef, DrainAck),
    RouteDoc("POST", "/workers/undrain", "Put a drained worker back in the rotation", _WORKERS, WorkerRef, DrainAck),
)
