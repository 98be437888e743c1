"""``disagg serve``'s settings: one frozen, typed object built once from the parsed flags.

The launcher passes it down instead of the ``argparse.Namespace`` and renders
its attached frontends' command line from it (``argv``), so every process of
a worker runs with the same settings. A field is its flag's name with the
dashes as underscores (``--max-num-seqs``: ``max_num_seqs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from common.config_errors import ConfigError

__all__ = ["ServeSettings", "render_flags"]

# The fields the attached frontends are not given as flags: the positional argument, and the
# command they run itself.
_NOT_FLAGS = ("model_dir", "frontend_command")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeSettings:
    model_dir: str
    host: str
    port: int
    num_frontends: int | None
    engine: str
    tensor_parallel_size: int
    role: str
    block_size: int
    num_blocks: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    stream_interval: int
    max_model_len: int | None
    dtype: str
    device: str
    synthetic_decode_step_seconds: float
    synthetic_prefill_seconds_per_token: float
    synthetic_onboard_seconds_per_block: float
    kv_host_tier_bytes: int
    kv_disk_tier_path: str | None
    kv_disk_tier_bytes: int
    served_model_name: str | None
    tool_call_parser: str | None
    grace_seconds: float
    decode_attention: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    engine_threads: int | None
    weights: str
    profile_dir: str | None
    state_dir: str | None
    max_request_bytes: int
    max_concurrent_requests: int | None
    max_queued_requests: int | None
    max_queued_prompt_tokens: int | None
    access_log: bool
    strict_request_fields: bool
    max_perf_records: int | None
    perf_record_seconds: float | None
    admin_timeout: float
    engine_start_timeout: float
    engine_wedged_seconds: float
    frontend_start_timeout: float
    frontend_command: str | None
    log_level: str
    log_format: str
    otlp_endpoint: str | None
    trace_service_name: str
    kv_host: str
    kv_port: int
    kv_advertise_host: str | None
    cluster_key_file: str | None
    kv_park_seconds: float
    kv_pull_timeout: float
    register_url: str | None
    advertise_url: str | None
    register_api_key_file: str | None
    worker_key_file: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        """The settings of parsed ``disagg serve`` flags (raises ConfigError naming a missing or
        mistyped flag)."""
        hints = typing.get_type_hints(cls)
        values = {}
        for field in dataclasses.fields(cls):
            flag = field.name if field.name == "model_dir" else "--" + field.name.replace("_", "-")
            if not hasattr(args, field.name):
                raise ConfigError(flag, "missing from the parsed arguments")
            value = getattr(args, field.name)
            if field.name == "model_dir":
                value = str(value)  # a Path from callers that build the namespace themselves
            if not _is_instance(value, hints[field.name]):
                raise ConfigError(flag, f"expected {hints[field.name]}, got {value!r}")
            values[field.name] = value
        return cls(**values)

    def argv(self, prefix: list[str], num_frontends: int) -> list[str]:
        """An attached frontend's command line: ``prefix`` (the interpreter and the CLI module),
        ``serve``, the model and every flag that has a value, ``--num-frontends`` as resolved."""
        flags: dict[str, object] = {"--" + field.name.replace("_", "-"): getattr(self, field.name)
                                    for field in dataclasses.fields(self) if field.name not in _NOT_FLAGS}
        flags["--num-frontends"] = num_frontends
        return [*prefix, "serve", self.model_dir, *render_flags(flags)]


def render_flags(options: dict[str, object]) -> list[str]:
    """``disagg serve`` flags from a mapping: None is left out, True is the bare flag, False
    ``--no-FLAG``, anything else ``FLAG VALUE``."""
    argv: list[str] = []
    for flag, value in options.items():
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _is_instance(value: object, hint: object) -> bool:
    allowed = typing.get_args(hint) or (hint,)
    if value is None:
        return type(None) in allowed
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True  # argparse's float default may be written as an int
    return isinstance(value, tuple(t for t in allowed if isinstance(t, type)))
