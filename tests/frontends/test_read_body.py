"""``read_body`` reads what Starlette's ``Request.body()`` reads, and fails as it does (api.body_limit)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect, Request

from api.body_limit import limit_body, read_body
from api.errors import RequestTooLargeError


def _receive(messages: list[dict]):
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0)

    return receive


def _outcome(read, messages: list[dict]):
    try:
        return asyncio.run(read(_receive(messages)))
    except Exception as exc:  # noqa: BLE001  # the failure is the outcome compared
        return type(exc)


async def _starlette(receive) -> bytes:
    return await Request({"type": "http", "method": "POST", "headers": []}, receive).body()


def _part(body: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


@pytest.mark.parametrize("messages", [
    [_part(b'{"model": "m"}', False)],
    [{"type": "http.request"}],
    [_part(b"", False)],
    [_part(b"ab", True), _part(b"", True), _part(b"cd", True), _part(b"e", False)],
    [_part(b"ab", True), {"type": "lifespan.other"}, _part(b"", False)],
    [_part(b"ab", True), {"type": "http.disconnect"}],
    [{"type": "http.disconnect"}],
])
def test_reads_as_starlettes_request_body(messages):
    outcome = _outcome(read_body, messages)
    assert outcome == _outcome(_starlette, messages)
    assert outcome is ClientDisconnect or isinstance(outcome, bytes)


def test_a_limited_receive_refuses_a_body_over_the_limit():
    headers = [(b"transfer-encoding", b"chunked")]
    messages = [_part(b"x" * 6, True), _part(b"x" * 6, False)]
    assert _outcome(lambda receive: read_body(limit_body(receive, headers, 10)), messages) is RequestTooLargeError
    assert _outcome(lambda receive: read_body(limit_body(receive, headers, 12)), messages) == b"x" * 12
