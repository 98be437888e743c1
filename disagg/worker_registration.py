"""A worker registers itself with an orchestrator (``--register-url``), then heartbeats.

POST {url}/workers/register {"role", "url", "kv_endpoint"} -> {"worker_id", "heartbeat_seconds"};
POST {url}/workers/heartbeat {"worker_id"} (404: the orchestrator forgot us, register again);
POST {url}/workers/deregister {"worker_id"} at shutdown (the Structs of ``orchestrator.state_protocol``). An orchestrator that is down is retried
every ``RETRY_SECONDS``, never fatal: the worker keeps serving whoever reaches it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable

import httpx
import msgspec

from orchestrator.state_protocol import Registration, RegistrationAck, WorkerIdBody

__all__ = ["RETRY_SECONDS", "advertised_url", "register_forever"]

log = logging.getLogger("disagg.registration")

RETRY_SECONDS = 2.0
TIMEOUT = httpx.Timeout(10.0, connect=5.0)
_ENCODER = msgspec.json.Encoder()
_ACK = msgspec.json.Decoder(RegistrationAck)
_JSON = {"content-type": "application/json"}


def advertised_url(host: str, port: int, advertise_url: str | None) -> str:
    if advertise_url:
        return advertise_url.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


async def register_forever(register_url: str, role: str, url: str, kv_endpoint: str | None,
                           api_key: str | None = None) -> None:
    """Run until cancelled (the worker's shutdown), then deregister."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=TIMEOUT, headers=headers) as client:
        registration = _Registration(client, register_url.rstrip("/"), role, url, kv_endpoint)
        try:
            while True:
                try:
                    wait = await registration.register_or_beat()
                except (httpx.HTTPError, msgspec.DecodeError) as exc:
                    log.warning("registration with %s failed (%s); retrying", registration.base, exc)
                    wait = RETRY_SECONDS
                await asyncio.sleep(wait)
        finally:
            await registration.deregister()


class _Registration:
    def __init__(self, client: httpx.AsyncClient, base: str, role: str, url: str, kv_endpoint: str | None) -> None:
        self.client, self.base = client, base
        self.body = Registration(role=role, url=url, kv_endpoint=kv_endpoint)
        self.worker_id: str | None = None
        self.heartbeat_seconds = RETRY_SECONDS

    async def register_or_beat(self) -> float:
        """Seconds to the next heartbeat."""
        if self.worker_id is not None:
            response = await self._post("heartbeat", WorkerIdBody(self.worker_id))
            if response.status_code != 404:
                response.raise_for_status()
                return self.heartbeat_seconds
            log.warning("the orchestrator %s forgot worker %s: registering again", self.base, self.worker_id)
            self.worker_id = None
        response = await self._post("register", self.body)
        response.raise_for_status()
        answer = _ACK.decode(response.content)
        self.worker_id = answer.worker_id
        self.heartbeat_seconds = answer.heartbeat_seconds
        log.info("registered with %s as %s (%s role)", self.base, self.worker_id, self.body.role)
        return self.heartbeat_seconds

    def _post(self, route: str, body: msgspec.Struct) -> Awaitable[httpx.Response]:
        return self.client.post(f"{self.base}/workers/{route}", content=_ENCODER.encode(body), headers=_JSON)

    async def deregister(self) -> None:
        if self.worker_id is None:
            return
        try:
            await asyncio.wait_for(
                self._post("deregister", WorkerIdBody(self.worker_id)), timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown; the orchestrator's TTL drops us anyway
            log.info("deregistration from %s failed: %s", self.base, exc)
