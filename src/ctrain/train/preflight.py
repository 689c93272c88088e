"""Pre-flight checks: what a valid recipe points at (paths, data columns, sizes, world size), checked
as far as this machine can without torch or downloads, before a job is queued or a run starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError
from ctrain.files import load_json_bounded, read_text_bounded
from ctrain.settings import MAX_SETTINGS_BYTES
from ctrain.train.artifacts import PREPARED_MARKER
from ctrain.train.layout import batch_layout
from ctrain.train.recipe import RESUME_WORDS, Recipe, check_max_length, expand_path
from ctrain.train.sources import (
    BUILTIN_MODEL_TYPE,
    _readable,
    example_kind,
    model_kind,
    resolve_source,
    source_columns,
)


def _settings_file(value: str, what: str) -> Path:
    """A file a setting names: it exists, is a regular file and can be read."""
    path = expand_path(value)
    if path.is_dir():
        raise ConfigError(f"{what}: {value} is a directory; name a file")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{what}: {value} is not a regular file (a device, pipe or socket); name a file")
    if not path.is_file():
        raise ConfigError(f"{what}: {value} does not exist (relative paths are relative to {Path.cwd()})")
    _readable(path, what)
    return path


def _model_config(recipe: Recipe) -> tuple[dict[str, Any] | None, Path | None]:
    """The local model's config.json (model.path's, or model.config's file), read bounded before
    transformers reads it whole; (None, None) for a hub name or a built-in model type."""
    reference = recipe.model.path or recipe.model.config
    assert reference is not None
    path = expand_path(reference)
    config = path / "config.json" if path.is_dir() else path
    if not config.exists():
        return None, None
    data = load_json_bounded(config, MAX_SETTINGS_BYTES, "model: the config")
    if not isinstance(data, dict):
        raise ConfigError(f"model: {config} is not a model config (a JSON object)")
    return data, config


def _model_positions(recipe: Recipe) -> tuple[int | None, str]:
    """The model's max_position_embeddings where it can be read without transformers, and from where."""
    data, config = _model_config(recipe)
    positions = recipe.model.config_overrides.get("max_position_embeddings")
    if isinstance(positions, int):
        return positions, "model.config_overrides"
    reference = recipe.model.path or recipe.model.config
    assert reference is not None
    if data is not None:
        text = data.get("text_config")
        data = text if isinstance(text, dict) else data
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if isinstance(data.get(key), int):
                return data[key], str(config)
    return None, reference


def check_json_file(value: str, what: str) -> Path:
    """A JSON settings file (DeepSpeed config) that exists and parses."""
    path = _settings_file(value, what)
    data = load_json_bounded(path, MAX_SETTINGS_BYTES, f"{what}:")
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} holds {type(data).__name__}, not a JSON object of settings")
    return path


def trainer_config_class(task: str) -> type:
    """The installed library's argument class for TASK: TRL's SFTConfig for sft, else TrainingArguments."""
    if task == "clm":
        from transformers import TrainingArguments

        return TrainingArguments
    from trl import SFTConfig

    return SFTConfig


def check_trainer_args(extra: dict[str, Any], config: type) -> None:
    """Refuse a ``training.trainer_args`` name the installed library does not have, naming the nearest."""
    import dataclasses
    import difflib

    names = {f.name for f in dataclasses.fields(config) if f.init}
    for name in extra:
        if name not in names:
            near = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(near)}?" if near else f"the fields are {config.__name__}'s"
            library = config.__module__.split(".")[0]
            raise ConfigError(f"training.trainer_args.{name} is not a field of {library}'s {config.__name__} "
                              f"(the version installed here): {hint}")  # fmt: skip
    for name, (low, high, allowed) in _OPTIMIZER_RANGES.items():
        value = extra.get(name)
        if name in extra and (isinstance(value, bool) or not isinstance(value, (int, float)) or not low(value)
                              or not high(value)):  # fmt: skip
            raise ConfigError(f"training.trainer_args.{name} is {value!r}; it must be a number {allowed}")


#: trainer_args the optimizer or loss takes as they are, and would refuse (or diverge on) only once training runs.
_OPTIMIZER_RANGES: dict[str, tuple[Any, Any, str]] = {
    "adam_beta1": (lambda v: v >= 0, lambda v: v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: v >= 0, lambda v: v < 1, "in [0, 1)"),
    "adam_epsilon": (lambda v: v > 0, lambda v: v < 1, "in (0, 1)"),
    "max_grad_norm": (lambda v: v >= 0, lambda v: v < float("inf"), ">= 0 (0 turns clipping off)"),
    "label_smoothing_factor": (lambda v: v >= 0, lambda v: v < 1, "in [0, 1)"),
}


def preflight(recipe: Recipe, world_size: int | None = None) -> list[str]:
    """Check what the recipe points at, without torch and without downloads.

    Raises :class:`ConfigError` for missing or unreadable paths, data without the columns the task
    needs, a sequence length the model cannot hold, a global batch that does not divide among
    ``world_size`` processes, and broken DeepSpeed configs. Returns notes on what could not be
    checked here (hub names, formats that need pyarrow).
    """
    notes: list[str] = []
    data = recipe.data
    for reference, what in ((recipe.model.path, "model.path"), (recipe.tokenizer.path, "tokenizer.path")):
        if reference:
            try:
                kind = model_kind(reference, what)
            except ConfigError as exc:
                raise ConfigError(f"{what}: {exc}") from exc
            if kind == "hub":
                notes.append(f"{what} {reference} is a hub name: not checked here (needs the hub or the HF cache)")
    if recipe.model.config and not BUILTIN_MODEL_TYPE.match(recipe.model.config):
        try:
            model_kind(recipe.model.config)
        except ConfigError as exc:
            raise ConfigError(f"model.config: {exc}") from exc
    if recipe.tokenizer.chat_template:
        template = _settings_file(recipe.tokenizer.chat_template, "tokenizer.chat_template")
        read_text_bounded(template, MAX_SETTINGS_BYTES, "tokenizer.chat_template:")
    positions, where = _model_positions(recipe)
    check_max_length(data.max_length, positions, where)
    if recipe.training.deepspeed:
        check_json_file(recipe.training.deepspeed, "training.deepspeed")
    if recipe.training.resume not in RESUME_WORDS:
        resume = expand_path(recipe.training.resume)
        if not resume.is_dir():
            raise ConfigError(f"training.resume: {recipe.training.resume} is not a checkpoint directory")
    if world_size is not None:
        batch_layout(recipe.training, world_size)
    if recipe.training.trainer_args:
        library = "transformers" if recipe.task == "clm" else "trl"
        if importlib.util.find_spec(library) is None:
            notes.append(f"training.trainer_args: names not checked here ({library} is not installed)")
        else:
            check_trainer_args(recipe.training.trainer_args, trainer_config_class(recipe.task))
    if data.prepared_dir:
        prepared = expand_path(data.prepared_dir)
        if prepared.exists() and not (prepared / PREPARED_MARKER).is_file():
            notes.append(f"data.prepared_dir {prepared} exists but is not a finished `ctrain prepare` output")
    source = resolve_source(data)
    if data.eval_split and source.kind in ("files", "builtin"):
        raise ConfigError(
            f"data.eval_split: {data.source} has a single split; hold examples out with data.eval_size instead"
        )
    if source.kind == "hub":
        notes.append(f"data.source {data.source} is a hub data set: its columns are not checked here")
        return notes
    columns = source_columns(source, data)
    if columns is None:
        notes.append(f"data.source {data.source}: columns not checked here (install pyarrow to read {source.format})")
        return notes
    kind = example_kind(columns, recipe)
    if source.kind == "files":
        from ctrain.train.rows import SCAN_BYTES, scan_files

        if not scan_files(source, kind, recipe):
            notes.append(
                f"data.source {data.source}: rows after the first {SCAN_BYTES // 2**20} MiB are checked once the data "
                "loads"
            )
    return notes
