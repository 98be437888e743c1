"""api.request_headers: the scope scan answers as Starlette's ``request.headers.get`` does."""

from __future__ import annotations

from starlette.requests import Request

from api.request_headers import X_REQUEST_ID, header_value


def test_the_first_value_decoded_as_latin1_or_none_as_starlette_does():
    for headers in ([], [(b"host", b"x")], [(b"x-request-id", b"abc"), (b"x-request-id", b"second")],
                    [(b"host", b"x"), (b"x-request-id", "caf\u00e9".encode("latin-1"))],
                    [(b"x-request-idx", b"not this"), (b"x-request-id", b"")]):
        scope = {"type": "http", "headers": headers}
        assert header_value(scope, X_REQUEST_ID) == Request(scope).headers.get("x-request-id"), headers
    assert header_value({"headers": [(b"x-request-id", b"abc")]}, X_REQUEST_ID) == "abc"
