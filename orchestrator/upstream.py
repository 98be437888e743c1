"""The orchestrator's HTTP clients to the workers, sharded.

httpx's connection pool (httpcore) does work proportional to its
connections times its waiting requests on every request: one client with 256
requests in flight served about 60 requests/s on a 2-core box where the
worker alone served 1,100. Requests therefore rotate over ``SHARDS`` clients,
each with a small pool (keep-alive connections per worker stay bounded by
the requests in flight, spread over the shards).
"""

from __future__ import annotations

import itertools

import httpx

__all__ = ["UpstreamClients", "SHARDS"]

SHARDS = 32


class UpstreamClients:
    def __init__(self, timeout: httpx.Timeout, shards: int = SHARDS) -> None:
        self._clients = [httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                                max_keepalive_connections=64))
                         for _ in range(shards)]
        self._turn = itertools.cycle(self._clients)

    def next(self) -> httpx.AsyncClient:
        """The client for the next request (round robin)."""
        return next(self._turn)

    @property
    def first(self) -> httpx.AsyncClient:
        """For the low-rate control calls (health, worker info, KV events, perf)."""
        return self._clients[0]

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()
