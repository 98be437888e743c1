"""Exact-path dispatch ahead of Starlette's route scan.

Starlette's router tries every route's regex in order until one matches, so
``POST /v1/chat/completions``, behind the launcher's forwarders and the
batch routes, paid a dozen regex matches per request. ``StaticRouter`` looks
``(path, method)`` up in a dict built from the router's own routes and hands
the request to that route exactly as the scan would have (the same scope
keys, the same ``handle``); anything not in the dict (a path with
parameters, an unknown path, a method no route takes: 404 and 405) goes to
the router's scan unchanged.

A ``(path, method)`` pair is indexed only when the scan itself would pick
that route for it: the route has no path parameters and no route before it
matches the pair fully (an earlier catch-all or mount keeps its precedence).
The index follows the route list: it is rebuilt when routes are added.
"""

from __future__ import annotations

from starlette._utils import get_route_path
from starlette.routing import BaseRoute, Match, Route, Router
from starlette.types import Receive, Scope, Send

__all__ = ["StaticRouter", "static_index"]


def static_index(routes: list[BaseRoute]) -> dict[tuple[str, str], Route]:
    """``(path, method) -> route`` for every pair the in-order scan sends to a parameterless Route."""
    index: dict[tuple[str, str], Route] = {}
    for route in routes:
        if type(route) is not Route or route.param_convertors or not route.methods:
            continue
        for method in route.methods:
            probe = {"type": "http", "path": route.path, "root_path": "", "method": method}
            first = next((r for r in routes if r.matches(probe)[0] is Match.FULL), None)
            if first is route:
                index.setdefault((route.path, method), route)
    return index


class StaticRouter:
    """The router's ASGI app with an exact-match dict in front of its scan."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._index: dict[tuple[str, str], Route] = {}
        self._num_routes = -1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        routes = self.router.routes
        if len(routes) != self._num_routes:
            self._index, self._num_routes = static_index(routes), len(routes)
        route = self._index.get((get_route_path(scope), scope["method"])) if scope["type"] == "http" else None
        if route is None:
            await self.router.middleware_stack(scope, receive, send)
            return
        # What Router.app and Route.matches put in the scope for this route.
        if "router" not in scope:
            scope["router"] = self.router
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        scope["path_params"] = dict(scope.get("path_params", {}))
        await route.app(scope, receive, send)
