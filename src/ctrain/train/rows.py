"""Every example checked before any tokenizing: a row without the column the task reads, a chat that
is not a list of messages, or a line that is not JSON stops the run at once, with the file and the
row, instead of as a ``TypeError`` deep inside tokenization minutes later.

Two passes share one notion of a good row: :func:`scan_files` reads local files without torch or
datasets (``ctrain train --check`` and ``ctrain submit`` run it on a login node), up to a byte
budget: JSON Lines, JSON and CSV as text (:func:`row_problem`), parquet and Arrow with pyarrow;
:func:`check_loaded` checks the whole loaded data set column by column in Arrow, whatever its
format, before tokenizing.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctrain.errors import ConfigError

if TYPE_CHECKING:
    from ctrain.train.recipe import Recipe
    from ctrain.train.sources import Source

# Bytes of local data read row by row before training (every rank reads them): about a second.
SCAN_BYTES = 64 * 2**20

# Cells pandas (which datasets reads CSV with) turns into missing values.
CSV_MISSING = frozenset(
    ["", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A", "NA",
     "NULL", "NaN", "None", "n/a", "nan", "null"]
)  # fmt: skip


def _kind_name(value: Any) -> str:
    names = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


_NOT_OBJECT = "is {}, not an object whose keys are the columns"


def _columns(row: Mapping[str, Any]) -> str:
    return ", ".join(f"'{k}'" for k in row) or "none"


def _chat_problem(chat: Any, name: str, need_assistant: bool) -> str | None:
    if not isinstance(chat, list):
        return f"has {_kind_name(chat)} in '{name}', not a chat (a list of {{role, content}} messages)"
    if not chat:
        return f"has an empty chat in '{name}'"
    for number, message in enumerate(chat, 1):
        if not isinstance(message, dict):
            return f"has {_kind_name(message)} as message {number} of '{name}', not a {{role, content}} object"
        # An assistant turn that calls tools may have no content.
        needed = ("role",) if message.get("tool_calls") else ("role", "content")
        missing = [key for key in needed if message.get(key) is None]
        if missing:
            return (
                f"has no {' or '.join(repr(k) for k in missing)} in message {number} of '{name}' "
                f"(its keys: {_columns(message)})"
            )
        if not isinstance(message["role"], str):
            return f"has {_kind_name(message['role'])} as the role of message {number} of '{name}', not a string"
        if message.get("content") is not None and not isinstance(message["content"], (str, list)):
            return f"has {_kind_name(message['content'])} as the content of message {number} of '{name}', not a string"
    if need_assistant and not any(m["role"] == "assistant" for m in chat):
        return (
            f"has a chat in '{name}' without an assistant message: with data.assistant_only_loss there is nothing "
            "to learn from it (remove the row, or set data.assistant_only_loss: false)"
        )
    return None


def columns_read(kind: str, recipe: Recipe) -> list[str]:
    """The columns the task reads from each example of shape ``kind``."""
    data = recipe.data
    return {
        "messages": [data.messages_column],
        "prompt_completion": [data.prompt_column, data.completion_column],
        "text": [data.text_column],
    }[kind]


def row_problem(row: Any, kind: str, recipe: Recipe) -> str | None:
    """What is wrong with one example for the shape ``kind`` the task reads it as; None if nothing."""
    data = recipe.data
    if not isinstance(row, dict):
        return _NOT_OBJECT.format(_kind_name(row))
    wanted = columns_read(kind, recipe)
    for name in wanted:
        if row.get(name) is None:
            what = f"no '{name}'" if name not in row else f"an empty (null) '{name}'"
            return f"has {what} (its columns: {_columns(row)}; every row needs {' and '.join(map(repr, wanted))})"
    if kind == "messages":
        return _chat_problem(row[data.messages_column], data.messages_column, data.assistant_only_loss)
    if kind == "prompt_completion":
        prompt, completion = row[data.prompt_column], row[data.completion_column]
        if isinstance(prompt, list) and isinstance(completion, list):
            return _chat_problem(prompt, data.prompt_column, False) or _chat_problem(
                completion, data.completion_column, False
            )
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            return (
                f"has {_kind_name(prompt)} in '{data.prompt_column}' and {_kind_name(completion)} in "
                f"'{data.completion_column}': both must be strings, or both lists of messages"
            )
        return None
    if not isinstance(row[data.text_column], str):
        return f"has {_kind_name(row[data.text_column])} in '{data.text_column}', not a string"
    return None


# --- local files, as text -------------------------------------------------------------------------


# The longest row a data file may hold: this many bytes per token of data.max_length, at least
# MIN_ROW_BYTES. A training row holds a few bytes a token, so a longer line is no row but a file's
# mistake, and reading it whole (a 200 MB line) would take the memory the training needs.
ROW_BYTES_PER_TOKEN = 1024
MIN_ROW_BYTES = 2**20
# A .json file is one array, parsed whole: above this size it must be JSON Lines, read row by row.
MAX_JSON_ARRAY_BYTES = 256 * 2**20


def row_limit(recipe: Recipe) -> int:
    """The most bytes one row of a data file may take (see ROW_BYTES_PER_TOKEN)."""
    return max(MIN_ROW_BYTES, recipe.data.max_length * ROW_BYTES_PER_TOKEN)


def _lines(handle: Any, limit: int) -> Iterator[tuple[int, bytes]]:
    """(number, line) of a binary file, each read in at most ``limit`` + 1 bytes; a longer line
    comes back cut at that length (no newline at its end, and not the file's last bytes)."""
    number = 0
    while raw := handle.readline(limit + 1):
        number += 1
        yield number, raw


def bad_utf8_line(path: Path) -> tuple[int, int] | None:
    """(line, byte) of the first bytes in ``path`` that are not UTF-8, or None."""
    with path.open("rb") as handle:
        for number, raw in _lines(handle, MIN_ROW_BYTES):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return number, raw[exc.start]
    return None


def _not_utf8(path: Path) -> ConfigError:
    found = bad_utf8_line(path)
    where = f" line {found[0]} (byte 0x{found[1]:02x})" if found else ""
    return ConfigError(f"data.source: {path}{where} is not UTF-8 text: save the file as UTF-8")


Rows = Iterator[tuple[str, Any, int]]  # (where, row, bytes read)


def _json_lines(path: Path, limit: int) -> Rows:
    with path.open("rb") as handle:
        row = 0
        for number, raw in _lines(handle, limit):
            if not raw.strip():
                continue
            row += 1
            where = f"line {number} (row {row})"
            if len(raw) > limit:
                raise ConfigError(
                    f"data.source: {path} {where} is longer than {limit / 2**20:.0f} MiB, far more text than one row "
                    "of data.max_length tokens holds: split it into rows, or drop it"
                )
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"data.source: {path} {where} is not UTF-8 text (byte 0x{raw[exc.start]:02x}): save the file as "
                    "UTF-8"
                ) from None
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                hint = ""
                if number == 1 and text.strip() in ("{", "["):
                    hint = " (a .json file holds one array of rows, a .jsonl file one row per line)"
                raise ConfigError(
                    f"data.source: {path} {where} is not valid JSON: {exc.msg} at column {exc.colno}{hint}"
                ) from None
            except RecursionError:
                raise _too_deep(path, where) from None
            yield where, value, len(raw)


def _too_deep(path: Path, where: str) -> ConfigError:
    """A row nested past what the JSON parser follows: no chat or text row is, so it is not data for training."""
    return ConfigError(f"data.source: {path}{' ' + where if where else ''} nests lists or objects thousands of "
                       "levels deep: it is not a row of chats or text")  # fmt: skip


def _json_array(path: Path) -> Rows:
    if path.stat().st_size > MAX_JSON_ARRAY_BYTES:
        raise ConfigError(
            f"data.source: {path} is one JSON array of {path.stat().st_size / 2**20:.0f} MiB, which is read whole: "
            f"above {MAX_JSON_ARRAY_BYTES // 2**20} MiB write it as JSON Lines (.jsonl, one row per line)"
        )
    try:
        rows = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"data.source: {path} line {exc.lineno}, column {exc.colno} is not valid JSON: {exc.msg}"
        ) from None
    except RecursionError:
        raise _too_deep(path, "") from None
    size = path.stat().st_size
    for number, row in enumerate(rows, 1):
        yield f"row {number}", row, size if number == 1 else 0


def json_rows(path: Path, limit: int = 64 * MIN_ROW_BYTES) -> Rows:
    """Rows of a JSON file: one array of objects, or JSON Lines (what datasets' json loader reads),
    none longer than ``limit`` bytes."""
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head:
        raise ConfigError(f"data.source: {path} is empty")
    return _json_array(path) if head.startswith(b"[") else _json_lines(path, limit)


def csv_rows(path: Path) -> Rows:
    """Rows of a CSV file as dicts, with pandas' missing-value cells as None (datasets reads CSV with pandas)."""
    with path.open("rb") as binary:
        text = io.TextIOWrapper(binary, encoding="utf-8-sig", newline="")
        reader = csv.reader(text)
        try:
            header = next(reader, None)
            if not header:
                raise ConfigError(f"data.source: {path} is empty: a CSV file starts with a header of column names")
            number = 0
            for values in reader:
                if not values:
                    continue
                number += 1
                where = f"row {number} (line {reader.line_num})"
                if len(values) != len(header):
                    raise ConfigError(
                        f"data.source: {path} {where} has {len(values)} fields and the header {len(header)}: "
                        "quote fields that hold commas"
                    )
                row = {k: (None if v in CSV_MISSING else v) for k, v in zip(header, values)}
                yield where, row, sum(len(v) for v in values) + len(values)
        except UnicodeDecodeError:
            raise _not_utf8(path) from None
        except csv.Error as exc:
            raise ConfigError(f"data.source: {path} line {reader.line_num} is not valid CSV: {exc}") from None


def header_columns(path: Path, fmt: str) -> list[str]:
    """Column names of a local JSON or CSV file, from its first row."""
    rows = json_rows(path) if fmt == "json" else csv_rows(path)
    for where, row, _ in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"data.source: {path} {where} {_NOT_OBJECT.format(_kind_name(row))}")
        return list(row)
    if fmt == "csv":
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return next(csv.reader(handle), [])
    raise ConfigError(f"data.source: {path} holds no rows")


def _arrow_file(path: Path, fmt: str, kind: str, recipe: Recipe) -> None:
    """Check the columns the task reads of one parquet or Arrow file, as :func:`check_loaded` does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = columns_read(kind, recipe)
    try:
        if fmt == "parquet":
            present = list(pq.read_schema(path).names)
            table = pq.read_table(path, columns=[n for n in names if n in present])
        else:
            with pa.memory_map(str(path)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(source).read_all()
            present = list(table.column_names)
    except (pa.ArrowException, ValueError, KeyError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.source: {path} is not a readable {fmt} file ({detail})") from None
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(
            f"data.source: {path} has no column {missing[0]!r} (its columns: {', '.join(present)}; "
            f"every file needs {' and '.join(map(repr, names))}, as the first one has)"
        )
    _check_table(table, names, kind, recipe, lambda i: f"{path} row {i + 1}")


def scan_files(source: Source, kind: str, recipe: Recipe, budget: int | None = SCAN_BYTES) -> bool:
    """Check each row of local files (ConfigError at the first bad one); False when the byte budget
    ran out first (the rest is checked once the data set loads)."""
    read = 0
    for path in source.files:
        if source.format in ("parquet", "arrow"):
            read += path.stat().st_size
            if budget is not None and read > budget:
                return False
            _arrow_file(path, source.format, kind, recipe)
            continue
        if source.format not in ("json", "csv"):
            return True
        rows = json_rows(path, row_limit(recipe)) if source.format == "json" else csv_rows(path)
        for where, row, size in rows:
            problem = row_problem(row, kind, recipe)
            if problem:
                raise ConfigError(f"data.source: {path} {where} {problem}")
            read += size
            if budget is not None and read > budget:
                return False
    return True


# --- a loaded data set, in Arrow ------------------------------------------------------------------


def _first(mask: Any) -> int | None:
    """Index of the first true value of a boolean Arrow array, or None."""
    import pyarrow.compute as pc

    index = pc.index(mask, True).as_py()
    return None if index is None or index < 0 else index


def _column_problem(column: Any, name: str, kind: str, recipe: Recipe) -> tuple[int, str] | None:
    """(0-based row, problem) of the first bad value of one Arrow column chunk, or None."""
    import pyarrow as pa
    import pyarrow.compute as pc

    row = _first(pc.is_null(column))
    if row is not None:
        return row, f"has no '{name}' (null)"
    if kind == "text" or (kind == "prompt_completion" and not pa.types.is_list(column.type)):
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            return 0, f"has {column.type} values in '{name}', not strings"
        return None
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return 0, f"has {column.type} values in '{name}', not chats (lists of {{role, content}} messages)"
    item = column.type.value_type
    if not pa.types.is_struct(item) or {"role", "content"} - {item.field(i).name for i in range(item.num_fields)}:
        return 0, f"has {item} messages in '{name}', not {{role, content}} objects"
    content = item.field("content").type
    if not (pa.types.is_string(content) or pa.types.is_large_string(content) or pa.types.is_list(content)):
        return 0, f"has {content} message contents in '{name}', not strings"
    if kind == "messages":
        row = _first(pc.equal(pc.list_value_length(column), 0))
        if row is not None:
            return row, f"has an empty chat in '{name}'"
    parents = pc.list_parent_indices(column)
    messages = pc.list_flatten(column)
    fields = {item.field(i).name for i in range(item.num_fields)}
    for key in ("role", "content"):
        missing = pc.is_null(pc.struct_field(messages, key))
        if key == "content" and "tool_calls" in fields:  # an assistant turn that calls tools may have no content
            missing = pc.and_(missing, pc.is_null(pc.struct_field(messages, "tool_calls")))
        at = _first(missing)
        if at is not None:
            return parents[at].as_py(), f"has a message without '{key}' in '{name}'"
    if kind == "messages" and recipe.data.assistant_only_loss:
        import numpy as np

        assistant = pc.equal(pc.struct_field(messages, "role"), "assistant").to_numpy(zero_copy_only=False)
        answers = np.bincount(parents.to_numpy(zero_copy_only=False)[assistant], minlength=len(column))
        unanswered = np.flatnonzero(answers == 0)
        if len(unanswered):
            return int(unanswered[0]), (
                f"has a chat in '{name}' without an assistant message: with data.assistant_only_loss there is "
                "nothing to learn from it (remove the row, or set data.assistant_only_loss: false)"
            )
    return None


def check_loaded(dataset: Any, kind: str, recipe: Recipe, where: Callable[[int], str]) -> None:
    """Check every row of a loaded (not streamed) data set; ``where(i)`` names 0-based row ``i``."""
    _check_table(getattr(dataset.data, "table", dataset.data), columns_read(kind, recipe), kind, recipe, where)


def _check_table(table: Any, names: list[str], kind: str, recipe: Recipe, where: Callable[[int], str]) -> None:
    for name in names:
        offset = 0
        for chunk in table.column(name).chunks:
            found = _column_problem(chunk, name, kind, recipe)
            if found is not None:
                raise ConfigError(f"data.source: {where(offset + found[0])} {found[1]}")
            offset += len(chunk)
