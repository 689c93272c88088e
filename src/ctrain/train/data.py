"""Training data: load the recipe's source, tokenize (and pack) it, and keep the result on disk.

One pipeline serves ``ctrain prepare`` and ``ctrain train``: :func:`prepare` writes the tokenized
data set, the tokenizer that made it and a marker listing what it was made from
(:func:`ctrain.train.fingerprint.prepared_settings`); :func:`load_prepared` refuses a data set whose
marker does not match the recipe. ``ctrain train`` without a prepared data set runs the same
:func:`prepare` on the main process while the others wait, so training never tokenizes per rank.

Rows are ``input_ids`` and ``labels`` (-100 where no loss is taken), plus ``seq_lengths`` when SFT
examples are packed; causal-LM text is concatenated and cut into blocks of ``max_length`` tokens
as transformers' run_clm does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctrain.errors import ConfigError, DiskFull
from ctrain.files import check_directory, load_json_bounded
from ctrain.settings import MAX_SETTINGS_BYTES
from ctrain.train import demo
from ctrain.train.artifacts import PREPARED_MARKER
from ctrain.train.checkpoint import (
    DIGEST,
    Damage,
    check_files,
    full_disk,
    manifest,
    marker_problem,
    out_of_space,
    quarantine,
)
from ctrain.train.fingerprint import prepared_settings, settings_differences
from ctrain.train.recipe import Recipe
from ctrain.train.sources import Source, example_kind, resolve_source, source_columns
from ctrain.train.rows import check_loaded, scan_files
from ctrain.train.tokenizer import load_tokenizer, texts_for_training, train_tokenizer

log = logging.getLogger("ctrain.train")

# Below this many examples per process, starting a process pool costs more than it saves.
ROWS_PER_PROCESS = 5000


@dataclass
class Prepared:
    """A prepared data set, loaded: what training consumes."""

    train: Any  # datasets.Dataset or IterableDataset
    eval: Any | None
    tokenizer: Any
    directory: Path | None  # None for streamed data
    info: dict[str, Any]


def cpu_count() -> int:
    """CPUs this process may use (Slurm's cgroup/cpuset, not the whole node)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _num_proc(recipe: Recipe, rows: int) -> int | None:
    wanted = recipe.data.num_proc or min(cpu_count(), max(1, rows // ROWS_PER_PROCESS))
    return wanted if wanted > 1 else None


def column_names(dataset: Any) -> list[str]:
    """Columns of a data set; a stream whose features are unknown is asked for its first example."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset)).keys())


# --- loading the source ---------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _load_error(recipe: Recipe, source: Source, exc: Exception) -> ConfigError:
    """The loader's error, or better, which file and line of a local source is broken and how."""
    if source.kind == "files":
        columns = source_columns(source, recipe.data)  # a broken file's first row or metadata: a ConfigError
        if columns is not None and source.format in ("json", "csv"):
            scan_files(source, example_kind(columns, recipe), recipe, budget=None)
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    detail = _first_line(exc) + (f" ({_first_line(cause)})" if cause is not exc else "")
    hint = ""
    if source.kind == "hub" and (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")):
        hint = " (offline: download it on a machine with internet into the shared HF cache, or save_to_disk it)"
    return ConfigError(f"cannot load data.source {recipe.data.source}: {detail}{hint}")


def _row_names(source: Source, split: str) -> Any:
    """``where(i)``: how an error names 0-based row ``i`` of the loaded source."""
    files = source.files
    if len(files) == 1:
        return lambda i: f"{files[0]} row {i + 1}"
    if files and source.format == "parquet":
        import pyarrow.parquet as pq

        counts = [pq.ParquetFile(path).metadata.num_rows for path in files]

        def where(i: int) -> str:
            for path, count in zip(files, counts):
                if i < count:
                    return f"{path} row {i + 1}"
                i -= count
            return f"row {i + 1}"

        return where
    if files:
        return lambda i: f"{source.name} row {i + 1} (counting through its {len(files)} files in order)"
    return lambda i: f"{source.name} row {i + 1}" + (f" (split {split})" if source.kind in ("disk", "hub") else "")


def _from_disk(directory: Path, split: str, what: str) -> Any:
    import datasets

    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"{what}: {directory} has no split '{split}'; splits: {', '.join(loaded)}")
        return loaded[split]
    return loaded


def _load_split(recipe: Recipe, source: Source, split: str, what: str, streaming: bool) -> Any:
    import datasets

    data = recipe.data
    if source.kind == "builtin":
        return datasets.Dataset.from_list(demo.builtin_rows(source.name, recipe.seed))
    if source.kind == "disk":
        loaded = _from_disk(source.directory, split, what)  # type: ignore[arg-type]
        return loaded.to_iterable_dataset() if streaming else loaded
    if source.kind == "files":
        files = [str(p) for p in source.files]
        return datasets.load_dataset(source.format, data_files=files, split="train", streaming=streaming)
    where, revision = _hub_snapshot(source.name, data.revision)
    try:
        return datasets.load_dataset(where, data.config_name, split=split, revision=revision, streaming=streaming)
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise ConfigError(f"{what}: {source.name} has no split '{split}': {exc}") from exc
        raise


def _hub_snapshot(name: str, revision: str | None) -> tuple[str, str | None]:
    """Where datasets loads a hub data set from: the hub, or, with the hub offline (as in a job), the
    snapshot `ctrain fetch` left in the Hugging Face cache, loaded as a local data set repository
    (datasets alone, offline, finds only a data set it has loaded before)."""
    if not (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")):
        return name, revision
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(name, repo_type="dataset", revision=revision, local_files_only=True), None
    except Exception as exc:  # LocalEntryNotFoundError, or a revision the cache does not know
        from ctrain.train.hubrefs import HubRef, fetch_line

        line = fetch_line([HubRef("dataset", name, revision)])
        raise ConfigError(f"data.source {name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
                          f"hub is offline here: fetch it first, where the hub is reachable: {line}") from exc  # fmt: skip


def check_cache(recipe: Recipe) -> None:
    """datasets converts files and hub data sets into Arrow files in its cache before anything else:
    a cache that cannot be written fails the load, so say so first."""
    if resolve_source(recipe.data).kind not in ("files", "hub"):
        return
    import datasets

    check_directory(Path(datasets.config.HF_DATASETS_CACHE), "the datasets cache (HF_DATASETS_CACHE)",
                    "set HF_HOME or HF_DATASETS_CACHE to a directory you can write")  # fmt: skip


def load_raw(recipe: Recipe, streaming: bool | None = None) -> tuple[Any, Any | None]:
    """The recipe's (train, eval) examples before tokenization; eval is None without eval_split/eval_size."""
    data = recipe.data
    streaming = data.streaming if streaming is None else streaming
    source = resolve_source(data)
    if data.eval_split and source.kind in ("files", "builtin"):
        raise ConfigError(
            f"data.eval_split: {data.source} has a single split; hold examples out with data.eval_size instead"
        )
    if not streaming:
        check_cache(recipe)
    try:
        train = _load_split(recipe, source, data.split, "data.split", streaming)
        evaluation = (
            _load_split(recipe, source, data.eval_split, "data.eval_split", streaming) if data.eval_split else None
        )
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many kinds (missing files, bad JSON, hub errors)
        raise _load_error(recipe, source, exc) from exc
    kind = example_kind(column_names(train), recipe)
    if not streaming:
        check_loaded(train, kind, recipe, _row_names(source, data.split))
        if evaluation is not None:
            check_loaded(evaluation, example_kind(column_names(evaluation), recipe), recipe,
                         _row_names(source, data.eval_split or ""))  # fmt: skip
    if data.eval_size is not None:
        size = int(data.eval_size) if data.eval_size >= 1 else data.eval_size
        if isinstance(size, int) and size >= len(train):
            raise ConfigError(f"data.eval_size ({size}) leaves no training examples: the source has {len(train)}")
        try:
            parts = train.train_test_split(test_size=size, seed=recipe.seed)
        except ValueError as exc:
            raise ConfigError(
                f"data.eval_size {data.eval_size} cannot split {len(train)} examples: {exc}; choose a count of "
                "examples (>= 1) that leaves some for training"
            ) from exc
        train, evaluation = parts["train"], parts["test"]
    if data.max_examples is not None and not streaming:
        train = train.select(range(min(data.max_examples, len(train))))
    elif data.max_examples is not None:
        train = train.take(data.max_examples)
    return train, evaluation


# --- tokenization ---------------------------------------------------------------------------------


def _training_template(tokenizer: Any, recipe: Recipe) -> str | None:
    """A chat template with ``{% generation %}`` markers for assistant-only loss (None: the tokenizer's own)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if not recipe.data.assistant_only_loss or has_generation_markers(tokenizer.chat_template or ""):
        return None
    if not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer {recipe.tokenizer.path or recipe.model.path} has no chat template: set "
            "tokenizer.chat_template to a .jinja file"
        )
    try:
        return get_training_chat_template(tokenizer)
    except ValueError as exc:
        raise ConfigError(
            "the tokenizer's chat template has no {% generation %} markers and is not one TRL can patch: set "
            "tokenizer.chat_template to a template with markers, or data.assistant_only_loss: false"
        ) from exc


def check_chat_template(dataset: Any, tokenizer: Any, recipe: Recipe, kind: str) -> None:
    """Render the chat template on the first example in a child process with a time and memory limit
    before the data set is mapped: a template that loops for hours or builds gigabytes is one error here,
    not a hung or killed tokenization (see :func:`ctrain.train.preflight.check_render`)."""
    import datasets

    from ctrain.train.preflight import chat_size, check_render, first_chat, template_origin

    if isinstance(dataset, datasets.IterableDataset):
        example = next(iter(dataset.take(1)), None)
    else:
        example = dataset[0] if len(dataset) else None
    chat = first_chat(example, kind, recipe)
    if chat is None:
        return
    if not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer {recipe.tokenizer.path or recipe.model.path} has no chat template to render the chats of "
            f"data.source with: set tokenizer.chat_template to a .jinja file"
        )

    def render() -> str:
        return tokenizer.apply_chat_template(chat, tokenize=False)

    check_render(render, chat_size(chat), template_origin(recipe))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_sft_example(
    example: dict[str, Any],
    tokenizer: Any,
    kind: str,
    columns: dict[str, str],
    assistant_only: bool,
    template: str | None,
) -> dict[str, list[int]]:
    """One SFT example -> ``input_ids`` and ``labels`` (-100 outside what the model should learn to say)."""
    if kind == "messages":
        out = tokenizer.apply_chat_template(
            example[columns["messages"]],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=assistant_only,
            chat_template=template,
        )
        ids = list(out["input_ids"])
        if not assistant_only:
            return {"input_ids": ids, "labels": ids}
        mask = out["assistant_masks"]
        if 1 not in mask:
            raise ConfigError(
                "a chat has no assistant tokens after applying the chat template: its {% generation %} markers do "
                "not cover the assistant turns"
            )
        return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]}
    if kind == "prompt_completion":
        prompt, completion = example[columns["prompt"]], example[columns["completion"]]
        if isinstance(prompt, list):
            prompt_ids = tokenizer.apply_chat_template(
                prompt, tokenize=True, return_dict=True, add_generation_prompt=True
            )
            full = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)
            prompt_ids, ids = list(prompt_ids["input_ids"]), list(full["input_ids"])
        else:
            eos = tokenizer.eos_token or ""
            text = completion if completion.endswith(eos) else completion + eos
            prompt_ids = list(tokenizer(prompt)["input_ids"])
            ids = list(tokenizer(prompt + text)["input_ids"])
        start = _common_prefix(prompt_ids, ids)
        return {"input_ids": ids, "labels": [-100] * start + ids[start:]}
    ids = list(tokenizer(example[columns["text"]])["input_ids"])
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return {"input_ids": ids, "labels": ids}


def _truncate(example: dict[str, Any], length: int) -> dict[str, Any]:
    return {"input_ids": example["input_ids"][:length], "labels": example["labels"][:length]}


def _has_loss(example: dict[str, Any]) -> bool:
    return any(label != -100 for label in example["labels"][1:])


def _tokenize_text(batch: dict[str, list[Any]], tokenizer: Any, column: str) -> dict[str, list[list[int]]]:
    ids = tokenizer(batch[column])["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids = [row + [eos] if not row or row[-1] != eos else row for row in ids]
    return {"input_ids": ids}


def _group_blocks(batch: dict[str, list[list[int]]], length: int) -> dict[str, list[list[int]]]:
    """run_clm's group_texts: concatenate, drop the remainder, cut into blocks of ``length``."""
    tokens = [t for row in batch["input_ids"] for t in row]
    usable = len(tokens) // length * length
    blocks = [tokens[i : i + length] for i in range(0, usable, length)]
    return {"input_ids": blocks, "labels": [list(b) for b in blocks]}


def _features(with_lengths: bool = False) -> Any:
    from datasets import Features, Sequence, Value

    spec = {"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32"))}
    if with_lengths:
        spec["seq_lengths"] = Sequence(Value("int32"))
    return Features(spec)


def tokenize(dataset: Any, tokenizer: Any, recipe: Recipe, name: str) -> Any:
    """Tokenized (and for SFT with packing, packed) rows of ``dataset``."""
    import datasets

    data = recipe.data
    streaming = isinstance(dataset, datasets.IterableDataset)
    columns = column_names(dataset)
    kwargs: dict[str, Any] = {}
    if not streaming:
        kwargs = {"num_proc": _num_proc(recipe, len(dataset))}
    desc = (lambda text: {"desc": f"{text} {name}"}) if not streaming else (lambda text: {})
    if recipe.task == "clm":
        dataset = dataset.map(
            _tokenize_text,
            batched=True,
            remove_columns=columns,
            fn_kwargs={"tokenizer": tokenizer, "column": data.text_column},
            **kwargs,
            **desc("Tokenizing"),
        )
        return dataset.map(
            _group_blocks,
            batched=True,
            fn_kwargs={"length": data.max_length},
            **({"features": _features()} if not streaming else {}),
            **kwargs,
            **desc(f"Grouping into blocks of {data.max_length} tokens:"),
        )
    kind = example_kind(columns, recipe)
    check_chat_template(dataset, tokenizer, recipe, kind)
    template = _training_template(tokenizer, recipe) if kind == "messages" else None
    names = {
        "messages": data.messages_column,
        "prompt": data.prompt_column,
        "completion": data.completion_column,
        "text": data.text_column,
    }
    dataset = dataset.map(
        tokenize_sft_example,
        remove_columns=columns,
        features=_features(),
        fn_kwargs={
            "tokenizer": tokenizer,
            "kind": kind,
            "columns": names,
            "assistant_only": data.assistant_only_loss,
            "template": template,
        },
        **kwargs,
        **desc("Tokenizing"),
    )
    return shape_sft(dataset, recipe, kwargs, desc)


def shape_sft(dataset: Any, recipe: Recipe, kwargs: dict[str, Any] | None = None, desc: Any = None) -> Any:
    """Tokenized SFT rows (``input_ids``, ``labels``) as training takes them: packed, or truncated.

    ``kwargs`` go to each ``map``/``filter`` (``num_proc``); ``desc(text)`` gives their progress label.
    """
    data = recipe.data
    kwargs = kwargs or {}
    desc = desc or (lambda text: {})
    if data.packing:
        from trl.data_utils import pack_dataset

        packed = pack_dataset(dataset, data.max_length, data.packing_strategy, {**kwargs, **desc("Packing")})
        return packed.cast(_features(with_lengths=True)) if "seq_lengths" in packed.column_names else packed
    dataset = dataset.map(_truncate, fn_kwargs={"length": data.max_length}, **kwargs, **desc("Truncating"))
    return dataset.filter(_has_loss, **kwargs, **desc("Dropping examples without loss tokens from"))


# --- prepared data sets ---------------------------------------------------------------------------


def _tokenizer_for(recipe: Recipe, train: Any) -> Any:
    if recipe.tokenizer.train is None:
        return load_tokenizer(recipe)
    settings = recipe.tokenizer.train
    rows = train if settings.max_examples is None else train.select(range(min(settings.max_examples, len(train))))
    started = time.perf_counter()
    tokenizer = train_tokenizer(texts_for_training(rows, recipe), settings)
    if recipe.tokenizer.chat_template:
        from ctrain.train.tokenizer import finish_tokenizer

        tokenizer = finish_tokenizer(tokenizer, recipe)
    log.info(
        "trained a byte-level BPE tokenizer on %d examples: %d tokens (%.1f s)",
        len(rows), len(tokenizer), time.perf_counter() - started,
    )  # fmt: skip
    return tokenizer


def _count_tokens(dataset: Any) -> tuple[int, int]:
    """(tokens, tokens that carry loss) of a tokenized data set, read column-wise from Arrow."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    ids, labels = table.column("input_ids"), table.column("labels")
    tokens = int(pc.sum(pc.list_value_length(ids)).as_py() or 0)
    flat = pc.list_flatten(labels)
    trained = int(pc.sum(pc.not_equal(flat, -100)).as_py() or 0)
    return tokens, trained


def check_target(directory: Path) -> None:
    """The prepared data is written beside ``directory``, then renamed into place: both must be
    writable before any tokenizing starts, and a directory it replaces must be an earlier prepare's,
    never one holding other files (the source data, a project)."""
    other = "set data.prepared_dir (or --output) to a directory you can write"
    check_directory(directory, "the prepared data directory", other)
    if directory.exists():
        check_directory(directory.parent, "the prepared data directory's parent", other)
        if not (directory / PREPARED_MARKER).is_file() and any(directory.iterdir()):
            raise ConfigError(
                f"the prepared data directory {directory} holds other files and no {PREPARED_MARKER}, so it is no "
                "`ctrain prepare` output, and preparing would replace it: choose a new or empty directory "
                "(--output, data.prepared_dir)"
            )


def prepare(recipe: Recipe, directory: Path | None = None, *, force: bool = False) -> dict[str, Any]:
    """Tokenize the recipe's data into ``directory`` (default: the recipe's prepared_dir); returns its marker.

    Nothing is written until the source has loaded and its columns fit the task. The data set is
    written beside the target and moved into place with its marker last, so an interrupted
    prepare leaves no half data set that looks finished.
    """
    if recipe.data.streaming:
        raise ConfigError("data.streaming tokenizes while training; there is nothing to prepare (turn streaming off)")
    directory = directory or recipe.prepared_dir
    settings = prepared_settings(recipe)
    marker = directory / PREPARED_MARKER
    if marker.is_file() and not force:
        info = _read_marker(marker)
        differences = settings_differences(info.get("settings", {}), settings)
        if not differences and not _set_aside_if_damaged(directory, info):
            log.info("prepared data in %s already matches the recipe", directory)
            return info
        if differences:
            raise ConfigError(
                f"{directory} holds data prepared for different settings ({'; '.join(differences)}); "
                "re-run with --force to replace it, or set data.prepared_dir elsewhere"
            )
    check_target(directory)
    started = time.perf_counter()
    train, evaluation = load_raw(recipe, streaming=False)
    tokenizer = _tokenizer_for(recipe, train)
    log.info("tokenizing %d training examples (%s processes)", len(train), _num_proc(recipe, len(train)) or 1)
    splits = {"train": tokenize(train, tokenizer, recipe, "train")}
    if evaluation is not None:
        splits["eval"] = tokenize(evaluation, tokenizer, recipe, "eval")
    if len(splits["train"]) == 0:
        raise ConfigError(
            f"no training rows are left after tokenization (data.max_length {recipe.data.max_length}): "
            "the examples are longer than max_length without loss tokens inside it, or the source is too small"
        )
    stats: dict[str, Any] = {}
    for split, dataset in splits.items():
        tokens, trained = _count_tokens(dataset)
        stats[split] = {"rows": len(dataset), "tokens": tokens, "loss_tokens": trained}
    staging = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for split, dataset in splits.items():
            dataset.save_to_disk(str(staging / split), num_proc=_num_proc(recipe, len(dataset)))
        tokenizer.save_pretrained(str(staging / "tokenizer"))
        info = {
            "settings": settings,
            "stats": stats,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(time.perf_counter() - started, 1),
        }
        # What a damaged file is found by on every later use (usable_prepared): a truncated or scrambled
        # Arrow file would otherwise load, or train on tokens nobody wrote.
        info["digest"] = DIGEST
        info["manifest"] = dict(sorted(manifest(staging).items()))
        (staging / PREPARED_MARKER).write_text(json.dumps(info, indent=1) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    except Exception as exc:
        if not out_of_space(exc, staging.parent):
            raise
        raise DiskFull(
            f"{full_disk(staging.parent)} while the prepared data was written to {directory} ({type(exc).__name__}: {exc}); nothing of it is "
            "kept: free space there, or set data.prepared_dir to a directory on another file system"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info(
        "prepared %s: %s (%.1f s)",
        directory,
        ", ".join(f"{s} {v['rows']} rows / {v['tokens']} tokens" for s, v in stats.items()),
        info["seconds"],
    )
    return info


def prepared_info(recipe: Recipe, directory: Path) -> dict[str, Any] | None:
    """The marker of a finished prepared data set in ``directory`` matching the recipe; None if there is none.

    A ConfigError if it was made from different settings: training on it would silently train on
    other data than the recipe says.
    """
    marker = directory / PREPARED_MARKER
    if not marker.is_file():
        return None
    info = _read_marker(marker)
    differences = settings_differences(info.get("settings", {}), prepared_settings(recipe))
    if differences:
        raise ConfigError(
            f"the prepared data in {directory} does not match the recipe ({'; '.join(differences)}): run "
            f"`ctrain prepare --force {recipe.path or 'RECIPE'}` (with the same overrides) to rebuild it, or set "
            "data.prepared_dir to another directory"
        )
    return info


def usable_prepared(recipe: Recipe, directory: Path) -> dict[str, Any] | None:
    """:func:`prepared_info`, and its files checked against the sizes and checksums the marker recorded:
    a damaged data set is moved aside (kept, as a damaged checkpoint is) and None returned, so that it is
    prepared again. Read by this process alone, rank 0, before the others load it."""
    info = prepared_info(recipe, directory)
    if info is None or _set_aside_if_damaged(directory, info):
        return None
    return info


def _set_aside_if_damaged(directory: Path, info: dict[str, Any]) -> bool:
    """Whether the prepared data in ``directory`` was damaged, and so moved to ``DIR.damaged-REASON``.
    A marker from before checksums were recorded (no manifest) is taken as it is; an empty manifest, which
    prepare never writes, checks nothing and is damaged."""
    files, algorithm = info.get("manifest"), info.get("digest", DIGEST)
    if files is None:
        return False
    problem = marker_problem(files, algorithm) if isinstance(files, dict) else "the marker's manifest is not a mapping"
    if files == {}:  # prepare always writes train/ and the tokenizer: nothing would be checked
        problem = "the marker's manifest lists no files"
    if problem is None:
        verdict = check_files(directory, files, algorithm)
        damage = verdict.damage
    else:
        damage = Damage(PREPARED_MARKER, "unreadable", problem)
    if damage is None:
        log.info("prepared data in %s: %s", directory, verdict.summary())
        return False
    moved = quarantine(directory, damage.reason)
    log.warning("the prepared data in %s is damaged (%s): moved it to %s and preparing it again from the recipe's "
                "sources", directory, damage, moved.name)  # fmt: skip
    return True


def _read_marker(marker: Path) -> dict[str, Any]:
    try:
        info = load_json_bounded(marker, MAX_SETTINGS_BYTES, "the prepared data's marker")
    except ConfigError as exc:
        if str(exc).startswith("cannot read"):
            raise
        info = None
    if not isinstance(info, dict):
        raise ConfigError(
            f"{marker} is damaged (not a JSON object): run `ctrain prepare --force` to prepare the data again"
        )
    if not isinstance(info.get("settings", {}), dict):  # compared key by key with the recipe's settings
        raise ConfigError(
            f"{marker} is damaged (its settings are not a JSON object): run `ctrain prepare --force` to prepare the "
            "data again"
        )
    return info


def load_prepared(recipe: Recipe, directory: Path) -> Prepared:
    """A finished, matching prepared data set (see :func:`prepared_info`)."""
    import datasets
    from transformers import AutoTokenizer

    info = prepared_info(recipe, directory)
    if info is None:
        raise ConfigError(
            f"no prepared data in {directory}: run `ctrain prepare` first, or check that the directory is on "
            "storage every node can read"
        )
    # A marker with a manifest had its files checked on rank 0 (usable_prepared); one without (an older
    # ctrain's) did not, and a damaged file then fails in the loaders. Every rank loads, so nothing is
    # moved aside here: the error says how to rebuild it.
    try:
        train = datasets.load_from_disk(str(directory / "train"))
        evaluation = datasets.load_from_disk(str(directory / "eval")) if (directory / "eval").is_dir() else None
        tokenizer = AutoTokenizer.from_pretrained(str(directory / "tokenizer"))
    except (ConfigError, MemoryError):
        raise
    except Exception as exc:  # the loaders' errors have no common type: OSError, KeyError, tokenizers' Exception
        raise ConfigError(
            f"the prepared data in {directory} is damaged or incomplete ({_first_line(exc)[:200]}): run "
            f"`ctrain prepare --force {recipe.path or 'RECIPE'}` (with the same overrides) to prepare it again"
        ) from exc
    return Prepared(train, evaluation, tokenizer, directory, info)


def streamed(recipe: Recipe) -> Prepared:
    """Tokenize-as-you-go data for ``data.streaming`` (causal-LM corpora larger than the disk budget)."""
    train, evaluation = load_raw(recipe, streaming=True)
    tokenizer = load_tokenizer(recipe)
    train = tokenize(train, tokenizer, recipe, "train").shuffle(seed=recipe.seed, buffer_size=10_000)
    if evaluation is not None:
        evaluation = tokenize(evaluation, tokenizer, recipe, "eval")
    return Prepared(train, evaluation, tokenizer, None, {})
