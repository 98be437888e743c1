"""Unknown top-level fields of a request body: ignored with a warning header, or a 400 when strict.

The default ignores them, as vLLM does, and says so in a ``Warning`` header
(``299 - "unknown fields ignored: a, b"``): client libraries send fields a
server may not know (a newer SDK's parameters, an agent framework's extras,
vendor fields such as ``service_tier`` or ``prompt_cache_key``), and
refusing those would break the library for a field that changes nothing
here. A deployment that wants a typo (``max_token``) to fail loudly sets
``strict_request_fields: true`` (``disagg serve --strict-request-fields``,
the orchestrator's key of the same name): then an unknown field is a 400
naming it, as OpenAI's own API answers. Only top-level fields are checked;
nested objects (messages, tools) ignore unknown fields either way.

A body with no unknown field costs one decode, as before: it is decoded
with a variant of its type that forbids unknown fields (a ``msgspec``
subclass), and only a body that has one is decoded again, leniently.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, MutableMapping
from typing import Any, TypeVar

import msgspec

from api.errors import InvalidRequestError

__all__ = ["IGNORED_FIELDS_SCOPE_KEY", "decode_request", "check_fields", "warning_header"]

T = TypeVar("T", bound=msgspec.Struct)

IGNORED_FIELDS_SCOPE_KEY = "disagg.ignored_fields"
"""Where a handler leaves the ignored fields in the ASGI scope; the frontend's header middleware
(``frontends.app``) turns them into the ``Warning`` header."""

_UNKNOWN = "Object contains unknown field `"


@functools.cache
def _strict(struct_type: type[T]) -> type[T]:
    return type(struct_type.__name__, (struct_type,), {}, forbid_unknown_fields=True)


def decode_request(raw: bytes, struct_type: type[T], strict: bool, scope: MutableMapping[str, Any] | None = None) -> T:
    """``raw`` as ``struct_type``; an unknown top-level field is a 400 naming it when ``strict``, else
    ignored and left in ``scope`` for the warning header."""
    try:
        decoded: T = msgspec.json.decode(raw, type=_strict(struct_type))
        return decoded
    except msgspec.ValidationError as exc:
        if not str(exc).startswith(_UNKNOWN) or " - at `" in str(exc):  # not a top-level unknown field
            raise
    body = msgspec.json.decode(raw, type=struct_type)  # a type error after the unknown field raises here
    fields = msgspec.json.decode(raw)
    check_fields(fields, struct_type, strict, scope)
    return body


def check_fields(body: dict[str, Any], struct_type: type[msgspec.Struct], strict: bool,
                 scope: MutableMapping[str, Any] | None = None) -> tuple[str, ...]:
    """The top-level fields of ``body`` that ``struct_type`` does not know (a 400 when ``strict``)."""
    unknown = tuple(sorted(set(body) - set(struct_type.__struct_fields__)))
    if unknown and strict:
        raise InvalidRequestError(f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                                  "(this server refuses unknown fields: strict_request_fields)", param=unknown[0])
    if unknown and scope is not None:
        scope[IGNORED_FIELDS_SCOPE_KEY] = unknown
    return unknown


def warning_header(fields: Iterable[str]) -> tuple[bytes, bytes]:
    """The ``Warning`` header (RFC 7234's code 299, a persistent warning) naming the ignored fields."""
    names = ", ".join(fields).replace('"', "")
    return b"warning", f'299 - "unknown fields ignored: {names}"'.encode()
