"""Typed settings: plain dataclasses filled from YAML mappings with strict validation.

Unknown keys name the bad key, list the valid ones and suggest the closest; wrong types and
values outside a ``Literal`` name the dotted path. Used by the project config and by recipes;
:func:`override` applies command-line flags to a section with the same checks.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from ctrain.errors import ConfigError
from ctrain.files import read_text_bounded

T = TypeVar("T")


def _unknown_key(key: str, valid: Iterable[str], where: str) -> ConfigError:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1)
    guess = f" (did you mean '{close[0]}'?)" if close else ""
    path = f"{where}.{key}" if where else key
    return ConfigError(
        f"unknown key '{path}'{guess}; valid keys{' under ' + where if where else ''}: {', '.join(valid)}", key=path
    )


def _typename(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# The spellings YAML 1.1 reads as each boolean.
_YAML_BOOLS = {True: ("true", "yes", "on", "y"), False: ("false", "no", "off", "n")}


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"'{where}' must not be empty", key=where)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        message = errors[0] if len(errors) == 1 else f"'{where}': {value!r} fits none of {_typename(tp)}"
        raise ConfigError(message, key=where)
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool):
            # YAML reads a bare off/no/on/yes as a boolean: take it as the choice it spells.
            spelled = [c for c in choices if isinstance(c, str) and c.lower() in _YAML_BOOLS[value]]
            if len(spelled) == 1:
                return spelled[0]
        if value not in choices:
            raise ConfigError(f"'{where}' is {value!r}; valid values: {', '.join(map(str, choices))}", key=where)
        return value
    if dataclasses.is_dataclass(tp):
        if value is None:  # a section whose settings are all commented out
            return from_mapping(tp, {}, where=where)
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{where}' must be a mapping of settings, got {value!r}", key=where)
        return from_mapping(tp, value, where=where)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{where}' must be a list, got {value!r}", key=where)
        args = get_args(tp)
        item = args[0] if args else Any
        items = [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{where}' must be a mapping, got {value!r}", key=where)
        args = get_args(tp)
        vt = args[1] if args else Any
        return {str(k): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"'{where}' must be true or false, got {value!r}", key=where)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INT_MAX:  # torch, Arrow and Slurm hold 64-bit integers
                raise ConfigError(f"'{where}' is {value}, too large (at most {INT_MAX})", key=where)
            return value
        raise ConfigError(f"'{where}' must be an integer, got {value!r}", key=where)
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) <= 1e308 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads 2e-5 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"'{where}' must be a number, got {value!r}", key=where)
        if not math.isfinite(number):
            raise ConfigError(f"'{where}' is {value!r}; it must be a finite number", key=where)
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return _text(str(value), where)
        raise ConfigError(f"'{where}' must be a string, got {value!r}", key=where)
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(_text(str(value), where)).expanduser()
        raise ConfigError(f"'{where}' must be a path, got {value!r}", key=where)
    return value


# The largest integer a setting may hold: what a signed 64-bit integer can.
INT_MAX = 2**63 - 1


def _text(value: str, where: str) -> str:
    """A string setting without NUL: no file name, argument or environment variable can hold one."""
    if "\0" in value:
        raise ConfigError(f"'{where}' contains a NUL character (\\0): remove it", key=where)
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


def override(obj: T, changes: Mapping[str, Any], *, where: str = "") -> T:
    """A new settings dataclass like ``obj`` with ``changes`` on top: how command-line flags override
    a section of ctrain.yaml (``where`` names it in errors, e.g. ``"slurm"``).

    A ``None`` value (a flag not given) changes nothing. An unknown key is a :class:`ConfigError` that
    lists the valid ones; each value is converted and checked as :func:`from_mapping` does the YAML
    key, so a flag gets the same validation as the setting. The result is built through the class
    (``__post_init__`` runs again), then its ``validate()``, where it has one.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"override() takes a settings dataclass instance, got {obj!r}")
    cls = type(obj)
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(obj) if f.init}
    kwargs = {}
    for key, value in changes.items():
        if key not in fields:
            raise _unknown_key(str(key), fields, where)
        if value is not None:
            kwargs[key] = _convert(value, hints[key], f"{where}.{key}" if where else key)
    new = dataclasses.replace(obj, **kwargs)  # type: ignore[type-var]
    validate = getattr(new, "validate", None)
    if callable(validate):
        validate()
    return new


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


# A settings file larger than this is not one (a data set or a model named by mistake).
MAX_SETTINGS_BYTES = 4 * 2**20
MAX_OVERRIDE_CHARS = 64 * 2**10
_DOTTED = re.compile(r"\b[a-z_]+(?:\.[a-z_][a-z0-9_]*)+\b")
_PART = re.compile(r"\[(\d+)\]|([^.\[\]]+)")


@dataclass
class SettingsFile:
    """A settings file as read: its mapping and YAML's node tree, which knows each key's line."""

    path: Path
    data: dict[str, Any]
    node: yaml.Node | None = None

    def line(self, key: str) -> int | None:
        """The line (1-based) where dotted ``key`` (``a.b``, ``a.list[2]``) is set; None where it is not."""
        node = self.node
        line = None
        for index, name in _PART.findall(key):
            if isinstance(node, yaml.SequenceNode) and index and int(index) < len(node.value):
                node = node.value[int(index)]
                line = node.start_mark.line + 1
            elif isinstance(node, yaml.MappingNode) and name:
                found = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == name]
                if not found:
                    return None
                line, node = found[-1][0].start_mark.line + 1, found[-1][1]
            else:
                return None
        return line


def _read_text(path: Path) -> str:
    """PATH's text through :func:`read_text_bounded`: st_size says 0 for a device or a FIFO, so only a
    bounded read of a regular file keeps /dev/zero from filling memory and a FIFO from blocking."""
    try:
        return read_text_bounded(path, MAX_SETTINGS_BYTES, "the settings file")
    except ConfigError as exc:
        if "is not UTF-8 text" in str(exc):
            raise ConfigError(f"{exc}: save the file as UTF-8") from None
        raise


def _yaml_error(path: Path | str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = _cut(getattr(exc, "problem", None) or str(exc).strip().splitlines()[0])
    context = getattr(exc, "context", None)
    where = f"{path} line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    start = getattr(exc, "context_mark", None)
    if context and start is not None and mark is not None and start.line != mark.line:
        context += f" that starts on line {start.line + 1}"
    detail = problem + (f" ({context})" if context else "")
    if "'\\t'" in problem:  # PyYAML writes the tab as its repr
        detail += "; indent with spaces, not tabs"
    return ConfigError(f"{where}: not valid YAML: {detail}")


# What a settings document may cost once its aliases are expanded, and how deep it may nest: far
# more than any recipe, config or profile needs, far less than an alias bomb ("billion laughs").
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 64


# Tags YAML gives plain keys that no setting is named by (yes:, off:, ~:, null:): built as True or None,
# they would be reported as 'True' or 'None', a key nobody wrote, with no line to find it by.
_NOT_NAMES = {"tag:yaml.org,2002:bool": "a true/false value", "tag:yaml.org,2002:null": "nothing (null)"}


def bounded(node: yaml.Node | None, where: str) -> None:
    """Refuse a document that expands to more than MAX_YAML_VALUES values or nests deeper than
    MAX_YAML_DEPTH, a setting written twice (YAML keeps the last of two equal keys without a
    word), and a key YAML reads as a boolean or null (:data:`_NOT_NAMES`). Each node is visited
    once, however many aliases point at it."""
    sizes: dict[int, int] = {}

    def visit(node: yaml.Node, depth: int) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if depth > MAX_YAML_DEPTH:
            line = node.start_mark.line + 1
            raise ConfigError(f"{where} line {line}: nested more than {MAX_YAML_DEPTH} levels deep: no setting needs that")
        sizes[id(node)] = 1  # an alias of itself (a cycle) counts once
        size = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    line = key.start_mark.line + 1
                    if key.tag in _NOT_NAMES:
                        raise ConfigError(
                            f"{where} line {line}: the key '{_cut(key.value)}' is read by YAML as "
                            f"{_NOT_NAMES[key.tag]}, not as a name: quote it ('{_cut(key.value)}':) or fix its spelling"
                        )
                    if key.value in seen:
                        raise ConfigError(
                            f"{where} line {line}: '{_cut(key.value)}' is set twice (also on line {seen[key.value]}): "
                            "keep one"
                        )
                    seen[key.value] = line
                size += visit(key, depth + 1) + visit(value, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            size += sum(visit(item, depth + 1) for item in node.value)
        if size > MAX_YAML_VALUES:
            raise ConfigError(
                f"{where}: expands to more than {MAX_YAML_VALUES:,} values (YAML aliases repeat what they point at): "
                "write the settings out"
            )
        sizes[id(node)] = size
        return size

    if node is not None:
        visit(node, 0)


def _cut(text: str, limit: int = 80) -> str:
    """``text`` cut to a readable length for a message."""
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text):,} characters)"


# YAML 1.1's int and float forms (PyYAML's SafeLoader) without the base-60 ones: `time: 1:00:00` would be read as
# the integer 3600, which Slurm takes as minutes; `a: 1:30` as 90. YAML 1.2 dropped them.
_INT = re.compile(r"""^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$""")
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"""
    r"""|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"""
)
_NUMBERS = {"tag:yaml.org,2002:int": _INT, "tag:yaml.org,2002:float": _FLOAT}


class SettingsLoader(yaml.SafeLoader):
    """The SafeLoader without base-60 numbers (:data:`_INT`): every settings file and override is read
    through it, so `1:00:00` stays the text written, as Slurm and the user mean it."""


SettingsLoader.yaml_implicit_resolvers = {
    first: [(tag, _NUMBERS.get(tag, pattern)) for tag, pattern in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def parse_yaml(text: str, where: str) -> tuple[yaml.Node | None, Any]:
    """One YAML document: its node graph (for line numbers) and its value, within the bounds above;
    a ConfigError naming ``where`` for anything YAML or the bounds refuse."""
    try:
        loader = SettingsLoader(text)
    except yaml.YAMLError as exc:  # the reader refuses control characters (NUL) at once
        raise ConfigError(f"{where}: not valid YAML: {_cut(str(exc).splitlines()[0])}") from None
    try:
        node = loader.get_single_node()
        bounded(node, where)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise _yaml_error(where, exc) from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deep to read (more than {MAX_YAML_DEPTH} levels)") from None
    except (TypeError, ValueError) as exc:  # unhashable keys
        raise ConfigError(f"{where}: not usable YAML: {_cut(str(exc))}") from None
    finally:
        loader.dispose()
    return node, data


def read_settings(path: str | Path) -> SettingsFile:
    """Read a YAML mapping; every error names the file, and the line where YAML knows it."""
    path = Path(path)
    node, data = parse_yaml(_read_text(path), str(path))
    if data is None:
        return SettingsFile(path, {}, node)
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a single string"}.get(type(data), f"a single {type(data).__name__}")
        raise ConfigError(
            f"{path} holds {kind}; a settings file is a mapping of settings (`key: value` lines) at the top level"
        )
    return SettingsFile(path, data, node)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file (and the line)."""
    return read_settings(path).data


def build(cls: type[T], source: SettingsFile, overrides: Iterable[str] = ()) -> T:
    """``cls`` from a settings file with ``key=value`` overrides on top; an error names the override at
    fault, else the file and the line of the setting it concerns."""
    overrides = list(overrides)
    data = apply_overrides(copy.deepcopy(source.data), overrides)
    try:
        return from_mapping(cls, data)
    except ConfigError as exc:
        raise ConfigError(_locate(exc, source, overrides), key=exc.key) from exc


def _locate(exc: ConfigError, source: SettingsFile, overrides: list[str]) -> str:
    message = str(exc)
    keys = [exc.key] if exc.key else []
    keys += [k for k in _DOTTED.findall(message) if k not in keys]
    for key in keys:
        for item in reversed(overrides):
            name = item.partition("=")[0].strip().removesuffix("?")
            if key == name or key.startswith(name + ".") or name.startswith(key + "."):
                short = item if len(item) <= 80 else f"{item[:60]}...{item[-8:]}"
                return f"override {short!r}: {message}"
    for key in keys:
        line = source.line(key)
        if line is not None:
            return f"{source.path} line {line}: {message}"
    return f"{source.path}: {message}"


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a nested mapping, in place. ``a.b?=value``
    is a default: it sets ``a.b`` only where neither the file nor an earlier override did (how the
    deepspeed launcher offers its config without replacing a recipe's own)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        default = key.endswith("?")
        key = key.removesuffix("?")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key=value (e.g. training.max_steps=100)")
        if len(item) > MAX_OVERRIDE_CHARS:
            raise ConfigError(f"override {_cut(item)!r} is longer than {MAX_OVERRIDE_CHARS:,} characters")
        try:
            value = parse_yaml(raw, f"override {_cut(item)!r}")[1] if raw.strip() else ""
        except ConfigError as exc:
            if "not valid YAML" not in str(exc):
                raise
            value = raw
        node = data
        parts = key.strip().split(".")
        if not all(part.strip() for part in parts):
            raise ConfigError(
                f"override {_cut(item)!r}: {_cut(key.strip())!r} is not a setting's name (names joined by single dots, "
                "e.g. training.max_steps=100)"
            )
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{part}' is not a section")
            node = child
        if not (default and node.get(parts[-1]) is not None):
            node[parts[-1]] = value
    return data


def field_names(cls: type) -> list[str]:
    """Names of a settings dataclass's fields, for help texts and error messages."""
    return [f.name for f in dataclasses.fields(cls)]


__all__ = [
    "SettingsFile",
    "SettingsLoader",
    "apply_overrides",
    "bounded",
    "build",
    "field_names",
    "from_mapping",
    "load_yaml",
    "override",
    "parse_yaml",
    "read_settings",
    "to_mapping",
]
