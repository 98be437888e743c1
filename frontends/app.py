"""The frontend's ASGI app: ``build_app(client, tokenizer, config)``.

Raw Starlette routes with msgspec (no pydantic on the request path), in a
FastAPI app that documents them (``api.openapi``: ``/openapi.json``,
``/docs``) and leaves every request on Starlette's path. Every route is
wrapped by ``_endpoint``, which renders any exception in the route's API
shape (OpenAI or Anthropic) through the one mapping in ``api.errors``;
unknown routes and methods get the same shapes. Every response carries
``x-disagg-frontend: <frontend_id>`` so a client (and the tests) can see
which of a worker's K frontend processes answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import anthropic_api, openai_api, responses, tokenize_api
from api.admission import AdmissionGate, OnRefused
from api.api_key import RequiredKey
from api.body_limit import DEFAULT_MAX_REQUEST_BYTES, limit_body
from api.direct_body import DIRECT_BODY
from api.errors import (
    ApiError,
    EngineDeadError,
    anthropic_error_body,
    http_error,
    openai_error_body,
)
from api.generation import EngineClientLike
from api.memory import large_body, release_memory_soon
from api.openapi import DocumentedApp
from api.openapi_routes import WORKER_DOCS
from api.openapi_types import Health
from api.request_fields import IGNORED_FIELDS_SCOPE_KEY, warning_header
from api.route_errors import route_error_response
from api.route_table import over_admin_socket
from api.serving import FrontendConfig, ServingContext
from api.streaming import ClientDisconnected
from api.tokenizer import Tokenizer
from frontends.static_routes import StaticRouter
from frontends.worker_info import worker_info
from workers.frontends_down import read_frontends_down

__all__ = ["build_app", "FrontendConfig", "FRONTEND_HEADER"]

logger = logging.getLogger(__name__)

FRONTEND_HEADER = "x-disagg-frontend"
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it

Handler = Callable[[ServingContext, Request], Awaitable[Response]]
Lifespan = Callable[[Starlette], AbstractAsyncContextManager[None]]
# An HTTP error handler (Starlette's ExceptionHandler also admits websocket ones, which this app has none of).
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class FrontendHeaderMiddleware:
    """The app's one middleware layer: the ``x-disagg-frontend`` header on every HTTP
    response, and the error responses of Starlette's ServerErrorMiddleware and
    ExceptionMiddleware (which it replaces, see ``_FrontendStarlette``).

    Pure ASGI with one ``send`` wrapper: every SSE frame passes through it, so it
    does the least per message (Starlette's three layers each wrapped ``send``).
    An ``HTTPException`` (unknown path or method) answers through
    ``http_exception``; any other exception answers 500 through ``unhandled``
    when nothing was sent yet, and is re-raised, as ServerErrorMiddleware does.

    With a worker key, a request over TCP to any route but /health that does not present it is
    answered 401 before anything else (``_needs_key``).

    Streamed bodies write their middle frames around ``send`` where the server offers it
    (``api.direct_body``); with ``direct_body`` False (the app has middleware of its
    own, which may rewrite bodies) the offer is withdrawn.
    """

    def __init__(self, app: ASGIApp, frontend_id: int, http_exception: ErrorHandler,
                 unhandled: ErrorHandler, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 admission: AdmissionGate | None = None, direct_body: bool = True,
                 worker_key: RequiredKey | None = None) -> None:
        self.app = app
        self.worker_key = worker_key
        self.direct_body = direct_body
        self.max_request_bytes = max_request_bytes
        self.admission = admission or AdmissionGate(None)
        self.header = (FRONTEND_HEADER.encode(), str(frontend_id).encode())
        self.http_exception = http_exception
        self.unhandled = unhandled
        # What ExceptionMiddleware puts in the scope for request_response routes' own wrapper.
        self.scope_handlers: tuple[dict[type[Exception], ErrorHandler], dict[int, ErrorHandler]] = (
            {HTTPException: http_exception}, {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["starlette.exception_handlers"] = self.scope_handlers
        if not self.direct_body and "extensions" in scope:
            scope["extensions"].pop(DIRECT_BODY, None)
        receive = limit_body(receive, scope["headers"], self.max_request_bytes)
        header = self.header
        started = False

        async def send_with_header(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), header]
                ignored = scope.get(IGNORED_FIELDS_SCOPE_KEY)
                if ignored:  # left by the handler's decode_request
                    message["headers"].append(warning_header(ignored))
            await send(message)

        if self.worker_key is not None and _needs_key(scope) and not self.worker_key.accepts_headers(scope["headers"]):
            await error_response(http_error(self.worker_key.refusal("the deployment's worker key")),
                                 _is_anthropic(scope["path"]))(scope, receive, send_with_header)
            return
        admission = self.admission
        gated = admission.gates(scope["method"], scope["path"])
        if gated and not admission.try_admit():  # refused before a byte of the body is read
            await error_response(http_error(admission.refusal()), _is_anthropic(scope["path"]))(
                scope, receive, send_with_header)
            return
        try:
            await self.app(scope, receive, send_with_header)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when the grace period ends; it would answer its
            # plain-text 500: the client gets the API's JSON 503 instead.
            if not started:
                with contextlib.suppress(OSError, RuntimeError):
                    await error_response(_SHUTTING_DOWN, _is_anthropic(scope["path"]))(scope, receive,
                                                                                        send_with_header)
            raise
        except Exception as exc:
            if started:
                raise
            handler = self.http_exception if isinstance(exc, HTTPException) else self.unhandled
            response = await handler(Request(scope, receive), exc)
            await response(scope, receive, send_with_header)
            if not isinstance(exc, HTTPException):
                raise
        finally:
            if gated:
                admission.release()
            if large_body(scope["headers"]):
                release_memory_soon()  # api.memory: a large body's pages go back to the system


class _FrontendStarlette(DocumentedApp):
    """The documented app with ``FrontendHeaderMiddleware`` as its whole middleware stack."""

    def __init__(self, frontend_id: int, max_request_bytes: int, admission: AdmissionGate, version: str,
                 worker_key: RequiredKey | None = None, **kwargs: Any) -> None:
        self.frontend_id = frontend_id
        self.max_request_bytes = max_request_bytes
        self.admission = admission
        self.worker_key = worker_key
        super().__init__(WORKER_DOCS, title="disagg worker", version=version, description=_DESCRIPTION, **kwargs)

    def build_middleware_stack(self) -> ASGIApp:
        app: ASGIApp = StaticRouter(self.router)
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return FrontendHeaderMiddleware(app, self.frontend_id, _http_exception, _unhandled, self.max_request_bytes,
                                        self.admission, direct_body=not self.user_middleware,
                                        worker_key=self.worker_key)


_DESCRIPTION = ("One worker of a disagg deployment (OpenAI, Anthropic and Responses APIs). Clients normally "
                "call the orchestrator, which serves the same APIs for the whole cluster.")


def _needs_key(scope: Scope) -> bool:
    """Whether a request must present the worker key: every one but the liveness probe, except on
    the launcher's admin socket, where attached frontends replay what they accepted themselves."""
    return scope["path"] != "/health" and not over_admin_socket(scope)


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


_SHUTTING_DOWN = ApiError(503, "the worker is shutting down; retry", "service_unavailable_error", "overloaded_error",
                          code="shutting_down")


def error_response(error: ApiError, anthropic: bool) -> Response:
    body = anthropic_error_body(error) if anthropic else openai_error_body(error)
    return Response(body, status_code=error.status_for(anthropic), media_type="application/json",
                    headers=error.headers())


class _Endpoint:
    """A route's ASGI app (no Starlette ``request_response`` wrapper: this catches everything).

    Renders any exception of the handler in the route's API shape."""

    __slots__ = ("handler", "anthropic")

    def __init__(self, handler: Handler, anthropic: bool) -> None:
        self.handler = handler
        self.anthropic = anthropic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        response = await self.respond(request)
        await response(scope, receive, send)

    async def respond(self, request: Request) -> Response:
        try:
            return await self.handler(request.app.state.serving, request)
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        except Exception as exc:  # the catch-all: always the API's error shape
            error = http_error(exc)
            if error.status >= 500 and not isinstance(exc, EngineDeadError):
                logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
            return error_response(error, self.anthropic)


def _endpoint(handler: Handler, anthropic: bool) -> _Endpoint:
    return _Endpoint(handler, anthropic)


async def _health(ctx: ServingContext, request: Request) -> Response:
    ctx.check_engine()
    down = None if ctx.frontends_down_file is None else read_frontends_down(ctx.frontends_down_file)
    if down is None:
        return Response(b'{"status":"ok"}', media_type="application/json")
    # Still serving (200: routers keep it), on fewer frontends than configured.
    return Response(msgspec.json.encode(Health(status="degraded", frontends_left_down=down.left_down,
                                               num_frontends=down.num_frontends)), media_type="application/json")


async def _version(ctx: ServingContext, request: Request) -> Response:
    return Response(msgspec.json.encode({"version": ctx.config.version}), media_type="application/json")


async def _http_exception(request: Request, exc: Exception) -> Response:
    # Starlette's router raises these for unknown paths (404) and methods (405).
    return route_error_response(request, exc)


async def _unhandled(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(http_error(exc), _is_anthropic(request.url.path))


def api_routes() -> list[Route]:
    openai, anthropic = False, True
    return [
        Route("/v1/completions", _endpoint(openai_api.create_completion, openai), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(openai_api.create_chat_completion, openai), methods=["POST"]),
        Route("/v1/models", _endpoint(openai_api.list_models, openai), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _endpoint(tokenize_api.retrieve_model_route, openai), methods=["GET"]),
        Route("/tokenize", _endpoint(tokenize_api.tokenize_route, openai), methods=["POST"]),
        Route("/detokenize", _endpoint(tokenize_api.detokenize_route, openai), methods=["POST"]),
        Route("/worker_info", _endpoint(worker_info, openai), methods=["GET"]),
        Route("/health", _endpoint(_health, openai), methods=["GET"]),
        Route("/version", _endpoint(_version, openai), methods=["GET"]),
        Route("/v1/messages", _endpoint(anthropic_api.create_message, anthropic), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint(anthropic_api.count_message_tokens, anthropic),
              methods=["POST"]),
        Route("/v1/responses", _endpoint(responses.create_response, openai), methods=["POST"]),
        Route("/v1/responses/{response_id}", _endpoint(responses.retrieve_response, openai), methods=["GET"]),
        Route("/v1/responses/{response_id}", _endpoint(responses.delete_response, openai), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", _endpoint(responses.list_input_items, openai),
              methods=["GET"]),
    ]


def build_app(
    client: EngineClientLike,
    tokenizer: Tokenizer,
    config: FrontendConfig,
    *,
    lifespan: Lifespan | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    prefix_routes: Sequence[BaseRoute] = (),
    responses_store: responses.ResponsesClient | None = None,
    on_refused: OnRefused | None = None,
) -> Starlette:
    """The frontend app for one process.

    ``lifespan``: the owner's startup/shutdown (e.g. starting the engine
    client), run inside the app's own. ``extra_routes``: routes the process
    adds (/prometheus/metrics); they take precedence over none of the API
    routes, which are matched first. ``prefix_routes``: matched before every
    other route (the launcher-owned routes: their forwarders or handlers).
    ``responses_store``: where ``/v1/responses`` keeps and finds stored responses
    (default: an in-memory store of this app's own). ``on_refused``: counts each request the
    admission gate refuses (``api.admission``).
    """

    @contextlib.asynccontextmanager
    async def app_lifespan(app: Starlette) -> AsyncIterator[None]:
        async with lifespan(app) if lifespan is not None else contextlib.nullcontext():
            yield

    gate = AdmissionGate(config.max_concurrent_requests)
    gate.on_refused = on_refused
    app = _FrontendStarlette(
        config.frontend_id,
        config.max_request_bytes,
        gate,
        config.version,
        RequiredKey(config.worker_key) if config.worker_key is not None else None,
        routes=[*prefix_routes, *api_routes(), *extra_routes],
        lifespan=app_lifespan,
    )
    # Set here, not in the lifespan: transports that skip lifespan (httpx.ASGITransport) work too.
    app.state.serving = ServingContext(client, tokenizer, config)
    app.state.responses = responses_store or responses.LocalResponses(responses.ResponseStore(":memory:"))
    return app
