"""Request headers read straight from the ASGI scope.

``request.headers`` builds Starlette's ``Headers`` (a copy of the header list
and a case-folding lookup) on first use: about 3 µs, for the one header a
generation request reads. ASGI servers give header names in lower case
(the ASGI spec), so a scan of the scope's list finds the same first value.
"""

from __future__ import annotations

from starlette.types import Scope

__all__ = ["X_REQUEST_ID", "header_value"]

X_REQUEST_ID = b"x-request-id"


def header_value(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), decoded as Starlette does (latin-1)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None
