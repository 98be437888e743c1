"""Which routes the launcher owns and which every frontend answers itself.

With K frontends behind one port a client cannot choose who answers, so a
route whose state has exactly one owner per worker (a destructive drain, the
profiler, the batch store) is *launcher-owned*: the launcher answers it, and
an attached frontend replays it verbatim over the admin socket
(``frontends.admin_forwarder``). Everything else is *frontend-local*. A route
that is in neither table is a bug, and ``unclassified_routes`` (run by the
tests on the real apps) finds it.

Inference routes are frontend-local by design: they never cross the launcher.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.routing import BaseRoute, Mount, Route
from starlette.types import Scope

__all__ = [
    "LAUNCHER_ROUTES",
    "LAUNCHER_PREFIXES",
    "ADMIN_ONLY_PREFIXES",
    "FRONTEND_LOCAL_PATHS",
    "FORWARD_METHODS",
    "over_admin_socket",
    "is_launcher_owned",
    "is_frontend_local",
    "unclassified_routes",
]

# path -> methods. POST /kv_cache_events: some routers poll with POST.
LAUNCHER_ROUTES: dict[str, tuple[str, ...]] = {
    "/metrics": ("GET",),
    "/kv_cache_events": ("GET", "POST"),
    "/kv_cache_snapshot": ("GET",),
    "/start_profile": ("POST",),
    "/stop_profile": ("POST",),
    "/perf_metrics": ("GET",),
    "/v1/messages/batches": ("GET", "POST"),
}
# Every path below these is launcher-owned too (batch ids, results, cancel; stored responses).
LAUNCHER_PREFIXES: tuple[str, ...] = ("/v1/messages/batches/", "/v1/responses/")
# The launcher's own answers to its attached frontends (the response store): on its admin
# socket only, never forwarded (a client could otherwise reach them through any frontend).
ADMIN_ONLY_PREFIXES: tuple[str, ...] = ("/_admin/",)
FORWARD_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def over_admin_socket(scope: Scope) -> bool:
    """Whether a request came over the launcher's admin Unix socket (reachable only by the worker's own
    user: its directory is 0700), not TCP: uvicorn gives a Unix socket's connections a (path, None)
    server address, TCP ones a port."""
    server = scope.get("server")
    return server is not None and server[1] is None

FRONTEND_LOCAL_PATHS: frozenset[str] = frozenset({
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/models/{model_id:path}",
    "/tokenize",
    "/detokenize",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",  # runs here; the stored conversation it continues is the launcher's
    "/health",
    "/version",
    "/prometheus/metrics",
    "/worker_info",  # static facts about this worker (role, model): the same on every frontend
    "/openapi.json",  # the API's documentation (api.openapi): the same on every frontend
    "/docs",
    "/docs/assets/{name}",  # Swagger UI's and ReDoc's scripts and style, from the fastapi-standalone-docs package
    "/redoc",
    "/redoc/logo-mini.svg",
})


def is_launcher_owned(path: str) -> bool:
    """``path`` is a route template or a request path."""
    return path in LAUNCHER_ROUTES or path.startswith(LAUNCHER_PREFIXES)


def is_frontend_local(path: str) -> bool:
    return path in FRONTEND_LOCAL_PATHS


def _paths(routes: Iterable[BaseRoute], prefix: str = "") -> Iterable[str]:
    for route in routes:
        if isinstance(route, Mount):
            yield from _paths(route.routes, prefix + route.path)
        elif isinstance(route, Route):
            yield prefix + route.path
        else:
            yield prefix + str(getattr(route, "path", route))


def unclassified_routes(routes: Iterable[BaseRoute]) -> list[str]:
    """The paths in ``routes`` (an app's ``app.routes``) that neither table names."""
    return [p for p in _paths(routes)
            if not (is_launcher_owned(p) or is_frontend_local(p) or p.startswith(ADMIN_ONLY_PREFIXES))]
