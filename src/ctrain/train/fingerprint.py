"""What a prepared data set was made from: the settings and source files it depends on, as plain data
written next to it, so that a later run reuses it only when nothing it depends on has changed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ctrain.files import read_bounded, shorten
from ctrain.settings import MAX_SETTINGS_BYTES, to_mapping
from ctrain.train.recipe import Recipe, expand_path
from ctrain.train.sources import resolve_source

# Bumped whenever tokenisation or packing changes what a prepared data set holds.
PREPARE_VERSION = 1


def _file_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _tree_identity(directory: Path) -> list[dict[str, Any]]:
    return [_file_identity(p) for p in sorted(directory.rglob("*")) if p.is_file()]


def prepared_settings(recipe: Recipe) -> dict[str, Any]:
    """Everything a prepared data set depends on, as plain data; two recipes that agree here share one."""
    data = recipe.data
    source = resolve_source(data)
    origin: dict[str, Any] = {"kind": source.kind, "name": data.source}
    if source.kind == "files":
        origin["files"] = [_file_identity(p) for p in source.files]
    elif source.kind == "disk":
        origin["files"] = _tree_identity(source.directory)  # type: ignore[arg-type]
    elif source.kind == "hub":
        origin.update(config_name=data.config_name, revision=data.revision)
    tokenizer: dict[str, Any]
    if recipe.tokenizer.train is not None:
        tokenizer = {"train": to_mapping(recipe.tokenizer.train)}
    else:
        reference = recipe.tokenizer.path or recipe.model.path
        assert reference is not None
        tokenizer = {"path": reference, "revision": recipe.model.revision if not recipe.tokenizer.path else None}
        local = expand_path(reference)
        if local.is_dir():
            tokenizer["files"] = [
                _file_identity(p)
                for p in sorted(local.iterdir())
                if p.is_file() and any(k in p.name for k in ("token", "chat_template", "vocab", "merges", "spiece"))
            ]
    if recipe.tokenizer.chat_template:
        text = read_bounded(expand_path(recipe.tokenizer.chat_template), MAX_SETTINGS_BYTES, "tokenizer.chat_template:")
        tokenizer["chat_template_sha256"] = hashlib.sha256(text).hexdigest()
    settings = {
        "version": PREPARE_VERSION,
        "task": recipe.task,
        "seed": recipe.seed,
        "source": origin,
        "split": data.split,
        "eval_split": data.eval_split,
        "eval_size": data.eval_size,
        "max_examples": data.max_examples,
        "columns": {
            name: getattr(data, name)
            for name in ("text_column", "messages_column", "prompt_column", "completion_column")
        },
        "assistant_only_loss": data.assistant_only_loss,
        "max_length": data.max_length,
        "packing": data.packing if recipe.task == "sft" else None,
        "packing_strategy": data.packing_strategy if recipe.task == "sft" and data.packing else None,
        "tokenizer": tokenizer,
    }
    return json.loads(json.dumps(settings))


def settings_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two :func:`prepared_settings` results."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(settings_differences(a, b, f"{name}."))
        elif a != b:
            files = _file_differences(a, b)  # two file lists cut short look alike: name the files instead
            out.append(f"{name}: {files or f'prepared {json.dumps(a)[:80]}, recipe {json.dumps(b)[:80]}'}")
    return out


#: How many changed files a difference names before it counts the rest.
MAX_FILES_NAMED = 5


def _is_file_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(entry, dict) and isinstance(entry.get("path"), str) for entry in value
    )


def _file_differences(old: Any, new: Any) -> str | None:
    """Which files of two :func:`_file_identity` lists differ (added, removed, another size or time), or
    None when they are no such lists: both cut at 80 characters would look the same."""
    if not (_is_file_list(old) and _is_file_list(new)):
        return None
    before, after = {e["path"]: e for e in old}, {e["path"]: e for e in new}
    paths = sorted(set(before) | set(after))
    try:
        base = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    except (ValueError, IndexError):  # absolute and relative paths mixed, or no path at all
        base = ""
    if base in paths:  # one path the parent of the others: name it by its last part too
        base = os.path.dirname(base)

    def label(path: str) -> str:
        return shorten(os.path.relpath(path, base) if base else path, 80)

    changes = []
    for path in paths:
        a, b = before.get(path), after.get(path)
        if a is None:
            changes.append(f"{label(path)} added")
        elif b is None:
            changes.append(f"{label(path)} removed")
        elif a.get("size") != b.get("size"):
            changes.append(f"{label(path)} is {_size(b.get('size'))}, was {_size(a.get('size'))}")
        elif a != b:
            changes.append(f"{label(path)} was modified (same size, another mtime)")
    if not changes:  # the same files in another order
        return None
    more = len(changes) - MAX_FILES_NAMED
    return "; ".join(changes[:MAX_FILES_NAMED]) + (f"; and {more} more" if more > 0 else "")


def _size(value: Any) -> str:
    return f"{value:,} bytes" if type(value) is int else json.dumps(value)[:20]
