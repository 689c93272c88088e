"""What a prepared data set was made from: the settings and source files it depends on, as plain data
written next to it, so that a later run reuses it only when nothing it depends on has changed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ctrain.files import read_bounded
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
            out.append(f"{name}: prepared {json.dumps(a)[:80]}, recipe {json.dumps(b)[:80]}")
    return out
