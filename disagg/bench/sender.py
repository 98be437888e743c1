"""One streamed request: raw SSE parsing over httpx, timestamps taken as the bytes arrive.

The stream is split into events by hand (``event:``/``data:`` lines, a blank line ends an event)
rather than through an SSE library: the client must cost far less per token than the server it
measures. Every failure becomes an ``error_kind`` on the record, never an exception:
``http_<status>``, ``timeout``, ``connect``, ``transport``, ``stream_error`` (an error event),
``incomplete`` (the stream ended without its end event), ``empty`` (no text at all, and no generated
token in the usage either: a few tokens of a byte-level vocabulary can make no text, which is an
answer, without a TTFT).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from disagg.bench.api_clients import ApiClient, StreamDelta, Usage
from disagg.bench.metrics import RequestRecord

__all__ = ["send_request"]


async def send_request(client: httpx.AsyncClient, api: ApiClient, base_url: str, body: dict[str, Any],
                       record: RequestRecord, run_start: float) -> str:
    """Send ``body`` to the API's path, stream, fill ``record``; returns the generated text (the next
    turn's assistant message)."""
    start = time.perf_counter()
    record.start = start - run_start
    parts: list[str] = []
    usage = Usage()
    num_chunks, last, done = 0, start, False
    try:
        async with client.stream("POST", base_url + api.path, json=body, headers=api.headers()) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                record.error_kind, record.error = f"http_{response.status_code}", text[:300]
                return ""
            event, data, buffer = "", [], b""
            async for chunk in response.aiter_bytes():
                now = time.perf_counter()
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    line = raw.rstrip(b"\r").decode("utf-8")
                    if line:
                        if line.startswith("data:"):
                            data.append(line[5:].lstrip(" "))
                        elif line.startswith("event:"):
                            event = line[6:].strip()
                        continue
                    if not data:
                        continue
                    delta = _parse(api, event, "\n".join(data))
                    event, data = "", []
                    if delta.error:
                        record.error_kind, record.error = "stream_error", delta.error
                        return "".join(parts)
                    if delta.usage:
                        usage.merge(delta.usage)
                    if delta.text:
                        if num_chunks == 0:
                            record.ttft = now - start
                        else:
                            record.itls.append(now - last)
                        num_chunks, last = num_chunks + 1, now
                        parts.append(delta.text)
                    done = done or delta.done
    except httpx.TimeoutException as exc:
        record.error_kind, record.error = "timeout", repr(exc)
        return "".join(parts)
    except httpx.ConnectError as exc:
        record.error_kind, record.error = "connect", repr(exc)
        return ""
    except httpx.HTTPError as exc:
        record.error_kind, record.error = "transport", repr(exc)
        return "".join(parts)
    record.e2e = time.perf_counter() - start
    record.prompt_tokens, record.cached_tokens = usage.prompt_tokens, usage.cached_tokens
    record.output_tokens = usage.output_tokens if usage.output_tokens is not None else num_chunks
    if not done:
        record.error_kind, record.error = "incomplete", "the stream ended without its end event"
    elif num_chunks == 0 and not usage.output_tokens:
        record.error_kind, record.error = "empty", "no generated text"
    return "".join(parts)


def _parse(api: ApiClient, event: str, data: str) -> StreamDelta:
    try:
        return api.parse(event, data)
    except (ValueError, AttributeError, TypeError) as exc:
        return StreamDelta(error=f"unparsable event {data[:80]!r}: {exc}")
