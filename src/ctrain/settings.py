"""Typed settings: plain dataclasses filled from YAML mappings with strict validation.

Unknown keys name the bad key, list the valid ones and suggest the closest; wrong types and
values outside a ``Literal`` name the dotted path. Used by the project config and by recipes.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from ctrain.errors import ConfigError

T = TypeVar("T")


def _unknown_key(key: str, valid: Iterable[str], where: str) -> ConfigError:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1)
    guess = f" (did you mean '{close[0]}'?)" if close else ""
    path = f"{where}.{key}" if where else key
    return ConfigError(
        f"unknown key '{path}'{guess}; valid keys{' under ' + where if where else ''}: {', '.join(valid)}"
    )


def _typename(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"'{where}' must not be empty")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"'{where}': {value!r} fits none of {_typename(tp)}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"'{where}' is {value!r}; valid values: {', '.join(map(str, choices))}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{where}' must be a mapping of settings, got {value!r}")
        return from_mapping(tp, value, where=where)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{where}' must be a list, got {value!r}")
        args = get_args(tp)
        item = args[0] if args else Any
        items = [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{where}' must be a mapping, got {value!r}")
        args = get_args(tp)
        vt = args[1] if args else Any
        return {str(k): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"'{where}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"'{where}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 2e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"'{where}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"'{where}' must be a string, got {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value).expanduser()
        raise ConfigError(f"'{where}' must be a path, got {value!r}")
    return value


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, *, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types.

    A dataclass may define ``validate(self)`` to check relations between fields; it runs
    after construction and raises :class:`ConfigError`.
    """
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            raise _unknown_key(str(key), fields, where)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(value, hints[name], f"{where}.{name}" if where else name)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def to_mapping(obj: Any) -> Any:
    """Plain YAML-friendly data from a settings dataclass (inverse of :func:`from_mapping`)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_mapping(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_mapping(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings at the top level, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a nested mapping, in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key=value (e.g. training.max_steps=100)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return data


def field_names(cls: type) -> list[str]:
    """Names of a settings dataclass's fields, for help texts and error messages."""
    return [f.name for f in dataclasses.fields(cls)]


__all__ = ["apply_overrides", "field_names", "from_mapping", "load_yaml", "to_mapping"]
