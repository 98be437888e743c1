"""``disagg reload`` (or SIGHUP to the supervisor): the deployment YAML re-read, its live settings applied.

The supervisor (``disagg.supervisor``) holds the configuration it runs. A
reload reads the file again and validates it whole (a bad file is refused
with its key named, and nothing changes), then compares it with what runs,
key by key:

- the orchestrator's live settings (``orchestrator.config.LiveSettings``: the
  routers' policies and weights, conditional disaggregation, timeouts,
  retries, the admission limit, the log level) are sent to the orchestrator
  (``POST /settings``), which publishes them to every process, and written
  into ``orchestrator.json`` so that a restarted orchestrator keeps them;
- any other key that changed is reported as needing a restart (``disagg down``
  and ``up``), by name, and not applied; ``pools.*.instances`` points at
  ``disagg scale`` instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from orchestrator.config import LIVE_FIELDS, LiveSettings
from orchestrator.typed import ConfigError, to_mapping

if TYPE_CHECKING:
    from disagg.deploy_config import DeployConfig

__all__ = ["ReloadResult", "reload_config", "changed_keys", "is_live", "live_settings"]

IGNORED_KEYS = ("source",)
"""Where the file was read from: not a setting."""


@dataclasses.dataclass(frozen=True)
class ReloadResult:
    ok: bool
    running: DeployConfig
    """What runs afterwards: the old configuration with the live settings applied."""
    lines: tuple[str, ...]
    needs_restart: tuple[str, ...] = ()


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flat(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def changed_keys(old: DeployConfig, new: DeployConfig) -> dict[str, tuple[Any, Any]]:
    """Every leaf key whose value differs: ``{"orchestrator.ctx_router.policy": (old, new)}``."""
    before, after = _flat(to_mapping(old)), _flat(to_mapping(new))
    return {key: (before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key) and key.split(".", 1)[0] not in IGNORED_KEYS}


def is_live(key: str) -> bool:
    section, _, rest = key.partition(".")
    return section == "orchestrator" and rest.split(".", 1)[0] in LIVE_FIELDS


def live_settings(config: DeployConfig) -> LiveSettings:
    return LiveSettings(**{name: getattr(config.orchestrator, name) for name in LIVE_FIELDS})


def reload_config(running: DeployConfig, path: str, run_dir: Path, url: str, api_key: str | None) -> ReloadResult:
    """Re-read ``path``; send its live settings to the orchestrator at ``url`` (with ``api_key``, the
    running one); what runs afterwards and what to say."""
    from disagg.deploy_config import load_deploy_config

    try:
        new = load_deploy_config(path, str(run_dir))
    except ConfigError as exc:
        return ReloadResult(False, running, (f"refused, nothing changed: {exc}",))
    changes = changed_keys(running, new)
    live = {key: change for key, change in changes.items() if is_live(key)}
    restart = [key for key in changes if not is_live(key)]
    lines = []
    if live:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = httpx.post(f"{url}/settings", json=to_mapping(live_settings(new)), headers=headers,
                                  timeout=30)
        except httpx.HTTPError as exc:
            return ReloadResult(False, running, (f"the orchestrator did not take the settings ({exc}); nothing "
                                                 "changed",))
        if response.status_code != 200:
            return ReloadResult(False, running, (f"refused by the orchestrator ({response.status_code}: "
                                                 f"{response.text}); nothing changed",))
        ack = response.json()
        confirmed = f"{ack['processes_confirmed']} of {ack['processes']} orchestrator processes"
        lines += [f"{key}: {old!r} -> {value!r} (applied: {confirmed})" for key, (old, value) in live.items()]
        running = dataclasses.replace(running, orchestrator=dataclasses.replace(
            running.orchestrator, **{name: getattr(new.orchestrator, name) for name in LIVE_FIELDS}))
    for key in restart:
        old, value = changes[key]
        hint = "; `disagg scale` changes a pool's size live" if key.endswith(".instances") else ""
        lines.append(f"{key}: {old!r} -> {value!r} NEEDS A RESTART (not applied){hint}")
    if not changes:
        lines.append("nothing changed")
    return ReloadResult(True, running, tuple(lines), tuple(restart))
