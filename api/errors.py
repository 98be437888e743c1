"""The frontend's error tree and its one mapping to HTTP error responses.

Exception hierarchy (what a handler or the engine client may raise)::

    FrontendError                 any error with an HTTP status and an API type
    ├── InvalidRequestError       400: malformed JSON, wrong type, out-of-range value
    │   ├── PromptTooLongError    400: prompt tokens + max_tokens > max_model_len
    │   └── PreviousResponseNotFoundError  400: unknown previous_response_id (api.responses.api)
    ├── UnauthorizedError         401: no or a wrong API key or worker key (api.api_key)
    ├── RequestTooLargeError      413: the request body is over the server's limit
    ├── RequestHeadTooLargeError  431: the request line and headers are over 64 KiB (api.header_limit)
    ├── OverloadedError           429 (Anthropic: 529 overloaded_error) with Retry-After: at an admission
    │                             limit (api.admission)
    ├── ModelNotFoundError        404: the body names a model this frontend does not serve
    ├── NotFoundError             404: unknown route
    ├── EngineDeadError           503: the engine process is gone, or wedged past its limit
    │   └── EngineUnresponsiveError  503: alive but silent for a few heartbeats (slow, not dead)
    ├── RequestAbortedError       503: the engine ended the request without an answer (api.generation)
    ├── EngineFailedError         500: the engine failed the request itself, not for its fault
    │                             (``workers.protocol.RejectReason``; api.generation)
    ├── LauncherUnavailableError  503: a launcher-owned route, and the launcher does not answer
    ├── NoWorkerError             503: the orchestrator has no healthy worker for the leg (orchestrator.errors)
    ├── UpstreamFailedError       502: a worker failed the orchestrator's leg (orchestrator.errors)
    ├── RequestTimeoutError       504: the orchestrator's request deadline passed (orchestrator.errors)
    └── NotSupportedError         501: the engine cannot do this (e.g. profile the synthetic engine)

    ParamError (workers.sampling_params, a ValueError)  400: a sampling parameter out of range, naming it

``http_error(exc)`` maps any exception to (status, ApiError): the classes
above, msgspec decode and validation errors and ``ParamError`` (raised by
``SamplingParams.validate``) are 4xx; anything else, a bare ``ValueError``
included (an engine invariant such as the scheduler's or block manager's),
is a bug and becomes a 500 that still has the API's error shape (and is
logged with its traceback by the app). Bodies are
rendered per API: OpenAI ``{"error": {"message", "type", "param", "code"}}``,
Anthropic ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import msgspec

from workers.sampling_params import ParamError

__all__ = [
    "FrontendError",
    "EngineFailedError",
    "InvalidRequestError",
    "PromptTooLongError",
    "ModelNotFoundError",
    "NotFoundError",
    "EngineDeadError",
    "RequestTooLargeError",
    "EngineUnresponsiveError",
    "LauncherUnavailableError",
    "NotSupportedError",
    "UnauthorizedError",
    "ApiError",
    "http_error",
    "openai_error_body",
    "anthropic_error_body",
]


class FrontendError(Exception):
    status: int = 400
    openai_type: str = "invalid_request_error"
    anthropic_type: str = "invalid_request_error"
    code: str | None = None
    anthropic_status: int | None = None  # where Anthropic's API answers another status than ``status``
    retry_after: int | None = None  # seconds, sent as Retry-After: the client may retry then

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(FrontendError):
    pass


class PromptTooLongError(InvalidRequestError):
    code = "context_length_exceeded"


class UnauthorizedError(FrontendError):
    status = 401
    openai_type = "invalid_request_error"
    anthropic_type = "authentication_error"
    code = "invalid_api_key"


class RequestTooLargeError(FrontendError):
    status = 413
    code = "request_too_large"


class ModelNotFoundError(FrontendError):
    status = 404
    anthropic_type = "not_found_error"
    code = "model_not_found"


class NotFoundError(FrontendError):
    status = 404
    anthropic_type = "not_found_error"
    code = "not_found"


class EngineDeadError(FrontendError):
    status = 503
    openai_type = "service_unavailable_error"
    anthropic_type = "api_error"
    code = "engine_dead"

    def __init__(self, message: str = "the engine is not running", *, param: str | None = None) -> None:
        super().__init__(message, param=param)


class EngineUnresponsiveError(EngineDeadError):
    """The engine process is alive but silent: slow (e.g. CPU-starved or stopped), not dead."""

    code = "engine_unresponsive"


class EngineFailedError(FrontendError):
    """The engine ended the request with an error that is its own (an exception while adding it, a
    broken invariant), not the request's: a 500, which an orchestrator retries on another worker."""

    status = 500
    openai_type = "internal_error"
    anthropic_type = "api_error"
    code = "engine_error"


class LauncherUnavailableError(FrontendError):
    status = 503
    openai_type = "service_unavailable_error"
    anthropic_type = "api_error"
    code = "launcher_unavailable"


class NotSupportedError(FrontendError):
    status = 501
    openai_type = "not_implemented_error"
    anthropic_type = "api_error"
    code = "not_supported"


class ApiError(msgspec.Struct, frozen=True):
    status: int
    message: str
    openai_type: str
    anthropic_type: str
    param: str | None = None
    code: str | None = None
    anthropic_status: int | None = None
    retry_after: int | None = None

    def status_for(self, anthropic: bool) -> int:
        """The HTTP status in the API's shape (Anthropic answers overload with 529, OpenAI with 429)."""
        return self.anthropic_status if anthropic and self.anthropic_status is not None else self.status

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def http_error(exc: BaseException) -> ApiError:
    """The one mapping from exception types to HTTP errors."""
    if isinstance(exc, FrontendError):
        return ApiError(exc.status, exc.message, exc.openai_type, exc.anthropic_type, exc.param, exc.code,
                        exc.anthropic_status, exc.retry_after)
    if isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"invalid request body: {exc}", "invalid_request_error", "invalid_request_error",
                        _param_of(exc))
    if isinstance(exc, msgspec.DecodeError):
        return ApiError(400, f"malformed JSON body: {exc}", "invalid_request_error", "invalid_request_error")
    if isinstance(exc, ParamError):
        return ApiError(400, str(exc), "invalid_request_error", "invalid_request_error", exc.param)
    return ApiError(500, f"internal error: {type(exc).__name__}", "internal_error", "api_error")


def _param_of(exc: msgspec.ValidationError) -> str | None:
    # msgspec says "... - at `$.messages[0].content`": name the field for the client.
    text = str(exc)
    if "at `$." not in text:
        return None
    return text.rsplit("at `$.", 1)[1].rstrip("`")


def openai_error_body(error: ApiError) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": error.message, "type": error.openai_type, "param": error.param, "code": error.code}}
    )


def anthropic_error_body(error: ApiError) -> bytes:
    return msgspec.json.encode({"type": "error", "error": {"type": error.anthropic_type, "message": error.message}})
