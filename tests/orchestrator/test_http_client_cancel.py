"""A cancelled call on the lean HTTP client ends in CancelledError wherever the cancellation lands
(issue 27 item 3, a real Unix socket).

On Python 3.11 ``asyncio.wait_for`` swallowed a cancellation that landed as its connect finished;
the state link, cancelled at shutdown while it retried a dead owner (every connect refused at once,
so the race was likely), then retried for ever, and the process hung in uvicorn's "Waiting for
application shutdown" (seen after orchestrator process 0 was killed, 2 times of 3).
"""

from __future__ import annotations

import asyncio
import random
import socket

from orchestrator.http_client import HttpClient, UpstreamError


def test_a_cancelled_call_is_cancelled_wherever_the_cancellation_lands(tmp_path):
    path = str(tmp_path / "gone.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.close()  # the file stays, nobody listens: every connect is refused at once (a dead owner)

    async def follow(client: HttpClient) -> None:
        while True:  # the state link's loop: retry whatever the owner answers
            try:
                await client.call("GET", "http://state/snapshot")
            except UpstreamError:
                await asyncio.sleep(0)

    async def main() -> int:
        client = HttpClient(connect_timeout=1.0, idle_timeout=1.0, uds=path)
        rng = random.Random(7)
        for _ in range(300):
            task = asyncio.create_task(follow(client))
            for _ in range(rng.randrange(1, 40)):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=2.0)
            assert done, "a cancelled call went on"
            assert task.cancelled()
        return 300

    assert asyncio.run(main()) == 300
