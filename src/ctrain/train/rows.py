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
import functools
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


def _too_long(place: str, limit: int) -> ConfigError:
    """A row longer than :func:`row_limit`; ``place`` names its file and row."""
    return ConfigError(
        f"data.source: {place} is longer than {limit / 2**20:.0f} MiB, far more text than one row "
        "of data.max_length tokens holds: split it into rows, or drop it"
    )


def _json_lines(path: Path, limit: int) -> Rows:
    with path.open("rb") as handle:
        row = 0
        for number, raw in _lines(handle, limit):
            if not raw.strip():
                continue
            row += 1
            where = f"line {number} (row {row})"
            if len(raw) > limit:
                raise _too_long(f"{path} {where}", limit)
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


# Blank space read at most to find a JSON file's first character (whether it is an array or JSON Lines).
MAX_LEADING_BLANK = 64 * 2**20


def _first_byte(path: Path) -> bytes:
    """The first byte of ``path`` after a BOM and blank space (b"" when it is all blank), read in chunks:
    JSON Lines may start with many blank lines. Past MAX_LEADING_BLANK it is taken as JSON Lines."""
    with path.open("rb") as handle:
        chunk = handle.read(65536).removeprefix(b"\xef\xbb\xbf")
        read = 0
        while chunk:
            head = chunk.lstrip(b" \t\r\n")
            if head:
                return head[:1]
            read += len(chunk)
            if read > MAX_LEADING_BLANK:
                return b"{"
            chunk = handle.read(65536)
    return b""


def json_rows(path: Path, limit: int = 64 * MIN_ROW_BYTES) -> Rows:
    """Rows of a JSON file: one array of objects, or JSON Lines (what datasets' json loader reads),
    none longer than ``limit`` bytes."""
    head = _first_byte(path)
    if not head:
        raise ConfigError(f"data.source: {path} is empty")
    return _json_array(path) if head == b"[" else _json_lines(path, limit)


def _csv_lines(path: Path, handle: Any, limit: int) -> Iterator[str]:
    """The lines of a CSV file as text, each read in at most ``limit`` + 1 bytes: csv.reader would read
    a line of gigabytes whole before it saw its field was too long."""
    for number, raw in _lines(handle, limit):
        if len(raw) > limit:
            raise _too_long(f"{path} line {number}", limit)
        yield raw.decode("utf-8-sig" if number == 1 else "utf-8")


def csv_rows(path: Path, limit: int = 64 * MIN_ROW_BYTES) -> Rows:
    """Rows of a CSV file as dicts, with pandas' missing-value cells as None (datasets reads CSV with pandas);
    no line or field longer than ``limit`` bytes."""
    # Fields as long as a row may be (pandas, which datasets reads with, has no limit); csv's own is 128 KiB.
    csv.field_size_limit(max(limit, csv.field_size_limit()))
    with path.open("rb") as binary:
        reader = csv.reader(_csv_lines(path, binary, limit))
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


def _value_sizes(array: Any) -> Any:
    """Bytes of each value of an Arrow array (strings and binaries by length, lists and structs summed)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_dictionary(kind):  # sized through its dictionary: decoding may repeat one value a million times
        values = _value_sizes(array.dictionary)
        indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False)
        return np.where(array.is_null().to_numpy(zero_copy_only=False), 0, values[indices]) if len(values) else (
            np.zeros(len(array), np.int64))
    if isinstance(kind, pa.BaseExtensionType):
        array = array.storage
        kind = array.type
    if any(test(kind) for test in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                                   pa.types.is_large_binary)):  # fmt: skip
        return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        inner = _value_sizes(pc.list_flatten(array))
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=inner, minlength=len(array)).astype(np.int64)
    if pa.types.is_struct(kind):
        total = np.zeros(len(array), dtype=np.int64)
        for i in range(kind.num_fields):
            total += _value_sizes(pc.struct_field(array, [i]))
        return total
    width = kind.bit_width // 8 if hasattr(kind, "bit_width") and kind.bit_width else 8
    return np.full(len(array), max(width, 1), dtype=np.int64)


def _check_row_sizes(table: Any, names: list[str], limit: int, where: Callable[[int], str]) -> int:
    """The bytes of ``table``'s columns ``names``; a ConfigError at the first row that takes more than
    ``limit`` bytes, as for JSON lines."""
    import numpy as np

    sizes = np.zeros(len(table), np.int64)
    for name in names:
        sizes += _value_sizes(table.column(name).combine_chunks())
    over = np.flatnonzero(sizes > limit)
    if len(over):
        raise _too_long(where(int(over[0])), limit)
    return int(sizes.sum())


def _parquet_groups(path: Path, names: list[str], limit: int, budget: int | None) -> tuple[list[int], int]:
    """(the row groups of a parquet file to read within ``budget`` bytes, their bytes), from the uncompressed
    sizes its footer declares: a few kilobytes on disk may hold gigabytes of repeated text."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    groups, used, first_row = [], 0, 0
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        size = sum(
            group.column(c).total_uncompressed_size
            for c in range(group.num_columns)
            if group.column(c).path_in_schema.split(".")[0] in names
        )
        if size > max(group.num_rows, 1) * limit:
            raise ConfigError(
                f"data.source: {path} rows {first_row + 1} to {first_row + group.num_rows} take {size / 2**20:.0f} "
                f"MiB uncompressed, more than {limit / 2**20:.0f} MiB a row, far more text than one row of "
                "data.max_length tokens holds: split the long rows, or drop them"
            )
        if budget is not None and used + size > budget:
            break
        groups.append(index)
        used += size
        first_row += group.num_rows
    return groups, used


def _arrow_file(path: Path, fmt: str, kind: str, recipe: Recipe, budget: int | None = None) -> int | None:
    """Check the columns the task reads of one parquet or Arrow file, as :func:`check_loaded` does, and that
    no row is longer than :func:`row_limit`; the bytes read, or None when ``budget`` ran out first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = columns_read(kind, recipe)
    limit = row_limit(recipe)
    try:
        if fmt == "parquet":
            schema = pq.read_schema(path)
            present = list(schema.names)
            wanted = [n for n in names if n in present]
            groups, used = _parquet_groups(path, wanted, limit, budget)
            # Strings stay dictionary-encoded until their rows are measured: a dictionary of one long value
            # repeated by every row decodes into gigabytes.
            leaves = pq.ParquetFile(path).schema
            strings = [leaves.column(i).path for i in range(len(leaves)) if leaves.column(i).physical_type ==
                       "BYTE_ARRAY" and leaves.column(i).path.split(".")[0] in wanted]  # fmt: skip
            parquet = pq.ParquetFile(path, read_dictionary=strings)
            batches = parquet.iter_batches(batch_size=1024, row_groups=groups, columns=wanted)
            used = 0
        else:
            source = pa.memory_map(str(path))
            try:
                reader: Any = pa.ipc.open_stream(source)
                batches = iter(reader)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            present, used = list(reader.schema.names), 0
        missing = [n for n in names if n not in present]
        if missing:
            raise ConfigError(
                f"data.source: {path} has no column {missing[0]!r} (its columns: {', '.join(present)}; "
                f"every file needs {' and '.join(map(repr, names))}, as the first one has)"
            )
        offset = 0
        for batch in batches:
            table = pa.Table.from_batches([batch]).select(names)
            where = functools.partial(_row_name, path, offset)
            used += _check_row_sizes(table, names, limit, where)
            if budget is not None and used > budget:
                return None
            if fmt == "parquet":
                table = table.cast(pa.schema([schema.field(n) for n in names]))
            _check_table(table, names, kind, recipe, where)
            offset += len(table)
    except (pa.ArrowException, ValueError, KeyError, OSError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"data.source: {path} is not a readable {fmt} file ({detail})") from None
    if fmt == "parquet" and len(groups) < pq.ParquetFile(path).metadata.num_row_groups:
        return None
    return used


def _row_name(path: Path, offset: int, index: int) -> str:
    return f"{path} row {offset + index + 1}"


class _ContentKinds:
    """Whether chats' message contents are all strings or all lists of parts: datasets cannot give one
    column both (it loads them as JSON text), so a row of the other kind is named here."""

    def __init__(self, kind: str, recipe: Recipe) -> None:
        self.column = recipe.data.messages_column if kind == "messages" else None
        self.first: type | None = None

    def problem(self, row: Any) -> str | None:
        chat = row.get(self.column) if self.column and isinstance(row, dict) else None
        for message in chat if isinstance(chat, list) else ():
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, (str, list)):
                continue
            if self.first is None:
                self.first = type(content)
            elif type(content) is not self.first:
                return _mixed_contents(self.column or "", self.first is str)
        return None


def _mixed_contents(name: str, strings_first: bool) -> str:
    first, other = ("strings", "a list of parts") if strings_first else ("lists of parts", "a string")
    return (
        f"has {other} as a message content in '{name}', where the rows before have {first}: the data mixes "
        "strings and lists, which one column cannot hold; make every content one kind"
    )


def scan_files(source: Source, kind: str, recipe: Recipe, budget: int | None = SCAN_BYTES) -> bool:
    """Check each row of local files (ConfigError at the first bad one); False when the byte budget
    ran out first (the rest is checked once the data set loads)."""
    read = 0
    contents = _ContentKinds(kind, recipe)
    for path in source.files:
        if source.format in ("parquet", "arrow"):
            left = None if budget is None else budget - read
            used = _arrow_file(path, source.format, kind, recipe, left)
            if used is None:
                return False
            read += used
            continue
        if source.format not in ("json", "csv"):
            return True
        limit = row_limit(recipe)
        rows = json_rows(path, limit) if source.format == "json" else csv_rows(path, limit)
        for where, row, size in rows:
            problem = row_problem(row, kind, recipe) or contents.problem(row)
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
    if getattr(content, "extension_name", None) == "arrow.json":
        mixed = _mixed_json_contents(column, name)
        if mixed is not None:
            return mixed
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


def _mixed_json_contents(column: Any, name: str) -> tuple[int, str] | None:
    """(row, problem) of the first chat whose message content is a string where earlier ones are lists of
    parts, or the other way round: datasets loads such a column as JSON text (extension<arrow.json>)."""
    import pyarrow.compute as pc

    contents = pc.struct_field(pc.list_flatten(column), "content")
    storage = contents.storage if hasattr(contents, "storage") else contents
    starts = pc.utf8_slice_codeunits(pc.utf8_trim_whitespace(storage), 0, 1)
    kinds = pc.if_else(pc.equal(starts, '"'), "string", pc.if_else(pc.equal(starts, "["), "list", "other"))
    known = pc.filter(kinds, pc.not_equal(kinds, "other"))
    if len(known) == 0:
        return None
    first = known[0].as_py()
    at = _first(pc.and_(pc.not_equal(kinds, first), pc.not_equal(kinds, "other")).fill_null(False))
    if at is None:
        return None
    return pc.list_parent_indices(column)[at].as_py(), _mixed_contents(name, first == "string")


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
