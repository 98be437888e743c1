"""The one check of a shared key on an HTTP request, and the one way a key is read from its file.

Two keys use it. The orchestrator's ``api_key`` (clients present it); a
deployment's **worker key** (``<run dir>/worker.key``, made by ``disagg up``),
which the orchestrator presents to every worker and which a worker started
with ``--worker-key-file`` requires on every route but ``/health``
(docs/operations.md, "Security"). Either is presented as
``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (the OpenAI and the
Anthropic SDKs' own headers); ``x-api-key`` wins when both are sent.

A key lives in a file of mode 0600, never on a command line (``ps`` shows
argv to every user) and never in a log line: ``RequiredKey`` has no repr of
its key.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from api.errors import UnauthorizedError

__all__ = ["RequiredKey", "KeyFileError", "read_key_file", "presented_key", "bearer_header"]


class KeyFileError(ValueError):
    """A key file that cannot be read, is readable by others than its owner, or is empty."""


def read_key_file(path: str | Path) -> str:
    """The key in ``path`` (surrounding whitespace stripped): a file of mode 0600."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read the key file {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"the key file {path} has mode {stat.S_IMODE(mode):o}; it must be 0600")
    if not text:
        raise KeyFileError(f"the key file {path} is empty")
    return text


def presented_key(x_api_key: bytes | None, authorization: bytes | None) -> bytes | None:
    """The key a request presents: its ``x-api-key``, else the token of ``Authorization: Bearer``."""
    if x_api_key is not None:
        return x_api_key
    if authorization is not None and authorization[:7].lower() == b"bearer ":
        return authorization[7:].strip()
    return None


def bearer_header(key: str) -> dict[str, str]:
    """The header that presents ``key`` (what the orchestrator sends its workers)."""
    return {"authorization": f"Bearer {key}"}


class RequiredKey:
    """A key every request must present (compared in constant time)."""

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        self._key = key.encode()

    def __repr__(self) -> str:
        return "RequiredKey(<hidden>)"

    def accepts(self, x_api_key: bytes | None, authorization: bytes | None) -> bool:
        given = presented_key(x_api_key, authorization)
        return given is not None and hmac.compare_digest(given, self._key)

    def accepts_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """``headers``: an ASGI scope's (lower-case names)."""
        x_api_key = authorization = None
        for name, value in headers:
            if name == b"x-api-key" and x_api_key is None:
                x_api_key = value
            elif name == b"authorization" and authorization is None:
                authorization = value
        return self.accepts(x_api_key, authorization)

    def refusal(self, what: str) -> UnauthorizedError:
        return UnauthorizedError(f"{what} is required (Authorization: Bearer KEY or x-api-key: KEY)")
