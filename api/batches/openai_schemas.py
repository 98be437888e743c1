"""OpenAI Files and Batches API bodies (msgspec), shaped like OpenAI's.

Times on the wire are Unix seconds (integers), as OpenAI's are. An input
file is JSONL, one request a line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and each output (or error) file line is::

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}} | null,
     "error": {"code": "...", "message": "..."} | null}
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "FilePurpose", "FileUpload", "FileObject", "FileList", "FileDeleted", "BatchStatus", "BatchEndpoint", "BatchRequestCounts",
    "BatchUsage", "InputTokensDetails", "OutputTokensDetails", "BatchError", "BatchErrors", "OpenAIBatch", "OpenAIBatchList", "CreateBatchBody", "InputLine",
    "COMPLETION_WINDOWS", "UPLOAD_PURPOSES",
]

COMPLETION_WINDOWS = ("24h",)  # OpenAI accepts only this window


class FilePurpose(enum.StrEnum):
    """What a file is for: clients upload ``batch`` (and ``user_data``, kept but used by nothing here);
    the server writes ``batch_output`` (a batch's output and error files)."""

    BATCH = "batch"
    USER_DATA = "user_data"
    BATCH_OUTPUT = "batch_output"


UPLOAD_PURPOSES = (FilePurpose.BATCH, FilePurpose.USER_DATA)


class BatchStatus(enum.StrEnum):
    """OpenAI's Batch lifecycle: validating -> in_progress -> finalizing -> completed, with
    failed (the input file could not be used at all), expired (the 24 h window passed with requests
    left) and cancelling -> cancelled."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class BatchEndpoint(enum.StrEnum):
    """The endpoints a batch may run (each runs through the orchestrator's disaggregated flow)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"


class FileUpload(msgspec.Struct, frozen=True):
    """``POST /v1/files``'s multipart/form-data fields (documentation only: the route reads the form)."""

    file: Annotated[str, msgspec.Meta(extra_json_schema={"format": "binary"})]
    purpose: Literal["batch", "user_data"]


class FileObject(msgspec.Struct, frozen=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: Literal["file"] = "file"
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(msgspec.Struct, frozen=True):
    data: list[FileObject]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: Literal["list"] = "list"


class FileDeleted(msgspec.Struct, frozen=True):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


class BatchRequestCounts(msgspec.Struct, frozen=True):
    total: int
    completed: int
    failed: int


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int = 0


class BatchUsage(msgspec.Struct, frozen=True):
    """The token usage of the batch's answered requests (its output file's), summed."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class BatchError(msgspec.Struct, frozen=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct, frozen=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


class OpenAIBatch(msgspec.Struct, frozen=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    usage: BatchUsage | None = None
    object: Literal["batch"] = "batch"


class OpenAIBatchList(msgspec.Struct, frozen=True):
    data: list[OpenAIBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: Literal["list"] = "list"


class CreateBatchBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: BatchEndpoint
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None
    """Accepted for the SDK's sake; batch output files here never expire (delete them)."""


class InputLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One input file line (its ``body`` kept raw: checked as the endpoint checks a body, when it runs)."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw
