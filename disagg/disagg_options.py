"""``disagg serve`` options of disaggregated serving: the role, the KV endpoint, the cluster key.

The cluster key travels only in files of mode 0600: the operator's key file
(``--cluster-key-file`` or ``DISAGG_CLUSTER_KEY_FILE``), then the engine's
spec file (0600, deleted once read). Each frontend reads the key file itself;
the key never appears on a command line.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from api.api_key import KeyFileError, read_key_file
from common.config_errors import ConfigError
from workers.disagg_params import CLUSTER_KEY_FILE_ENV, ClusterKeyError, load_cluster_key

if TYPE_CHECKING:
    from disagg.serve_settings import ServeSettings

__all__ = ["DISAGG_OPTIONS", "cluster_key", "key_from_file", "engine_disagg_spec", "frontend_disagg_config", "start_registration"]

DISAGG_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--kv-host", dict(default="127.0.0.1", help="where the engine's KV-transfer agent binds (0.0.0.0: all)")),
    ("--kv-port", dict(type=int, default=0, help="the KV-transfer port (0: a free one)")),
    ("--kv-advertise-host", dict(default=None, help="the host other engines connect to (default: --kv-host)")),
    ("--cluster-key-file", dict(default=None, help=f"file (mode 0600) holding the cluster key, hex or raw; "
                                                   f"default ${CLUSTER_KEY_FILE_ENV}. Required for --role ctx|gen")),
    ("--kv-park-seconds", dict(type=float, default=60.0, help="ctx role: how long a prompt's KV waits for its gen "
                                                              "worker before it is freed")),
    ("--kv-pull-timeout", dict(type=float, default=30.0, help="gen role: a KV pull with no progress for this long "
                                                              "fails (the request is then prefilled here)")),
    ("--register-url", dict(default=None, aliases=("--register",),
                            help="the URL of a running orchestrator to join: this worker registers, heartbeats, "
                                 "and deregisters when it stops (--register URL is the same)")),
    ("--advertise-url", dict(default=None, help="this worker's base URL for the orchestrator "
                                                "(default: http://HOST:PORT)")),
    ("--register-api-key-file", dict(default=None, help="file (mode 0600) with the orchestrator's API key")),
    ("--worker-key-file", dict(default=None, help="file (mode 0600) with the deployment's worker key: every "
                                                  "route but /health then requires it (Authorization: Bearer "
                                                  "KEY); `disagg up` passes <run dir>/worker.key")),
]


def cluster_key(args: ServeSettings) -> bytes | None:
    """The key from --cluster-key-file or the environment; None when neither is set.
    Raises ConfigError for a bad file, or a ctx/gen role without a key."""
    path = args.cluster_key_file or os.environ.get(CLUSTER_KEY_FILE_ENV) or None
    if path is None:
        if args.role != "both":
            raise ConfigError("cluster_key_file", f"--role {args.role} needs a cluster key: pass --cluster-key-file "
                                                  f"or set {CLUSTER_KEY_FILE_ENV}")
        return None
    try:
        return load_cluster_key(path)
    except ClusterKeyError as exc:
        raise ConfigError("cluster_key_file", str(exc)) from exc


def engine_disagg_spec(args: ServeSettings) -> Any:
    """The engine's ``DisaggEngineSpec``, or None for an aggregated worker without a key."""
    from workers.kv_transfer import DisaggEngineSpec

    key = cluster_key(args)
    if key is None:
        return None
    if args.kv_park_seconds <= 0:
        raise ConfigError("kv_park_seconds", f"must be > 0, got {args.kv_park_seconds}")
    if args.kv_pull_timeout <= 0:
        raise ConfigError("kv_pull_timeout", f"must be > 0, got {args.kv_pull_timeout}")
    return DisaggEngineSpec(role=args.role, cluster_key_hex=key.hex(), kv_host=args.kv_host, kv_port=args.kv_port,
                            kv_advertise_host=args.kv_advertise_host, pull_timeout_seconds=args.kv_pull_timeout)


def frontend_disagg_config(args: ServeSettings, engine_info: Any) -> Any:
    """A frontend's ``DisaggConfig`` (role, key, KV endpoint from the engine handshake)."""
    from api.disaggregation import DisaggConfig
    from workers.http_protocol import Role

    return DisaggConfig(role=Role(engine_info.role), cluster_key=cluster_key(args), kv_park_seconds=args.kv_park_seconds,
                        kv_endpoint=engine_info.kv_endpoint, block_size=engine_info.block_size,
                        hash_seed=engine_info.hash_seed)


def key_from_file(path: str | None, flag: str) -> str | None:
    """The key in the file a ``--*-key-file`` flag names (None: no flag); ConfigError naming the flag."""
    if not path:
        return None
    try:
        return read_key_file(path)
    except KeyFileError as exc:
        raise ConfigError(flag, str(exc)) from None


def start_registration(args: ServeSettings, engine_info: Any) -> Any:
    """The launcher's registration task (None without --register-url); cancelled at shutdown."""
    import asyncio

    from disagg.worker_registration import advertised_url, register_forever

    if not args.register_url:
        return None
    api_key = key_from_file(args.register_api_key_file, "register_api_key_file")
    url = advertised_url(args.host, args.port, args.advertise_url)
    return asyncio.get_running_loop().create_task(
        register_forever(args.register_url, args.role, url, engine_info.kv_endpoint, api_key), name="registration")
