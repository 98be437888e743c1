"""api.streaming.DisconnectWatch: a client that leaves cancels the request's task, without a task
of its own; stopping the watch leaves the request alone and closes what it awaited."""

from __future__ import annotations

import asyncio

import pytest

from api.streaming import DisconnectWatch

pytestmark = pytest.mark.asyncio


class Client:
    """An ASGI ``receive``: the body, then ``http.disconnect`` once ``leave()`` (or ``fail()``) is called."""

    def __init__(self, bare_yields: int = 0) -> None:
        self.gone = asyncio.Event()
        self.error: Exception | None = None
        self.bare_yields = bare_yields
        self.num_calls = 0
        self.num_closed = 0

    async def receive(self) -> dict:
        self.num_calls += 1
        if self.num_calls == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        try:
            for _ in range(self.bare_yields):
                await asyncio.sleep(0)
            await self.gone.wait()
        finally:
            self.num_closed += 1
        if self.error is not None:
            raise self.error
        return {"type": "http.disconnect"}


@pytest.mark.parametrize("bare_yields", [0, 3])
async def test_a_client_that_leaves_cancels_the_request_and_the_watch_says_so(bare_yields):
    client = Client(bare_yields)

    async def request() -> str:
        watch = DisconnectWatch(client.receive)
        try:
            await asyncio.sleep(30)
            return "finished"
        except asyncio.CancelledError:
            assert watch.cancelled_us()  # this watch's cancellation, consumed
            return "client left"
        finally:
            watch.stop()

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0.01)
    assert not task.done() and client.num_calls == 2  # the body message did not count as leaving
    client.gone.set()
    assert await asyncio.wait_for(task, 5) == "client left"
    assert not task.cancelled() and task.cancelling() == 0


async def test_receive_failing_counts_as_the_client_gone():
    client = Client()
    client.error = OSError("connection reset")

    async def request() -> bool:
        watch = DisconnectWatch(client.receive)
        try:
            await asyncio.sleep(30)
            return False
        except asyncio.CancelledError:
            return watch.cancelled_us()

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0.01)
    client.gone.set()
    assert await asyncio.wait_for(task, 5) is True


async def test_a_stopped_watch_closes_its_receive_and_never_cancels_the_request():
    client = Client(bare_yields=1)
    watch = DisconnectWatch(client.receive)
    watch.stop()  # while its receive() waits on a bare yield's turn
    await asyncio.sleep(0.01)
    assert client.num_closed == 1
    second = Client()
    watch = DisconnectWatch(second.receive)
    await asyncio.sleep(0.01)
    watch.stop()  # while its receive() waits on the event: the coroutine is closed where it waits
    assert second.num_closed == 1 and not second.gone._waiters  # its waiter was removed, as a cancel would
    second.gone.set()
    await asyncio.sleep(0.01)  # the current task (this test) is not cancelled: we get here
    assert not watch.cancelled_us()


async def test_someone_elses_cancellation_is_not_the_watchs():
    client = Client()

    async def request() -> None:
        watch = DisconnectWatch(client.receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            assert not watch.cancelled_us()
            raise
        finally:
            watch.stop()

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.num_closed == 1
