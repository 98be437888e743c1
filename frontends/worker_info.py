"""GET /worker_info: what an orchestrator needs to know to route to this worker.

Its role and KV endpoint (``api.disaggregation``), its block hashing
(so the orchestrator computes the same prefix hashes), its limits (the
orchestrator validates prompts against them) and its clock (the orchestrator
measures its offset from ``server_time``): ``workers.http_protocol.WorkerInfo``.
"""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.disaggregation import DisaggConfig
from api.serving import ServingContext
from workers.http_protocol import WorkerInfo

__all__ = ["worker_info"]


async def worker_info(ctx: ServingContext, request: Request) -> Response:
    config = ctx.config.disagg or DisaggConfig()
    info = WorkerInfo(role=config.role, model=ctx.model_name, kv_endpoint=config.kv_endpoint,
                      block_size=config.block_size, hash_seed=config.hash_seed,
                      max_model_len=ctx.client.max_model_len, vocab_size=ctx.client.vocab_size,
                      server_time=time.time())
    return Response(msgspec.json.encode(info), media_type="application/json")
