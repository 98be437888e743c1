"""The local supervisor's control channel: a command asks, the supervisor answers, through the run dir.

``disagg drain``, ``scale`` and ``reload`` ask the running supervisor
(``disagg.supervisor``) to change what it runs. A request is one file,
``<run dir>/control/<id>.request.json`` (written to a temporary name and
renamed, so the supervisor never reads half of one); the supervisor picks it
up within its 0.2 s round, acts, and writes ``<id>.answer.json`` the same
way. Files, not a socket: the supervisor is a plain polling loop with no
event loop to serve one, the run dir is already private to the deployment's
owner, and a supervisor that is gone simply never answers (the command says
so after its timeout). Every file is a Struct of this module, decoded with
its type; one that does not decode is answered as refused, never fatal.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import msgspec

__all__ = ["RetireWorkers", "AddWorkers", "Reload", "ControlRequest", "ControlAnswer", "ask_supervisor",
           "take_requests", "answer_request", "CONTROL_DIR", "SupervisorSilent"]

CONTROL_DIR = "control"
ANSWER_SECONDS = 30.0
"""How long a command waits for the supervisor's answer (it answers within a round, 0.2 s, unless busy)."""


class RetireWorkers(msgspec.Struct, tag="retire", kw_only=True):
    """Stop these workers (SIGTERM: they finish what they hold) and never restart them. The command has
    drained them first (``disagg drain``)."""

    names: list[str]


class AddWorkers(msgspec.Struct, tag="add", kw_only=True):
    """Start ``count`` more workers of ``pool`` (ctx or gen); they register with the orchestrator."""

    pool: str
    count: int


class Reload(msgspec.Struct, tag="reload", kw_only=True):
    """Re-read the deployment YAML and apply what can change live (``disagg.live_settings``)."""

    config: str | None = None
    """Another file than the one ``up`` read; None: that one."""


ControlRequest = RetireWorkers | AddWorkers | Reload


class ControlAnswer(msgspec.Struct, kw_only=True):
    ok: bool
    message: str
    """What was done, or why not (a line per change for a reload)."""
    started: dict[str, str] = {}
    """AddWorkers: each new worker's name and URL."""
    needs_restart: list[str] = []
    """Reload: the changed keys that cannot change live (not applied)."""


class SupervisorSilent(RuntimeError):
    """The supervisor did not answer in time (it is gone, or stuck)."""


_REQUEST = msgspec.json.Decoder(ControlRequest)
_ANSWER = msgspec.json.Decoder(ControlAnswer)


def _write(path: Path, payload: msgspec.Struct) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(payload))
    tmp.replace(path)


def ask_supervisor(run_dir: Path, request: ControlRequest, timeout: float = ANSWER_SECONDS) -> ControlAnswer:
    """Send ``request`` and wait for the answer (SupervisorSilent past ``timeout``)."""
    control = run_dir / CONTROL_DIR
    control.mkdir(mode=0o700, exist_ok=True)
    ident = uuid.uuid4().hex
    answer_path = control / f"{ident}.answer.json"
    _write(control / f"{ident}.request.json", request)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answer = _ANSWER.decode(answer_path.read_bytes())
        except FileNotFoundError:
            time.sleep(0.05)
            continue
        answer_path.unlink(missing_ok=True)
        return answer
    (control / f"{ident}.request.json").unlink(missing_ok=True)  # nobody acts on it later by surprise
    raise SupervisorSilent(f"the supervisor did not answer within {timeout:g} s (see {run_dir / 'up.log'})")


def take_requests(run_dir: Path) -> list[tuple[str, ControlRequest | str]]:
    """The requests waiting, oldest first, each removed: (id, request), or (id, why it was refused)."""
    control = run_dir / CONTROL_DIR
    if not control.is_dir():
        return []
    taken: list[tuple[str, ControlRequest | str]] = []
    for path in sorted(control.glob("*.request.json"), key=_mtime):
        ident = path.name.split(".", 1)[0]
        try:
            request: ControlRequest | str = _REQUEST.decode(path.read_bytes())
        except msgspec.DecodeError as exc:
            request = f"malformed request: {exc}"
        except FileNotFoundError:
            continue
        path.unlink(missing_ok=True)
        taken.append((ident, request))
    return taken


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # taken back by a command that stopped waiting
        return 0.0


def answer_request(run_dir: Path, ident: str, answer: ControlAnswer) -> None:
    _write(run_dir / CONTROL_DIR / f"{ident}.answer.json", answer)
