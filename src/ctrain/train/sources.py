"""What a recipe's references name, found without torch or downloads: ``data.source`` as a
:class:`Source` (builtin, local files, a save_to_disk folder, a hub data set), its columns and the
shape of its examples, and whether a model or tokenizer reference is a local path or a hub name."""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ctrain.errors import ConfigError
from ctrain.files import load_json_bounded
from ctrain.settings import MAX_SETTINGS_BYTES
from ctrain.train.recipe import BUILTIN_SOURCES, DataSettings, Recipe, expand_path

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Source:
    """What ``data.source`` names: a builtin generator, local files, a save_to_disk folder, or a hub data set."""

    kind: Literal["builtin", "files", "disk", "hub"]
    name: str  # builtin name, hub name, or the path as given
    format: str | None = None  # loader for files: json, csv, parquet, arrow
    files: tuple[Path, ...] = ()
    directory: Path | None = None  # save_to_disk folder


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~", "$")) or Path(text).suffix.lower() in FILE_FORMATS


def resolve_source(data: DataSettings) -> Source:
    """Classify ``data.source`` and find its files; a ConfigError for paths that are missing or unreadable."""
    raw = data.source
    if raw.startswith("builtin:"):
        name = raw.split(":", 1)[1]
        if name not in BUILTIN_SOURCES:
            raise ConfigError(f"data.source: unknown builtin '{name}'; builtins: {', '.join(BUILTIN_SOURCES)}")
        return Source("builtin", name)
    if data.format == "hub":
        return Source("hub", raw)
    path = expand_path(raw)
    if _GLOB.search(str(path)):
        files = _once(_glob_files(path, raw))
        if not files:
            raise ConfigError(f"data.source: no files match {raw} (relative paths are relative to {Path.cwd()})")
        return Source("files", raw, _file_format(files, data), files)
    if os.path.lexists(path) and not path.exists():
        raise ConfigError(f"data.source: {raw} is a symbolic link that leads nowhere (a loop, or a missing target)")
    if path.exists():
        if not path.is_dir() and not stat.S_ISREG(path.stat().st_mode):
            raise ConfigError(
                f"data.source: {raw} is not a regular file (a pipe or a device reads without end): give a data file"
            )
        _readable(path, "data.source")
        if path.is_dir():
            if (
                (path / "dataset_info.json").is_file()
                or (path / "dataset_dict.json").is_file()
                or (path / "state.json").is_file()
            ):
                return Source("disk", raw, directory=path)
            files = _data_files(path, raw)
            if not files:
                raise ConfigError(
                    f"data.source: {raw} is a directory with no data files ({', '.join(FILE_FORMATS)}) and is not a "
                    "save_to_disk folder"
                )
            return Source("files", raw, _file_format(files, data), files)
        return Source("files", raw, _file_format((path,), data), (path,))
    if data.format in ("json", "csv", "parquet", "arrow", "disk") or _looks_like_path(raw):
        raise ConfigError(f"data.source: {raw} does not exist (relative paths are relative to {Path.cwd()})")
    if _HUB_NAME.match(raw):
        return Source("hub", raw)
    raise ConfigError(f"data.source: {raw} is neither an existing path nor a hub data set name")


# Entries a data.source directory is searched through at most: more is a directory named by
# mistake (a home directory, /), whose search would take minutes.
MAX_SOURCE_ENTRIES = 100_000


def _data_files(directory: Path, raw: str) -> tuple[Path, ...]:
    """The data files anywhere under ``directory``, sorted; a ConfigError when it is far too large to search."""
    found = []
    seen = 0
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        seen += len(dirs) + len(names)
        if seen > MAX_SOURCE_ENTRIES:
            raise ConfigError(
                f"data.source: {raw} holds more than {MAX_SOURCE_ENTRIES} files and directories: point it at the "
                f"data (a file, a glob such as {raw.rstrip('/')}/*.jsonl, or a directory of data files)"
            )
        found += [Path(root, n) for n in names if Path(n).suffix.lower() in FILE_FORMATS]
    return _once(p for p in found if p.is_file())


def _component_matches(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether path components match glob components (``**``: any number of directories), as glob
    does: a name starting with a dot matches only a pattern that starts with one."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_component_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1)
                   if not any(p.startswith(".") for p in parts[:i]))  # fmt: skip
    if not parts or (parts[0].startswith(".") and not pattern[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], pattern[0]) and _component_matches(parts[1:], pattern[1:])


def _glob_files(pattern: Path, raw: str) -> list[Path]:
    """Files matching a glob, found by walking from its first wildcard's directory with each directory
    visited once (a link back up would repeat the tree without end) and at most MAX_SOURCE_ENTRIES
    entries looked at (``/**`` would search the whole machine)."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if _GLOB.search(part))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    wanted = parts[fixed:]
    depth = None if "**" in wanted else len(wanted) - 1
    found: list[Path] = []
    visited: set[tuple[int, int]] = set()
    seen = 0
    for root, dirs, names in os.walk(base, followlinks=True):
        relative = Path(root).relative_to(base).parts
        try:
            st = os.stat(root)
        except OSError:
            dirs.clear()
            continue
        if (st.st_dev, st.st_ino) in visited:
            dirs.clear()
            continue
        visited.add((st.st_dev, st.st_ino))
        seen += len(dirs) + len(names)
        if seen > MAX_SOURCE_ENTRIES:
            raise ConfigError(
                f"data.source: {raw} looks through more than {MAX_SOURCE_ENTRIES} files and directories: point it at "
                f"the data (a file, or a glob that names fewer directories such as data/*.jsonl)"
            )
        if depth is not None and len(relative) >= depth:
            dirs.clear()
        dirs.sort()
        found += [Path(root, n) for n in names if _component_matches((*relative, n), wanted)]
    return [p for p in found if p.is_file()]


def _once(paths: Iterable[Path]) -> tuple[Path, ...]:
    """Regular files, sorted, each once: a glob through a symbolic link loop, or two links to one
    file, names the same file many times, and its rows would be trained on that many times."""
    seen: set[tuple[int, int]] = set()
    unique = []
    for path in sorted(paths):
        st = path.stat()
        if (st.st_dev, st.st_ino) not in seen and stat.S_ISREG(st.st_mode):
            seen.add((st.st_dev, st.st_ino))
            unique.append(path)
    return tuple(unique)


def _file_format(files: tuple[Path, ...], data: DataSettings) -> str:
    if data.format not in ("auto", "hub", "disk"):
        return data.format
    formats = {FILE_FORMATS.get(p.suffix.lower()) for p in files}
    if None in formats:
        odd = next(p for p in files if p.suffix.lower() not in FILE_FORMATS)
        raise ConfigError(
            f"data.source: cannot tell the format of {odd}; set data.format ({', '.join(sorted(set(FILE_FORMATS.values())))})"
        )
    if len(formats) > 1:
        raise ConfigError(f"data.source mixes formats ({', '.join(sorted(formats))}); point it at one kind of file")
    return formats.pop()


def _readable(path: Path, what: str) -> None:
    if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
        raise ConfigError(f"{what}: {path} cannot be read (permission denied)")


def model_kind(value: str, what: str = "") -> Literal["local", "hub"]:
    """Whether a model/tokenizer reference is a local path (which must exist) or a hub name.

    A local model or tokenizer is a directory (``save_pretrained``'s); ``what`` names the setting
    for which that is required, empty where a single file will do (``model.config``).
    """
    path = expand_path(value)
    if path.exists():
        _readable(path, value)
        if not path.is_dir() and not path.is_file():
            raise ConfigError(f"{value} is not a regular file (a device, pipe or socket): name a model's directory "
                              "or config file")  # fmt: skip
        if what and not path.is_dir():
            raise ConfigError(
                f"{value} is a file; {what} is a directory holding a saved model (config.json, weights, tokenizer "
                "files) or a hub name"
            )
        return "local"
    if _looks_like_path(value) or not _HUB_NAME.match(value):
        raise ConfigError(f"{value} does not exist (relative paths are relative to {Path.cwd()})")
    return "hub"


def source_columns(source: Source, data: DataSettings) -> list[str] | None:
    """Column names of a local source read from its first record or metadata, without datasets; None if unknown."""
    if source.kind == "builtin":
        from ctrain.train.demo import BUILTIN_COLUMNS

        return list(BUILTIN_COLUMNS[source.name])
    if source.kind == "disk":
        return _disk_columns(source.directory, data.split)  # type: ignore[arg-type]
    if source.kind != "files":
        return None
    first = source.files[0]
    try:
        if source.format in ("json", "csv"):
            from ctrain.train.rows import header_columns

            return header_columns(first, source.format)
        if source.format in ("parquet", "arrow"):
            try:
                import pyarrow.parquet as pq  # noqa: F401
            except ImportError:
                return None
            # Every file's footer (cheap): a broken one among many is named here, not by the loader.
            columns = [_arrow_columns(path, source.format) for path in source.files]
            return columns[0]
    except OSError as exc:
        raise ConfigError(f"data.source: cannot read {first}: {exc.strerror or exc}") from exc
    return None


def _arrow_columns(path: Path, fmt: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            return list(pq.read_schema(path).names)
        with pa.memory_map(str(path)) as source:
            try:
                return list(pa.ipc.open_stream(source).schema.names)
            except pa.ArrowInvalid:
                return list(pa.ipc.open_file(source).schema.names)
    except (pa.ArrowException, ValueError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.source: {path} is not a readable {fmt} file ({detail})") from None


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object from a file datasets wrote; a ConfigError naming the file when it is damaged."""
    try:
        data = load_json_bounded(path, MAX_SETTINGS_BYTES, "data.source:")
    except ConfigError as exc:
        raise ConfigError(f"{exc}: save the data set again") from None
    if not isinstance(data, dict):
        raise ConfigError(f"data.source: {path} is not a JSON object: save the data set again")
    return data


def _disk_columns(directory: Path, split: str) -> list[str] | None:
    if (directory / "dataset_dict.json").is_file():
        splits = _json_object(directory / "dataset_dict.json").get("splits") or []
        if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
            raise ConfigError(
                f"data.source: {directory / 'dataset_dict.json'} has 'splits' {str(splits)[:80]}, not a list of split "
                "names: save the data set again"
            )
        if split not in splits:
            raise ConfigError(f"data.split: {directory} has no split '{split}'; splits: {', '.join(splits)}")
        directory = directory / split
        if not directory.is_dir():
            raise ConfigError(
                f"data.source: {directory.parent} lists split '{split}' but has no folder {directory}: save the data "
                "set again"
            )
    info = directory / "dataset_info.json"
    if not info.is_file():
        return None
    features = _json_object(info).get("features") or {}
    return list(features) if isinstance(features, dict) and features else None


def example_kind(columns: list[str], recipe: Recipe) -> Literal["messages", "prompt_completion", "text"]:
    """Which shape of example the columns hold, as the task needs; a ConfigError naming the columns otherwise."""
    data = recipe.data
    if recipe.task == "sft":
        if data.messages_column in columns:
            return "messages"
        if data.prompt_column in columns and data.completion_column in columns:
            return "prompt_completion"
        if data.text_column in columns:
            return "text"
        raise ConfigError(
            f"data.source {data.source} has columns {', '.join(columns) or '(none)'}; an sft recipe needs "
            f"'{data.messages_column}' (chats), '{data.prompt_column}' + '{data.completion_column}', or "
            f"'{data.text_column}' (set data.messages_column / prompt_column / completion_column / text_column)"
        )
    if data.text_column in columns:
        return "text"
    raise ConfigError(
        f"data.source {data.source} has no column '{data.text_column}' (columns: {', '.join(columns) or '(none)'}); "
        "a clm recipe trains on one text column: set data.text_column"
    )


# Model types are lower-case words (llama, gpt2, qwen2, mistral ...); anything else is a path or hub name.
BUILTIN_MODEL_TYPE = re.compile(r"^[a-z][a-z0-9_-]*$")
