"""The orchestrator's forwarded worker routes answer a malformed body with a 400, not a 500.

``_forward`` raises a typed ``InvalidRequestError``: a bare ``ValueError`` is
a bug to ``http_error`` (a logged 500), so the check must not use one.
"""

from __future__ import annotations

import httpx
from orchestrator_process import start_orchestrator, stop_orchestrator


def test_malformed_registration_body_is_a_400(tiny_model_dir, tmp_path):
    url, orch = start_orchestrator(tmp_path, tiny_model_dir, [], processes=1, wait_healthy=False)
    try:
        response = httpx.post(f"{url}/workers/register", content=b"{not json", timeout=10)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed JSON body: ")
    finally:
        assert stop_orchestrator(orch) == 0
