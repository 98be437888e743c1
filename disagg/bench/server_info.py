"""What the benchmarked server says about itself, recorded in the results file beside the figures.

Asked once before the run, each route with a short timeout; a route the server does not have (404,
not JSON, no answer) is recorded as null, so any OpenAI-compatible server works:

- ``/version``: disagg (orchestrator and worker), vLLM and SGLang answer ``{"version": ...}``.
- ``/cluster_info``: a disagg orchestrator's workers (their roles, URLs and engine settings) and its
  routers' settings: the deployment's configuration as it runs.
- ``/get_server_info``: SGLang's server arguments.
- ``/v1/models``: the served model's card (vLLM adds ``max_model_len``; ours its context length).
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["ROUTES", "server_info"]

ROUTES = {"version": "/version", "cluster_info": "/cluster_info", "server_info": "/get_server_info",
          "models": "/v1/models"}


def _get_json(client: httpx.Client, url: str) -> Any:
    try:
        response = client.get(url)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # no such route on this server, or not JSON: absent
        return None


def server_info(base_url: str, headers: dict[str, str], timeout: float = 5.0) -> dict[str, Any]:
    """``{"version": ..., "cluster_info": ..., "server_info": ..., "models": ...}``, each the route's
    JSON or None; ``headers`` carry the API key as the benchmarked API sends it."""
    with httpx.Client(headers=headers, timeout=timeout) as client:
        return {name: _get_json(client, base_url.rstrip("/") + path) for name, path in ROUTES.items()}
