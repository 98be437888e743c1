"""No leg's exception ends in a task nobody awaits (issue 16: "Task exception was never retrieved").

A leg that fails just as its client leaves (the cancel arrives with the leg's
4xx) used to run in wait_for's own task: the request saw the disconnect, and
the leg's ``UpstreamRejected`` was left in that task for the garbage collector
to log. ``orchestrator.flow.within`` runs the leg in the request's own task.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from api.streaming import ClientDisconnected, run_until_disconnect
from orchestrator.errors import RequestTimeoutError, UpstreamRejected
from orchestrator.flow import within

pytestmark = pytest.mark.asyncio


def _leaves_after(seconds: float):
    async def receive():
        await asyncio.sleep(seconds)
        return {"type": "http.disconnect"}
    return receive


async def test_a_leg_failing_as_its_client_leaves_leaves_no_orphaned_exception():
    loop = asyncio.get_running_loop()
    gc.collect()  # tasks that earlier tests' loops left for the collector are theirs, not this leg's
    orphaned: list[dict] = []
    loop.set_exception_handler(lambda _, context: orphaned.append(context))

    async def leg():
        try:
            await asyncio.sleep(10)
        finally:
            raise UpstreamRejected(400, b"{}")  # the worker's 4xx lands as the cancel does

    try:
        with pytest.raises((UpstreamRejected, ClientDisconnected)):
            await run_until_disconnect(_leaves_after(0.05), within(time.monotonic() + 5, leg(), 5))
        gc.collect()
        await asyncio.sleep(0.01)
        assert [c for c in orphaned if isinstance(c.get("exception"), UpstreamRejected)] == []
    finally:
        loop.set_exception_handler(None)


async def test_within_times_out_as_the_api_error():
    with pytest.raises(RequestTimeoutError, match="longer than 0.05 s"):
        await within(time.monotonic() + 0.05, asyncio.sleep(5), 0.05)
    assert await within(time.monotonic() + 5, asyncio.sleep(0, "done"), 5) == "done"
