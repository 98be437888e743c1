"""A bounded client loop for the live-change tests: N threads send completions until stopped.

Each request is recorded with its start time, its outcome and the workers
that served it (the orchestrator's ``x-disagg-ctx-worker`` and
``x-disagg-gen-worker`` headers, worker ids, mapped to URLs through
``/cluster_info``), so a test can say: nothing failed, and after a moment a
worker got no new request (or some).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx

__all__ = ["Served", "LoadLoop"]


@dataclasses.dataclass(frozen=True)
class Served:
    start: float
    status: int | str
    """The HTTP status, or the exception's name when none came."""
    ctx: str | None
    gen: str | None
    """The workers' URLs (None: that leg did not run)."""


class LoadLoop:
    def __init__(self, url: str, model: str, concurrency: int = 6, max_tokens: int = 6,
                 api_key: str | None = None) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.served: list[Served] = []
        self._ids: dict[str, str] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(concurrency)]

    def __enter__(self) -> LoadLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _url_of(self, client: httpx.Client, worker_id: str | None) -> str | None:
        if worker_id is None:
            return None
        if worker_id not in self._ids:
            for worker in client.get(f"{self.url}/cluster_info").json()["workers"]:
                self._ids[worker["worker_id"]] = worker["url"]
        return self._ids.get(worker_id, worker_id)

    def _loop(self, index: int) -> None:
        with httpx.Client(timeout=60, headers=self.headers) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                start = time.monotonic()
                try:
                    response = client.post(f"{self.url}/v1/completions", json={
                        "model": self.model, "prompt": f"load {index} {n} " * 4, "max_tokens": self.max_tokens})
                    status: int | str = response.status_code
                    ctx = self._url_of(client, response.headers.get("x-disagg-ctx-worker"))
                    gen = self._url_of(client, response.headers.get("x-disagg-gen-worker"))
                except httpx.HTTPError as exc:
                    status, ctx, gen = type(exc).__name__, None, None
                self.served.append(Served(start, status, ctx, gen))

    def failed(self) -> list[Served]:
        return [s for s in self.served if s.status != 200]

    def to(self, url: str, after: float = 0.0) -> int:
        """Requests started after ``after`` (time.monotonic) that a leg sent to ``url``."""
        return sum(1 for s in self.served if s.start > after and url in (s.ctx, s.gen))

    def wait_for(self, count: int, timeout: float = 30.0) -> None:
        """Until ``count`` more requests have been served."""
        target = len(self.served) + count
        deadline = time.monotonic() + timeout
        while len(self.served) < target:
            assert time.monotonic() < deadline, f"the load loop served {len(self.served)}, not {target}"
            time.sleep(0.05)
