"""GET /perf_metrics: each request's orchestrator, ctx and gen timings, on one clock.

The owner keeps the orchestrator's records (pushed by every process) and,
at each call, fetches the workers' own records (``GET <worker>/perf_metrics``,
which drains them: the owner keeps what it fetched, by key, for later calls).
A worker record joins a leg by, in order:

1. ``x_request_id`` equal to the leg's x-request-id (``<id>-ctx`` /
   ``<id>-gen``): exact; workers record the header of every request;
2. (workers that do not record the header) ctx leg: the worker record whose
   integer ``request_id`` is the ctx engine's request id (``ctx_request_id``
   of the ctx answer's params);
3. (likewise) gen leg: the only record of that gen worker with the same prompt length
   whose frontend arrival lies within the leg (shifted clocks, 5 ms slack);
   none or several -> not joined (``gen_worker: null``).

Worker timestamps (floats above 1e9 in fields that are not durations, rates
or sizes) are moved onto the orchestrator's clock by subtracting the worker's
measured clock offset (worker minus orchestrator, from /worker_info's
``server_time``); ``clock_offset: null`` means the worker did not report a
time and its timestamps are joined unshifted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgspec

from orchestrator.state import StateOwner
from orchestrator.state_protocol import GenLegTrace, RequestTrace

__all__ = ["PerfJoiner"]

_MAX_CACHED = 10_000
_SLACK_SECONDS = 0.005


def _is_timestamp(name: str, value: Any) -> bool:
    return isinstance(value, float) and value > 1e9 and not name.endswith(("_seconds", "_second", "_bytes"))


def _shift(record: dict[str, Any], offset: float | None) -> dict[str, Any]:
    if offset is None:
        return dict(record)
    return {k: (v - offset if _is_timestamp(k, v) else v) for k, v in record.items()}


def _records_of(payload: Any) -> list[dict[str, Any]]:
    if isinstance(payload, dict):
        payload = payload.get("records", payload.get("data", []))
    return [r for r in payload if isinstance(r, dict)] if isinstance(payload, list) else []


class PerfJoiner:
    def __init__(self, client: httpx.AsyncClient, timeout: float) -> None:
        self.client = client
        self.timeout = timeout

    async def __call__(self, owner: StateOwner) -> list[dict[str, Any]]:
        workers = owner.registry.snapshot()
        fetched = await asyncio.gather(*(self._fetch(w.url) for w in workers))
        for worker, records in zip(workers, fetched):
            for record in records:
                entry = {"worker_id": worker.worker_id, "clock_offset": worker.clock_offset,
                         "record": _shift(record, worker.clock_offset)}
                key = record.get("x_request_id") or record.get("request_id")
                owner.worker_perf[f"{worker.worker_id}/{key}"] = entry
        while len(owner.worker_perf) > _MAX_CACHED:
            owner.worker_perf.pop(next(iter(owner.worker_perf)))
        return [self._join(owner, record) for record in owner.perf_records]

    async def _fetch(self, url: str) -> list[dict[str, Any]]:
        try:
            response = await self.client.get(f"{url}/perf_metrics", timeout=self.timeout)
        except httpx.HTTPError:
            return []
        if response.status_code != 200:
            return []
        return _records_of(msgspec.json.decode(response.content))

    @staticmethod
    def _join(owner: StateOwner, record: RequestTrace) -> dict[str, Any]:
        joined: dict[str, Any] = msgspec.to_builtins(record)
        request_id, ctx, gen = record.request_id, record.ctx, record.gen
        joined["ctx_worker"] = joined["gen_worker"] = None
        if ctx is not None:
            cache = owner.worker_perf
            joined["ctx_worker"] = cache.get(f"{ctx.worker_id}/{request_id}-ctx") or \
                cache.get(f"{ctx.worker_id}/{ctx.engine_request_id}")
        if gen is not None:
            joined["gen_worker"] = owner.worker_perf.get(f"{gen.worker_id}/{request_id}-gen") or \
                _match_gen(owner, gen, record.num_prompt_tokens)
        return joined


def _match_gen(owner: StateOwner, gen: GenLegTrace, num_prompt_tokens: int) -> dict[str, Any] | None:
    start, end = gen.start, gen.end or gen.first_byte
    prefix = f"{gen.worker_id}/"
    matches = [entry for key, entry in owner.worker_perf.items() if key.startswith(prefix)
               and entry["record"].get("num_prompt_tokens") == num_prompt_tokens
               and start - _SLACK_SECONDS <= (entry["record"].get("frontend_arrival") or 0.0) <= end + _SLACK_SECONDS]
    return matches[0] if len(matches) == 1 else None
