"""The attached frontend's side of launcher-owned routes: replay them on the admin socket.

An attached frontend mounts ``LauncherForwarder.routes()`` before its own
routes. Each request to a launcher-owned path (``api.route_table``) is
replayed verbatim on ``<ipc_dir>/launcher.sock``: method, path, query, body,
and the headers that select the body's meaning (content type, accept,
authorization and API keys, content/accept encoding). The launcher's answer
comes back verbatim, byte for byte and streamed as it arrives, except the
hop-by-hop headers and the launcher's own ``x-disagg-frontend`` (this process
adds its own).

A launcher that cannot be reached (no socket, refused, no answer within the
timeouts) is a 503 with a body in the route's API shape: never a hang and
never a 500. A launcher that dies mid-stream ends the stream early (the
status line is already sent); that is logged.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from api.errors import LauncherUnavailableError, anthropic_error_body, http_error, openai_error_body
from api.route_table import FORWARD_METHODS, LAUNCHER_PREFIXES, LAUNCHER_ROUTES

__all__ = ["LauncherForwarder", "FORWARDED_HEADERS", "FORWARDED_BY_HEADER"]

log = logging.getLogger("disagg.admin_forwarder")

# Request headers replayed to the launcher: those that say what the body is, what the
# client accepts, and who the client is. Everything else (host, cookies, hop-by-hop) stays.
FORWARDED_HEADERS = frozenset({
    "content-type", "content-encoding", "accept", "accept-encoding", "authorization", "x-api-key",
    "anthropic-version", "anthropic-beta", "openai-organization", "openai-project",
})
FORWARDED_BY_HEADER = "x-disagg-forwarded-by"  # the frontend id that replayed the request
_DROPPED_RESPONSE_HEADERS = frozenset({
    "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
    "x-disagg-frontend",
})


class _RelayedResponse(StreamingResponse):
    """A streamed response whose header list is the launcher's, duplicates and order kept."""

    def __init__(self, body: AsyncIterator[bytes], status_code: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(body, status_code=status_code)
        self.raw_headers = raw_headers


class LauncherForwarder:
    """Replays launcher-owned routes on the launcher's admin Unix socket."""

    def __init__(self, socket_path: str, frontend_id: int, *, connect_timeout: float = 2.0,
                 read_timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self.frontend_id = frontend_id
        self.num_forwarded = 0
        self.num_unavailable = 0
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket_path, retries=0),
            base_url="http://launcher",
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=connect_timeout),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=8),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def routes(self) -> list[Route]:
        """Forwarding routes for every launcher-owned path; mount them before all others."""
        exact = [Route(path, self.forward, methods=list(methods)) for path, methods in LAUNCHER_ROUTES.items()]
        below = [Route(prefix + "{rest:path}", self.forward, methods=list(FORWARD_METHODS))
                 for prefix in LAUNCHER_PREFIXES]
        return [*exact, *below]

    async def forward(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        headers[FORWARDED_BY_HEADER] = str(self.frontend_id)
        body = await request.body()
        url = httpx.URL(path=request.url.path, query=request.url.query.encode())
        upstream_request = self._client.build_request(request.method, url, headers=headers, content=body)
        try:
            upstream = await self._client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            return self._unavailable(request, exc)
        self.num_forwarded += 1
        raw_headers = [(k, v) for k, v in upstream.headers.raw if k.lower().decode() not in _DROPPED_RESPONSE_HEADERS]
        return _RelayedResponse(self._relay(upstream, request.url.path), upstream.status_code, raw_headers)

    async def _relay(self, upstream: httpx.Response, path: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():  # raw: a content-encoding passes through untouched
                yield chunk
        except httpx.HTTPError as exc:
            log.error("frontend %d: the launcher's answer to %s broke off: %s", self.frontend_id, path, exc)
        finally:
            await upstream.aclose()

    def _unavailable(self, request: Request, exc: Exception) -> Response:
        self.num_unavailable += 1
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.warning("frontend %d: %s %s: the launcher is unreachable (%s)", self.frontend_id, request.method,
                    request.url.path, why)
        error = http_error(LauncherUnavailableError(
            f"{request.url.path} is served by the worker's launcher, which did not answer frontend "
            f"{self.frontend_id} ({why}); retry later"))
        anthropic = request.url.path.startswith("/v1/messages")
        body = anthropic_error_body(error) if anthropic else openai_error_body(error)
        return Response(body, status_code=503, media_type="application/json", headers={"retry-after": "1"})
