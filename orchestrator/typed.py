"""Build frozen dataclasses from YAML/JSON mappings, with errors that name the key.

``from_mapping(cls, data, prefix)`` checks unknown keys, missing required
keys and the type of every field (``int``, ``float``, ``bool``, ``str``,
``X | None``, ``tuple[Dataclass, ...]``, ``tuple[str, ...]`` and nested
dataclasses), then calls ``validate(prefix)`` when the class has one. The
error is a ``workers.config.ConfigError`` whose key is the dotted path
(e.g. ``orchestrator.ctx_router.policy``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from common.config_errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # a stub-only protocol: what dataclasses.fields() takes

__all__ = ["from_mapping", "to_mapping", "ConfigError"]

T = TypeVar("T", bound="DataclassInstance")


def from_mapping(cls: type[T], data: Any, prefix: str) -> T:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(known))})")
    values: dict[str, Any] = {}
    for name, spec in known.items():
        key = f"{prefix}.{name}"
        if name in data:
            values[name] = _convert(hints[name], data[name], key)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "is required")
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(prefix)
    return obj


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        real = [option for option in options if option is not type(None)]
        if len(real) == 1:  # `X | None`: X's own error names the nested key
            return _convert(real[0], value, key)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        if len(errors) == 1:  # X | None: X's own message says what was expected
            raise ConfigError(key, errors[0].split(": ", 1)[1])
        raise ConfigError(key, f"has the wrong type: {value!r}")
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {type(value).__name__}")
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    if hint is Any:
        return value
    raise ConfigError(key, f"unsupported field type {hint!r}")  # a bug in the schema, not the file


def to_mapping(obj: Any) -> Any:
    """The inverse: plain dicts/lists, for writing a config back to JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_mapping(v) for v in obj]
    return obj
