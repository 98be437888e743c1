"""Unknown routes and methods, answered in the API's error shape (workers and orchestrator alike).

Starlette's router raises ``HTTPException(404)`` for a path no route matches
and ``HTTPException(405, headers={"Allow": ...})`` for a known path with the
wrong method. Both become the API's JSON error (Anthropic's under
/v1/messages, OpenAI's elsewhere); a 405 keeps its ``Allow`` header
(RFC 9110 requires it) and names the methods in its message.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from api.errors import ApiError, NotFoundError, anthropic_error_body, http_error, openai_error_body

__all__ = ["route_error_response", "is_anthropic_path"]


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def route_error_response(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    path = request.url.path
    headers: dict[str, str] = {}
    if status == 404:
        error = http_error(NotFoundError(f"no route {request.method} {path}"))
    elif status == 405:
        allow = (getattr(exc, "headers", None) or {}).get("Allow", "")
        headers = {"Allow": allow} if allow else {}
        error = ApiError(405, f"{request.method} is not allowed on {path}" + (f"; allowed: {allow}" if allow else ""),
                         "invalid_request_error", "invalid_request_error", code="method_not_allowed")
    else:
        error = ApiError(status, str(getattr(exc, "detail", "error")), "invalid_request_error",
                         "invalid_request_error")
    body = anthropic_error_body(error) if is_anthropic_path(path) else openai_error_body(error)
    return Response(body, status_code=error.status, media_type="application/json", headers=headers)
