"""What each of the orchestrator's routes takes and answers: the ``RouteDoc`` table of its ``/openapi.json``.

The client surface is the workers' own entries (``frontends.openapi_routes``):
the orchestrator answers the same requests with the same bodies. The rest is
the cluster's: health, routing state, metrics and worker registration.
"""

from __future__ import annotations

from frontends.openapi import RouteDoc
from frontends.openapi_routes import BATCH_DOCS, GENERATION_DOCS, PROMETHEUS_DOC, SURFACE_DOCS
from frontends.openapi_types import ClusterInfo, JoinedPerfRecords, Ok, OrchestratorHealth, Registration, RegistrationAck, WorkerId, \
    WorkerList

__all__ = ["ORCHESTRATOR_DOCS", "DESCRIPTION"]

DESCRIPTION = ("The one URL of a disagg deployment: OpenAI, Anthropic and Responses APIs over context and "
               "generation workers. With an API key configured, /v1/* and /workers* need "
               "`Authorization: Bearer KEY` or `x-api-key: KEY`.")

_CLUSTER, _WORKERS = "Cluster", "Workers"
ORCHESTRATOR_DOCS: tuple[RouteDoc, ...] = (
    *GENERATION_DOCS, *SURFACE_DOCS, *BATCH_DOCS, PROMETHEUS_DOC,
    RouteDoc("GET", "/health", "200 once every process has a healthy ctx and gen worker, 503 before", _CLUSTER,
             response=OrchestratorHealth),
    RouteDoc("GET", "/cluster_info", "Workers, their load and the routers' settings, as this process sees them",
             _CLUSTER, response=ClusterInfo),
    RouteDoc("GET", "/perf_metrics", "Per-request timing records, joined with the workers' (drained)", _CLUSTER,
             response=JoinedPerfRecords),
    RouteDoc("GET", "/workers", "The registered and static workers", _WORKERS, response=WorkerList),
    RouteDoc("POST", "/workers/register", "Register a worker (then heartbeat within the TTL)", _WORKERS,
             Registration, RegistrationAck),
    RouteDoc("POST", "/workers/heartbeat", "Keep a registered worker in the rotation", _WORKERS, WorkerId, Ok),
    RouteDoc("POST", "/workers/deregister", "Take a registered worker out of the rotation", _WORKERS, WorkerId, Ok),
)
