"""Is every orchestrator process ready to route?

The orchestrator runs K_o processes on one port; one ``/health`` 200 proves
only the process that answered it (the others may not have seen a healthy
worker yet). Fresh connections are spread over the processes by
SO_REUSEPORT, so ``disagg up`` probes on new connections and calls the
deployment ready once every process index has answered 200.
"""

from __future__ import annotations

__all__ = ["health_progress"]


def health_progress(url: str, ready_processes: set[int], headers: dict[str, str] | None = None,
                    probes: int = 8) -> str:
    """``"ready"`` once every process has answered ``/health`` 200, else a progress line.

    ``ready_processes`` carries the indices seen so far from one call to the next; ``headers``
    present the API key, which /cluster_info needs when the orchestrator has one."""
    import httpx

    try:
        for _ in range(probes):
            response = httpx.get(f"{url}/health", timeout=2)  # a new connection each time
            if response.status_code != 200:
                break
            health = response.json()
            ready_processes.add(health["process_index"])
            if len(ready_processes) >= health["processes"]:
                return "ready"
        else:
            return f"{len(ready_processes)}/{health['processes']} orchestrator processes ready"
        workers = httpx.get(f"{url}/cluster_info", headers=headers, timeout=2).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return "waiting for the orchestrator"
    return f"{sum(w['healthy'] for w in workers)}/{len(workers)} workers healthy"
