"""Message Batches API bodies (msgspec), shaped like Anthropic's.

A create body is ``{"requests": [{"custom_id", "params"}]}``; ``params`` is
kept as raw JSON: it is stored verbatim and validated as a /v1/messages body
when the request runs (see ``api.batches.runner``). Times on the wire
are RFC 3339 strings; the store keeps epoch seconds.
"""

from __future__ import annotations

import datetime
from typing import Literal, overload

import msgspec

__all__ = [
    "BatchRequestItem",
    "CreateBatchRequest",
    "RequestCounts",
    "MessageBatch",
    "BatchList",
    "DeletedBatch",
    "ProcessingStatus",
    "RequestState",
    "rfc3339",
]

ProcessingStatus = Literal["in_progress", "canceling", "ended"]
# A request's stored state; "pending" is shown to clients as "processing".
RequestState = Literal["pending", "succeeded", "errored", "canceled", "expired"]


class BatchRequestItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    custom_id: str
    params: msgspec.Raw


class CreateBatchRequest(msgspec.Struct, frozen=True):
    requests: list[BatchRequestItem]


class RequestCounts(msgspec.Struct, frozen=True):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(msgspec.Struct, frozen=True):
    id: str
    processing_status: ProcessingStatus
    request_counts: RequestCounts
    created_at: str
    expires_at: str
    ended_at: str | None = None
    cancel_initiated_at: str | None = None
    archived_at: str | None = None
    results_url: str | None = None
    type: Literal["message_batch"] = "message_batch"


class BatchList(msgspec.Struct, frozen=True):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedBatch(msgspec.Struct, frozen=True):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"


@overload
def rfc3339(epoch_seconds: float) -> str: ...
@overload
def rfc3339(epoch_seconds: None) -> None: ...
@overload
def rfc3339(epoch_seconds: float | None) -> str | None: ...
def rfc3339(epoch_seconds: float | None) -> str | None:
    if epoch_seconds is None:
        return None
    moment = datetime.datetime.fromtimestamp(epoch_seconds, tz=datetime.UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")
