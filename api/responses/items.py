"""Stored conversation items: ids for every item, and ``GET /v1/responses/{id}/input_items`` pages.

A response's input items are everything its model call saw as conversation
(the history that ``previous_response_id`` continued and this request's
``input``; not ``instructions``), newest first unless ``order=asc``, as
the reference lists them: ``{object: list, data, first_id, last_id, has_more}``
with ``limit`` (1 to 100, default 20) and an ``after`` cursor (an item id).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from api.errors import InvalidRequestError
from api.responses.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    Item,
    MessageItem,
    OutputText,
    StoredResponse,
)

__all__ = ["new_id", "with_ids", "input_items_page", "MAX_LIST_LIMIT"]

MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
_PREFIXES = {MessageItem: "msg", FunctionCallItem: "fc", FunctionCallOutputItem: "fco"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def with_ids(items: list[Item]) -> list[Item]:
    """Items as the reference lists them: each with an id (clients may send items without one;
    ids already set are kept), message text as content parts."""
    return [_listed(item if item.id is not None else
                    msgspec.structs.replace(item, id=new_id(_PREFIXES.get(type(item), "rs")))) for item in items]


def _listed(item: Item) -> Item:
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        part = OutputText(item.content) if item.role == "assistant" else InputText(item.content)
        return msgspec.structs.replace(item, content=[part])
    return item


def _limit(query: Mapping[str, str]) -> int:
    raw = query.get("limit", str(DEFAULT_LIST_LIMIT))
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidRequestError(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {raw!r}", param="limit")
    return limit


def input_items_page(record: StoredResponse, query: Mapping[str, str]) -> dict[str, Any]:
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    limit = _limit(query)
    items = record.conversation[:len(record.conversation) - record.num_output]
    if order == "desc":
        items = items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise InvalidRequestError(f"no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": msgspec.to_builtins(page), "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(items) > limit}
