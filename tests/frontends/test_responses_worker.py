"""Stored responses through a real K=2 worker: every frontend continues any conversation
(the launcher owns the store; attached frontends reach it over the admin socket)."""

from __future__ import annotations

import httpx
import openai
from worker_process import start_worker, stop_worker


def fresh(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10, limits=httpx.Limits(max_keepalive_connections=0))


def test_conversations_continue_through_any_frontend(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, 2)
    try:
        # A fresh connection per request: the kernel spreads them over both frontends.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=fresh(url), max_retries=0)
        previous, served_by, input_tokens = None, set(), []
        for turn in range(8):
            raw = client.responses.with_raw_response.create(
                model="tiny-test", input=f"turn {turn}", max_output_tokens=3, previous_response_id=previous,
                stream=turn % 2 == 1)
            served_by.add(raw.headers["x-disagg-frontend"])
            response = raw.parse()
            if turn % 2:  # a stream: its last event holds the response
                response = [event for event in response][-1].response
            assert response.status == "incomplete" and response.usage.output_tokens == 3
            input_tokens.append(response.usage.input_tokens)
            previous = response.id
        assert served_by == {"0", "1"}
        assert input_tokens == sorted(input_tokens) and len(set(input_tokens)) == 8  # the prompt grows
        with fresh(url) as http:
            for _ in range(6):
                assert http.get(f"/v1/responses/{previous}").json()["id"] == previous
                items = http.get(f"/v1/responses/{previous}/input_items", params={"limit": 100}).json()["data"]
                assert len(items) == 15  # 8 inputs and 7 outputs before the last output
                # The launcher's store is reachable over its admin socket only, never over TCP.
                assert http.get(f"/_admin/responses/{previous}").status_code == 404
                assert http.put(f"/_admin/responses/{previous}", content=b"{}").status_code in (404, 405)
            assert http.delete(f"/v1/responses/{previous}").json()["deleted"] is True
            assert http.get(f"/v1/responses/{previous}").status_code == 404
    finally:
        assert stop_worker(proc) == 0
