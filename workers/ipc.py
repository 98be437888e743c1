"""Authenticated ZeroMQ messaging inside one worker.

Every message is two frames, ``[mac, payload]``: ``payload`` is the
MessagePack of one protocol struct, ``mac`` its HMAC-SHA256 under the
worker's key. A message whose MAC does not check is dropped, counted and
logged, and never decoded: a local process that can reach the sockets but not
the key cannot make the engine parse anything.

Sockets live as ``ipc://`` files in a private directory (mode 0700); the
socket options here are chosen so that no peer can block the engine:
every engine-side send is non-blocking, bounded by a high-water mark, and
sockets close with ``LINGER`` 0. Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq

__all__ = [
    "KEY_BYTES",
    "HEARTBEAT_SECONDS",
    "ENGINE_SILENCE_LIMIT",
    "ENGINE_WEDGED_SECONDS",
    "LANE_SNDHWM",
    "INGRESS_HWM",
    "FrameCodec",
    "IpcPaths",
    "make_ipc_dir",
    "new_key",
    "write_private_file",
    "configure_engine_push",
    "configure_frontend_push",
    "send_nowait",
]

log = logging.getLogger(__name__)

KEY_BYTES = 32
# The engine sends an empty OutputBatch on every lane this often. A frontend
# that hears nothing for ENGINE_SILENCE_LIMIT heartbeats calls the engine
# unresponsive (/health 503, new requests refused, in-flight ones wait); only
# silence past ENGINE_WEDGED_SECONDS, or its process gone, is death. Slow is not
# dead: a CPU-starved machine delays heartbeats by seconds, and killing a
# worker for that loses its KV cache and every in-flight request.
HEARTBEAT_SECONDS = 1.0
ENGINE_SILENCE_LIMIT = 5
ENGINE_WEDGED_SECONDS = 300.0
# Lane messages are per-step batches. A frontend 4096 steps behind is dead or
# stuck (at a 10 ms decode step that is 40 s of output); past that the engine
# drops the lane's output and aborts its requests instead of growing memory.
LANE_SNDHWM = 4096
# Ingress carries requests and aborts from every frontend; the engine drains
# it completely every loop, so this only bounds a burst while a step runs.
INGRESS_HWM = 100_000
# Unix socket paths are limited to 107 bytes; keep the directory short.
_MAX_SOCKET_PATH = 100
_SHA256_BLOCK = 64
_SEND_FIRST = zmq.NOBLOCK | zmq.SNDMORE
# pyzmq's own threshold: below it a zero-copy send copies anyway, after building a tracked Frame.
_ZERO_COPY_BYTES = zmq.COPY_THRESHOLD

T = TypeVar("T")


class FrameCodec(Generic[T]):
    """Signs outgoing and checks incoming ``[mac, payload]`` messages.

    ``num_rejected`` counts messages dropped for a bad MAC or frame count;
    ``num_undecodable`` those with a valid MAC whose payload is not a ``T``
    (a version mismatch between processes of one worker: a bug, logged).
    """

    def __init__(self, key: bytes, decode_type: Any, name: str) -> None:
        if len(key) < 16:
            raise ValueError(f"HMAC key must be at least 16 bytes, got {len(key)}")
        self._inner, self._outer = _hmac_pads(key)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self.name = name
        self.num_rejected = 0
        self.num_undecodable = 0

    def mac(self, payload: bytes | memoryview) -> bytes:
        # HMAC-SHA256 continued from the key's padded states (what hmac.new does inside, without
        # re-deriving them per frame): byte-identical to hmac.digest and ~2.4x cheaper on small frames.
        inner = self._inner.copy()
        inner.update(payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def encode_payload(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def encode(self, message: Any) -> list[bytes]:
        payload = self._encoder.encode(message)
        return [self.mac(payload), payload]

    def decode(self, frames: list[bytes] | list[zmq.Frame]) -> T | None:
        """The message, or None when it was dropped (bad MAC, bad frames, bad payload)."""
        if len(frames) != 2:
            self._reject(f"{len(frames)} frames instead of 2")
            return None
        mac, payload = frames  # (unpacked as they are: a generator per message cost a tenth of the decode)
        if isinstance(mac, zmq.Frame):
            mac = mac.bytes
        if isinstance(payload, zmq.Frame):
            payload = payload.bytes
        if not hmac.compare_digest(mac, self.mac(payload)):
            self._reject("HMAC check failed")
            return None
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            self.num_undecodable += 1
            log.error("%s: dropped an authenticated but undecodable message: %s", self.name, exc)
            return None

    def _reject(self, why: str) -> None:
        self.num_rejected += 1
        # The first ten, then every thousandth: a flood of forged frames must not flood the log.
        if self.num_rejected <= 10 or self.num_rejected % 1000 == 0:
            log.warning("%s: dropped a message (%s); %d rejected so far", self.name, why, self.num_rejected)
        return None


def _hmac_pads(key: bytes) -> tuple[Any, Any]:
    """SHA-256 states after ``key ^ ipad`` and ``key ^ opad`` (RFC 2104); a key longer than the
    64-byte block is hashed first, as RFC 2104 says."""
    if len(key) > _SHA256_BLOCK:
        key = hashlib.sha256(key).digest()
    key = key.ljust(_SHA256_BLOCK, b"\0")
    return (hashlib.sha256(bytes(b ^ 0x36 for b in key)), hashlib.sha256(bytes(b ^ 0x5C for b in key)))


@dataclass(frozen=True)
class IpcPaths:
    """The socket files of one worker, all inside its private directory."""

    dir: Path

    @property
    def ingress(self) -> str:
        return f"ipc://{self.dir}/ingress.sock"

    @property
    def control(self) -> str:
        return f"ipc://{self.dir}/control.sock"

    @property
    def status(self) -> str:
        """The launcher's readiness channel (engine and attached frontends PUSH here)."""
        return f"ipc://{self.dir}/status.sock"

    @property
    def launcher_admin(self) -> Path:
        """The launcher's admin HTTP Unix socket (launcher-owned routes, docs/architecture.md)."""
        return self.dir / "launcher.sock"

    @property
    def perf(self) -> str:
        """The launcher's perf-record channel (attached frontends PUSH ``PerfRecordBatch``)."""
        return f"ipc://{self.dir}/perf.sock"

    @property
    def prometheus_dir(self) -> Path:
        """PROMETHEUS_MULTIPROC_DIR of every process of the worker."""
        return self.dir / "prometheus"

    @property
    def frontends_down(self) -> Path:
        """The frontends the launcher left down (``workers.frontends_down``); absent while none is."""
        return self.dir / "frontends-down.json"

    def lane(self, frontend_id: int) -> str:
        return f"ipc://{self.dir}/lane-{frontend_id}.sock"

    def attach_file(self, frontend_id: int) -> Path:
        return self.dir / f"attach-{frontend_id}.json"

    @property
    def engine_spec_file(self) -> Path:
        return self.dir / "engine-spec.json"


def make_ipc_dir(prefix: str = "disagg-") -> IpcPaths:
    """Create a fresh private (0700) directory for one worker's sockets."""
    base = tempfile.gettempdir()
    if len(base) + 40 > _MAX_SOCKET_PATH:
        base = "/tmp"  # TMPDIR too long for Unix socket paths
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    os.chmod(path, 0o700)
    return IpcPaths(path)


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def write_private_file(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file of mode 0600 (never readable by others, even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def configure_engine_push(sock: zmq.Socket, sndhwm: int = LANE_SNDHWM) -> None:
    """An engine-side PUSH: bounded queue, nothing kept at close."""
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.LINGER, 0)


def configure_frontend_push(sock: zmq.Socket) -> None:
    """A frontend's ingress PUSH: a large queue, and a short linger so that the
    aborts a frontend sends while closing still reach the engine."""
    sock.setsockopt(zmq.SNDHWM, INGRESS_HWM)
    sock.setsockopt(zmq.LINGER, 500)


def send_nowait(sock: zmq.Socket, codec: FrameCodec, message: Any) -> bool:
    """Send without ever blocking; False when the peer's queue is full (zmq.Again).

    The two frames go out as two direct sends (send_multipart's loop and Frame objects cost
    more than the sends on a small message). The high-water mark is checked on a message's
    first frame only, so a message is never cut after its MAC. Small payloads are copied
    (cheaper than zero-copy's tracking); large ones (long prompts) are not.
    """
    payload = codec.encode_payload(message)
    try:
        sock.send(codec.mac(payload), _SEND_FIRST)
    except zmq.Again:
        return False
    sock.send(payload, zmq.NOBLOCK, copy=len(payload) < _ZERO_COPY_BYTES)
    return True
