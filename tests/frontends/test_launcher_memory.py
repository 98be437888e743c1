"""The launcher's memory under steady load stays flat: its perf-record store keeps at most
``--max-perf-records`` unread records (it used to keep 100,000 and grew for hours)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.worker_process import rss_mb, start_worker, stop_worker

MAX_RECORDS = 300
NUM_REQUESTS = 1500
CONCURRENCY = 16


async def _load(url: str, count: int) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            for attempt in range(3):  # a keep-alive connection the server closed as it was reused: once more
                try:
                    response = await http.post("/v1/completions", json={
                        "model": "tiny-test", "prompt": f"steady {i}", "max_tokens": 1})
                    break
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    if attempt == 2:
                        raise
            assert response.status_code == 200

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(CONCURRENCY)))


@pytest.mark.slow
def test_a_launcher_under_steady_load_keeps_a_bounded_store_and_a_flat_rss(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, 1, extra_args=["--max-perf-records", str(MAX_RECORDS)])
    try:
        asyncio.run(_load(url, NUM_REQUESTS // 3))  # warm: caches, allocator arenas, the first records
        warm = rss_mb(proc.pid)
        asyncio.run(_load(url, NUM_REQUESTS - NUM_REQUESTS // 3))
        grown = rss_mb(proc.pid) - warm
        records = httpx.get(f"{url}/perf_metrics").json()
        assert len(records) == MAX_RECORDS  # the newest; the older ones went unread
        assert grown < 4, f"the launcher grew {grown:.1f} MB over {NUM_REQUESTS * 2 // 3} requests"
    finally:
        stop_worker(proc)
