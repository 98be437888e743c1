"""The launcher's side of launcher-owned routes (docs/architecture.md, "Launcher-owned state").

The launcher (frontend 0) answers these itself, on the worker's port and on
its admin socket ``<ipc_dir>/launcher.sock``, where attached frontends replay
them (``frontends.admin_forwarder``). The engine is reached through
``control``: ``WorkerGroup.control`` (blocking, so it runs in a thread).

    GET /metrics                 the engine's IterationStats since the last poll (JSON list)
    GET|POST /kv_cache_events    KV-cache events since the last poll (JSON list)
    GET /kv_cache_snapshot       every cached block hash and the next event id (not a drain)
    POST /start_profile          the engine's torch profiler; 501 for the synthetic engine
    POST /stop_profile           ... and the trace file it wrote
    GET /perf_metrics            per-request timing records of every frontend

Every drain is destructive and happens once per poll, whichever frontend
the poll reached: concurrent polls get disjoint parts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.errors import (
    EngineDeadError,
    FrontendError,
    InvalidRequestError,
    NotSupportedError,
    anthropic_error_body,
    http_error,
    openai_error_body,
)
from api.route_table import LAUNCHER_ROUTES
from frontends.perf_records import PerfRecorder, PerfStore, encode_records
from frontends.prometheus import LauncherMetrics
from workers.engine.kv_events import KVCacheSnapshot, KVEvent
from workers.engine.stats import IterationStats
from workers.protocol import (
    ControlAck,
    ControlReply,
    ControlRequest,
    DrainKVEvents,
    DrainReply,
    DrainStats,
    EngineHealth,
    HealthPing,
    SnapshotKVCache,
    StartProfile,
    StopProfile,
)

__all__ = ["LauncherState", "launcher_routes", "GAUGE_REFRESH_SECONDS"]

log = logging.getLogger("disagg.launcher_routes")

Control = Callable[[ControlRequest, float], ControlReply]  # (request, timeout seconds)
GAUGE_REFRESH_SECONDS = 1.0
# A drain or profiler call waits this long for the engine (a thread is busy meanwhile, and
# the launcher's exit waits for it: keep it short).
CONTROL_TIMEOUT_SECONDS = 5.0
_JSON = "application/json"


class LauncherState:
    """What the launcher-owned routes serve from."""

    def __init__(self, control: Control, perf_store: PerfStore, metrics: LauncherMetrics | None = None,
                 local_recorder: PerfRecorder | None = None, engine_kind: str = "torch") -> None:
        self.control = control
        self.engine_kind = engine_kind
        self.perf_store = perf_store
        self.metrics = metrics
        self.local_recorder = local_recorder  # frontend 0's own: flushed before each perf drain
        self._stats_decoder = msgspec.msgpack.Decoder(list[IterationStats])
        self._events_decoder = msgspec.msgpack.Decoder(list[KVEvent])
        self._snapshot_decoder = msgspec.msgpack.Decoder(KVCacheSnapshot)

    async def ask(self, request: ControlRequest, timeout: float = CONTROL_TIMEOUT_SECONDS) -> ControlReply:
        try:
            return await asyncio.to_thread(self.control, request, timeout)
        except (TimeoutError, RuntimeError) as exc:
            raise EngineDeadError(f"the engine did not answer the launcher: {exc}") from exc

    async def drain_stats(self) -> list[IterationStats]:
        return self._stats_decoder.decode(_drain_items(await self.ask(DrainStats())))

    async def drain_kv_events(self) -> list[KVEvent]:
        return self._events_decoder.decode(_drain_items(await self.ask(DrainKVEvents())))

    async def kv_snapshot(self) -> KVCacheSnapshot:
        return self._snapshot_decoder.decode(_drain_items(await self.ask(SnapshotKVCache())))

    async def refresh_gauges(self) -> None:
        if self.metrics is None:
            return
        try:
            health = await self.ask(HealthPing(), timeout=GAUGE_REFRESH_SECONDS)
        except EngineDeadError:
            self.metrics.set_engine_down()
            return
        if isinstance(health, EngineHealth):
            self.metrics.set_engine(health.num_running, health.num_waiting, health.kv_blocks_used,
                                    health.kv_blocks_total)
            if health.tiers is not None:
                self.metrics.set_tiers(health.tiers)
            self.metrics.set_speculative(health.num_draft_tokens, health.num_accepted_tokens)

    async def refresh_gauges_forever(self) -> None:
        while True:
            await self.refresh_gauges()
            await asyncio.sleep(GAUGE_REFRESH_SECONDS)


def _drain_items(reply: ControlReply) -> bytes:
    if not isinstance(reply, DrainReply):
        raise EngineDeadError(f"the engine answered a drain with {reply}")
    return bytes(reply.items)


def _checked_ack(reply: ControlReply) -> ControlAck:
    if not isinstance(reply, ControlAck):
        raise EngineDeadError(f"unexpected engine reply {type(reply).__name__}")
    if reply.error is None:
        return reply
    if reply.error_type == "ProfilingUnsupported":
        raise NotSupportedError(f"the engine cannot profile: {reply.error}")
    raise InvalidRequestError(f"the engine refused: {reply.error}")


def _json(value: object) -> Response:
    return Response(msgspec.json.encode(value), media_type=_JSON)


async def _metrics(state: LauncherState, request: Request) -> Response:
    stats = await state.drain_stats()
    # IterationStats is an array on the wire; the route answers objects.
    return _json([{f: getattr(s, f) for f in s.__struct_fields__} for s in stats])


async def _kv_cache_events(state: LauncherState, request: Request) -> Response:
    return _json(await state.drain_kv_events())


async def _kv_cache_snapshot(state: LauncherState, request: Request) -> Response:
    return _json(await state.kv_snapshot())


async def _start_profile(state: LauncherState, request: Request) -> Response:
    if state.engine_kind == "synthetic":
        raise NotSupportedError("the synthetic engine runs no model: it has nothing to profile "
                                "(serve with --engine torch to use the profiler)")
    _checked_ack(await state.ask(StartProfile()))
    return _json({"status": "profiling"})


async def _stop_profile(state: LauncherState, request: Request) -> Response:
    if state.engine_kind == "synthetic":
        raise NotSupportedError("the synthetic engine runs no model: it has nothing to profile")
    ack = _checked_ack(await state.ask(StopProfile()))
    return _json({"status": "stopped", "trace": ack.detail})


async def _perf_metrics(state: LauncherState, request: Request) -> Response:
    if state.local_recorder is not None:
        state.local_recorder.flush()
    return Response(encode_records(state.perf_store.drain()), media_type=_JSON)


Handler = Callable[[LauncherState, Request], Awaitable[Response]]
_HANDLERS: dict[str, Handler] = {
    "/metrics": _metrics,
    "/kv_cache_events": _kv_cache_events,
    "/kv_cache_snapshot": _kv_cache_snapshot,
    "/start_profile": _start_profile,
    "/stop_profile": _stop_profile,
    "/perf_metrics": _perf_metrics,
}


def _endpoint(state: LauncherState, path: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(state, request)
        except Exception as exc:  # always an API-shaped error
            error = http_error(exc)
            if not isinstance(exc, FrontendError):
                log.error("%s %s failed", request.method, path, exc_info=exc)
            body = anthropic_error_body(error) if path.startswith("/v1/messages") else openai_error_body(error)
            return Response(body, status_code=error.status, media_type=_JSON)

    return endpoint


def launcher_routes(state: LauncherState) -> list[Route]:
    """The launcher's handlers of every launcher-owned route it serves itself
    (the batch routes come from ``api.batches``, mounted next to these)."""
    return [Route(path, _endpoint(state, path, handler), methods=list(LAUNCHER_ROUTES[path]))
            for path, handler in _HANDLERS.items()]
