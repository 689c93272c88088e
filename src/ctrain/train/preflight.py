"""Pre-flight checks: what a valid recipe points at (paths, data columns, sizes, world size), checked
as far as this machine can without torch or downloads, before a job is queued or a run starts."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import time
from collections.abc import Callable
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


# A chat template is a program, run on every example: one that loops for hours or builds a string of
# gigabytes would stall or kill tokenizing after the job started. It is rendered once on the first
# example in a forked child, under these limits, before anything else is done with it.
TEMPLATE_SECONDS = 15
TEMPLATE_MEMORY = 2 * 2**30
# A rendered chat is its messages plus role markers for each and a fixed preamble (a default system
# prompt, tool instructions: kilobytes). 64 times its input plus 1 MiB is far more than any real template
# writes and still small enough to hold; a longer text is a template that repeats what it is given.
TEMPLATE_GROWTH = 64
TEMPLATE_SLACK = 2**20


def _limit_memory(extra: int) -> None:
    """Cap this process's address space at its current size plus ``extra`` bytes (never above its limit)."""
    import resource

    with open("/proc/self/statm") as handle:
        size = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    target = size + extra
    for limit in (soft, hard):
        if limit != resource.RLIM_INFINITY:
            target = min(target, limit)
    resource.setrlimit(resource.RLIMIT_AS, (target, hard))


def _render_child(render: Callable[[], str], seconds: int, write: int) -> None:
    """In the forked child: render under the limits and send back the length or the error; never returns."""
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the default action ends the child even inside C code
        signal.alarm(seconds)
        if os.path.exists("/proc/self/statm"):
            _limit_memory(TEMPLATE_MEMORY)
        message: dict[str, Any] = {"length": len(render())}
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        message = {"error": type(exc).__name__, "detail": text[:300]}
    try:
        os.write(write, json.dumps(message).encode()[:60_000])
    finally:
        os._exit(0)


def _run_forked(render: Callable[[], str], seconds: int) -> tuple[dict[str, Any] | None, str | None]:
    """(what the child sent, or None; how it ended when it sent nothing: 'timeout' or a signal name)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _render_child(render, seconds, write)
    os.close(write)
    deadline = time.monotonic() + seconds + 5
    received = b""
    ended: str | None = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                ended = "timeout"
                break
            chunk = os.read(read, 65536)
            if not chunk or len(received) > 65536:
                break
            received += chunk
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and ended is None:
        number = os.WTERMSIG(status)
        ended = "timeout" if number == signal.SIGALRM else signal.Signals(number).name
    try:
        return (json.loads(received) if received else None), ended
    except ValueError:
        return None, ended


def check_render(render: Callable[[], str], size: int, what: str, seconds: int | None = None) -> None:
    """Render a chat template once (``render()``: the first example) in a forked child with
    TEMPLATE_MEMORY more memory and ``seconds`` of time; a ConfigError naming ``what`` (the template's
    source) when it does not end, runs out of memory, fails, or writes far more than ``size`` characters."""
    fix = "fix the template, or set tokenizer.chat_template to another"
    seconds = seconds or TEMPLATE_SECONDS
    if not hasattr(os, "fork"):
        return
    message, ended = _run_forked(render, seconds)
    if ended == "timeout":
        raise ConfigError(f"{what} did not finish rendering the first example within {seconds} s (a loop that "
                          f"runs for hours?): {fix}")  # fmt: skip
    if message is None:
        raise ConfigError(f"{what}: rendering the first example was killed ({ended or 'no result'}; out of memory?): "
                          f"{fix}")  # fmt: skip
    if "error" in message:
        if message["error"] == "MemoryError":
            raise ConfigError(f"{what} needs more than {TEMPLATE_MEMORY // 2**30} GiB of memory to render the first "
                              f"example: {fix}")  # fmt: skip
        detail = f"{message['error']}: {message['detail']}" if message.get("detail") else message["error"]
        raise ConfigError(f"{what} fails on the first example ({detail}): {fix}")
    bound = TEMPLATE_GROWTH * size + TEMPLATE_SLACK
    if message.get("length", 0) > bound:
        raise ConfigError(
            f"{what} renders the first example ({size} characters of messages) into {message['length']} characters, "
            f"more than {TEMPLATE_GROWTH} times its input and 1 MiB: it repeats what it is given; {fix}"
        )


def first_chat(example: Any, kind: str, recipe: Recipe) -> list[Any] | None:
    """The chat of one example the chat template renders, or None when the example is no chat."""
    data = recipe.data
    if not isinstance(example, dict):
        return None
    if kind == "messages":
        chat = example.get(data.messages_column)
    elif kind == "prompt_completion" and isinstance(example.get(data.prompt_column), list):
        completion = example.get(data.completion_column)
        chat = example[data.prompt_column] + (completion if isinstance(completion, list) else [])
    else:
        return None
    return chat if isinstance(chat, list) and chat else None


def chat_size(chat: list[Any]) -> int:
    """Characters of a chat as JSON: what the rendered text is measured against."""
    return len(json.dumps(chat, default=str, ensure_ascii=False))


def template_origin(recipe: Recipe) -> str:
    """How an error names the chat template a recipe uses."""
    if recipe.tokenizer.chat_template:
        return f"the chat template tokenizer.chat_template ({recipe.tokenizer.chat_template})"
    if recipe.tokenizer.train is not None:
        return "ctrain's chat template"
    return f"the chat template of the tokenizer {recipe.tokenizer.path or recipe.model.path}"


def _local_template(recipe: Recipe) -> tuple[str | None, dict[str, Any]]:
    """(the chat template a recipe uses, read bounded without transformers, or None; the tokenizer's settings)."""
    if recipe.tokenizer.chat_template:
        path = expand_path(recipe.tokenizer.chat_template)
        return read_text_bounded(path, MAX_SETTINGS_BYTES, "tokenizer.chat_template:"), {}
    reference = recipe.tokenizer.path or recipe.model.path
    if recipe.tokenizer.train is not None or not reference or not expand_path(reference).is_dir():
        return None, {}
    directory = expand_path(reference)
    settings: dict[str, Any] = {}
    if (directory / "tokenizer_config.json").is_file():
        loaded = load_json_bounded(directory / "tokenizer_config.json", MAX_SETTINGS_BYTES, "the tokenizer config")
        settings = loaded if isinstance(loaded, dict) else {}
    if (directory / "chat_template.jinja").is_file():
        return read_text_bounded(directory / "chat_template.jinja", MAX_SETTINGS_BYTES, "the chat template:"), settings
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) else None), settings


# What the chat template renders when the data cannot be read here (a save_to_disk folder, parquet).
_SAMPLE_CHAT = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]


def _check_template(recipe: Recipe, source: Any, kind: str) -> str | None:
    """Render the recipe's chat template on the first example as prepare will (see :func:`check_render`);
    a note when it cannot be checked here."""
    if recipe.task != "sft" or kind == "text":
        return None
    template, settings = _local_template(recipe)
    if template is None:
        return None
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return "the chat template: not rendered here (transformers is not installed)"
    chat = None
    if source.kind == "files" and source.format in ("json", "csv"):
        from ctrain.train.rows import csv_rows, json_rows, row_limit

        limit = row_limit(recipe)
        rows = json_rows(source.files[0], limit) if source.format == "json" else csv_rows(source.files[0], limit)
        chat = next((first_chat(row, kind, recipe) for _, row, _ in rows), None)
    if chat is None and kind == "prompt_completion":
        return None
    chat = chat or _SAMPLE_CHAT
    tokens = {k: v for k, v in settings.items() if k in ("bos_token", "eos_token", "pad_token") and isinstance(v, str)}

    def render() -> str:
        return render_jinja_template([chat], chat_template=template, **tokens)[0][0]

    check_render(render, chat_size(chat), template_origin(recipe))
    return None


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
        why = (f"install pyarrow to read {source.format}" if source.kind == "files"
               else "its dataset_info.json lists no features")  # fmt: skip
        notes.append(f"data.source {data.source}: columns not checked here ({why})")
        return notes
    kind = example_kind(columns, recipe)
    if source.kind == "files":
        from ctrain.train.rows import SCAN_BYTES, scan_files

        if not scan_files(source, kind, recipe):
            notes.append(
                f"data.source {data.source}: rows after the first {SCAN_BYTES // 2**20} MiB are checked once the data "
                "loads"
            )
    note = _check_template(recipe, source, kind)
    return notes + ([note] if note else [])
