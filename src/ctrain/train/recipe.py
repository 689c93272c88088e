"""Training recipes: YAML files mapped to typed settings, checked without torch.

A login node (``ctrain submit``, ``ctrain train --check``) imports only this module: no torch,
transformers or datasets. :func:`load_recipe` checks the schema (unknown keys list the valid ones);
:func:`check_recipe` checks what a recipe points at (paths, data columns, sizes, world size) as far
as this machine can without downloads, and returns notes about what it could not check.

Relative paths in a recipe are relative to the working directory (where ``ctrain train`` runs;
``/workspace`` in the training image); ``$VAR`` and ``${VAR}`` are expanded in every path.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ctrain.errors import ConfigError, NonFiniteTraining
from ctrain.fast import FastSettings
from ctrain.files import name_problem, shorten
from ctrain.settings import build, read_settings, to_mapping

# Exit code of a run that stopped on a preemption signal after saving a complete checkpoint:
# "checkpointed, requeue me" (EX_TEMPFAIL from sysexits.h). The sbatch scripts requeue on it.
PREEMPTED_EXIT_CODE = 75
# Exit code of a run stopped because its loss or gradient norm was NaN or infinite, before that
# state was saved: do not requeue (it would diverge again); lower the learning rate or fix the data.
NONFINITE_EXIT_CODE = NonFiniteTraining.exit_code  # 65, EX_DATAERR

# Files ctrain writes into the output directory (documented in docs/training.md).
COMPLETE_MARKER = "ctrain-complete.json"  # last file of a checkpoint or final model: it is whole
PREPARED_MARKER = "ctrain-prepared.json"  # last file of a prepared data set, with what it was made from
PREEMPTED_FILE = "ctrain-preempted.json"  # written when a run stops on a preemption signal
FINAL_DIR = "final"  # the trained model and tokenizer, Hugging Face format
MERGED_DIR = "merged"  # in FINAL_DIR with peft.merge: the base model with the adapter folded in
PREPARED_DIR = "prepared"  # default place of `ctrain prepare`'s output
METRICS_FILE = "metrics.jsonl"  # every logged step, one JSON object a line
RECIPE_COPY = "recipe.yaml"  # the recipe as run, overrides applied

# Bumped whenever tokenisation or packing changes what a prepared data set holds.
PREPARE_VERSION = 1

BUILTIN_SOURCES = ("addition", "subtraction")
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GLOB = re.compile(r"[*?\[]")

# Rows per optimizer step and tokens per row beyond any real run: larger values are typing mistakes
# (and would make the batch layout search take forever).
MAX_GLOBAL_BATCH = 2**24
MAX_LENGTH = 2**24

# What `ctrain train` needs at the least, shown when a recipe lacks it.
MINIMAL_RECIPE = (
    "the minimal recipe is `model: {path: MODEL}` (a local directory or hub name) and `data: {source: FILE}` "
    "(chats in .jsonl, .json, .csv or .parquet); recipes/demo-addition.yaml trains a model from scratch"
)


@dataclass
class ModelSettings:
    """Which model to train: a pretrained one (``path``) or a new one from a config (``config``)."""

    path: str | None = None
    config: str | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    revision: str | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    attn_implementation: Literal[
        "auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"
    ] = "auto"
    trust_remote_code: bool = False

    def validate(self) -> None:
        if (self.path is None) == (self.config is None):
            raise ConfigError(
                "set exactly one of model.path (a pretrained model: a local directory or a hub name) and "
                "model.config (a new model: a model type such as 'llama', or a config file or directory)"
            )


@dataclass
class TokenizerTraining:
    """A byte-level BPE tokenizer trained on the training data (for models trained from scratch)."""

    vocab_size: int = 512
    min_frequency: int = 2
    max_examples: int | None = None

    def validate(self) -> None:
        # 256 byte symbols plus ctrain's special tokens must fit.
        if self.vocab_size < 300:
            raise ConfigError(f"tokenizer.train.vocab_size is {self.vocab_size}; it must be at least 300")
        if self.min_frequency < 1:
            raise ConfigError("tokenizer.train.min_frequency must be at least 1")
        if self.max_examples is not None and self.max_examples < 1:
            raise ConfigError(f"tokenizer.train.max_examples is {self.max_examples}; it must be at least 1")


@dataclass
class TokenizerSettings:
    """The tokenizer: from a path or hub name (default: the model's), or trained on the data."""

    path: str | None = None
    train: TokenizerTraining | None = None
    chat_template: str | None = None

    def validate(self) -> None:
        if self.path is not None and self.train is not None:
            raise ConfigError("set at most one of tokenizer.path and tokenizer.train")


@dataclass
class DataSettings:
    """Where the training examples come from and how they become token sequences."""

    source: str = ""
    format: Literal["auto", "json", "csv", "parquet", "arrow", "disk", "hub"] = "auto"
    config_name: str | None = None
    split: str = "train"
    revision: str | None = None
    eval_split: str | None = None
    eval_size: float | None = None
    max_examples: int | None = None
    text_column: str = "text"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    assistant_only_loss: bool = True
    max_length: int = 1024
    packing: bool = True
    packing_strategy: Literal["bfd", "bfd_split", "wrapped"] = "bfd"
    streaming: bool = False
    prepared_dir: str | None = None
    num_proc: int | None = None

    def validate(self) -> None:
        if not self.source:
            raise ConfigError(
                "data.source is required: a file, glob or directory (jsonl, json, parquet, csv, arrow, or a "
                f"save_to_disk folder), a hub data set name, or builtin:NAME ({', '.join(BUILTIN_SOURCES)})"
            )
        if self.max_length < 2:
            raise ConfigError(f"data.max_length is {self.max_length}; it must be at least 2")
        if self.max_length > MAX_LENGTH:
            raise ConfigError(f"data.max_length is {self.max_length} tokens; no model holds more than {MAX_LENGTH}")
        for name in ("text_column", "messages_column", "prompt_column", "completion_column", "split"):
            if not getattr(self, name).strip():
                raise ConfigError(f"data.{name} is empty; name a column (or split) of the data")
        if self.eval_split is not None and self.eval_size is not None:
            raise ConfigError("set at most one of data.eval_split (a split of the source) and data.eval_size")
        if self.eval_size is not None and self.eval_size <= 0:
            raise ConfigError(
                f"data.eval_size is {self.eval_size}; give a number of examples (>= 1) or a fraction (0 < f < 1)"
            )
        if self.eval_size is not None and self.eval_size >= 1 and self.eval_size != int(self.eval_size):
            raise ConfigError(f"data.eval_size is {self.eval_size}: a count of examples must be whole")
        if self.max_examples is not None and self.max_examples < 1:
            raise ConfigError("data.max_examples must be at least 1")
        if self.num_proc is not None and self.num_proc < 1:
            raise ConfigError("data.num_proc must be at least 1")


@dataclass
class TrainingSettings:
    """How to train: batch, schedule, precision, checkpoints, distribution."""

    output_dir: str | None = None
    engine: Literal["auto", "hf", "fast"] = "auto"
    global_batch_size: int = 64
    max_per_device_batch_size: int | None = None
    max_steps: int | None = None
    epochs: float = 1.0
    learning_rate: float = 2e-5
    lr_scheduler: Literal[
        "linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup", "inverse_sqrt", "polynomial"
    ] = "cosine"
    warmup: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    optim: str = "auto"
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    gradient_checkpointing: bool = False
    torch_compile: bool = False
    liger_kernel: bool = False
    logging_steps: int = 10
    save_steps: int = 500
    save_total_limit: int | None = 2
    eval_steps: int | None = None
    resume: str = "auto"
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    deepspeed: str | None = None
    fsdp: bool = False
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    dataloader_workers: int | None = None
    ddp_timeout_minutes: int = 30
    peak_tflops: float | None = None

    def hf_speedups(self) -> list[str]:
        """The transformers speed-ups turned on; the fast engine has its own (compiled layers, fused loss)."""
        return [name for name in ("torch_compile", "liger_kernel") if getattr(self, name)]

    def validate(self) -> None:
        positive = {
            "global_batch_size": self.global_batch_size,
            "logging_steps": self.logging_steps,
            "save_steps": self.save_steps,
            "ddp_timeout_minutes": self.ddp_timeout_minutes,
        }
        for name in ("max_per_device_batch_size", "max_steps", "eval_steps", "save_total_limit"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"training.{name} is {value}; it must be at least 1")
        if self.global_batch_size > MAX_GLOBAL_BATCH:
            raise ConfigError(
                f"training.global_batch_size is {self.global_batch_size} rows per step; at most {MAX_GLOBAL_BATCH}"
            )
        if self.ddp_timeout_minutes > 525_600:
            raise ConfigError(f"training.ddp_timeout_minutes is {self.ddp_timeout_minutes}; at most 525600 (a year)")
        if self.weight_decay < 0:
            raise ConfigError(f"training.weight_decay is {self.weight_decay}; it must be >= 0")
        if self.output_dir is not None and not self.output_dir.strip():
            raise ConfigError("training.output_dir is empty: name a directory, or remove the key for outputs/NAME")
        if self.max_steps is None and self.epochs <= 0:
            raise ConfigError(f"training.epochs is {self.epochs}; it must be positive (or set training.max_steps)")
        if self.learning_rate <= 0:
            raise ConfigError(f"training.learning_rate is {self.learning_rate}; it must be positive")
        if self.warmup < 0:
            raise ConfigError("training.warmup must be >= 0 (a fraction of the steps below 1, else a step count)")
        if self.deepspeed and self.fsdp:
            raise ConfigError("set at most one of training.deepspeed and training.fsdp")
        if self.dataloader_workers is not None and self.dataloader_workers < 0:
            raise ConfigError("training.dataloader_workers must be >= 0")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError("training.peak_tflops must be positive")
        for name in self.preemption_signals:
            signal_number(name)
        if self.resume not in ("auto", "never") and not self.resume:
            raise ConfigError("training.resume must be auto, never, or a checkpoint directory")


@dataclass
class PeftSettings:
    """Train LoRA adapters on a pretrained model instead of every weight (PEFT, as TRL's ``--use_peft``).

    ``method: lora`` adds rank-``r`` adapters to ``target_modules`` (``all-linear``: every linear
    layer but the output head; or module names such as ``[q_proj, v_proj]``); ``qlora`` also loads
    the frozen base in 4 bits (bitsandbytes nf4, double quantisation), on GPUs only. Checkpoints and
    ``final/`` hold the adapter; ``merge: true`` also writes ``final/merged``, the base model with
    the adapter folded in, loadable without PEFT.
    """

    method: Literal["none", "lora", "qlora"] = "none"
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: str | list[str] = "all-linear"
    modules_to_save: list[str] = field(default_factory=list)
    merge: bool = False

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def validate(self) -> None:
        if self.r < 1:
            raise ConfigError(f"peft.r is {self.r}; the adapter rank must be at least 1 (8 to 64 is usual)")
        if self.alpha <= 0:
            raise ConfigError(f"peft.alpha is {self.alpha}; it must be positive (often twice peft.r)")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"peft.dropout is {self.dropout}; it must be at least 0 and below 1")
        targets = [self.target_modules] if isinstance(self.target_modules, str) else self.target_modules
        if not targets or any(not isinstance(t, str) or not t.strip() for t in targets):
            raise ConfigError(
                "peft.target_modules names no module: use all-linear, or module names such as [q_proj, v_proj]"
            )
        if isinstance(self.target_modules, list) and "all-linear" in self.target_modules:
            raise ConfigError("peft.target_modules: all-linear stands alone (target_modules: all-linear)")
        if self.merge and not self.enabled:
            raise ConfigError("peft.merge folds trained adapters into the model: set peft.method (lora or qlora)")

    def targets(self) -> str | list[str]:
        """What PEFT's LoraConfig takes: the ``all-linear`` shorthand as is, else the list of names."""
        if isinstance(self.target_modules, str):
            return self.target_modules if self.target_modules == "all-linear" else [self.target_modules]
        return list(self.target_modules)


@dataclass
class LoggingSettings:
    """Where metrics go, and what each rank prints."""

    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=lambda: ["tensorboard"])
    wandb_project: str | None = None
    run_name: str | None = None
    memory: bool = True
    rank_prefix: bool = True


@dataclass
class HubSettings:
    """Push the final model to the Hugging Face Hub (token from HF_TOKEN or `hf auth login`)."""

    repo_id: str | None = None
    private: bool = True

    def validate(self) -> None:
        if self.repo_id is not None and not _REPO_ID.fullmatch(self.repo_id):
            raise ConfigError(
                f"hub.repo_id {self.repo_id!r} is not a Hugging Face repository id like NAMESPACE/NAME "
                "(letters, digits, '-', '_', '.'; at most 96 characters)"
            )


_REPO_ID = re.compile(r"(?=.{1,96}$)([A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


@dataclass
class EvalSettings:
    """``ctrain eval``: exact-match accuracy of generated answers on the held-out examples."""

    max_examples: int | None = None
    max_new_tokens: int = 32
    batch_size: int = 64

    def validate(self) -> None:
        for name in ("max_new_tokens", "batch_size", "max_examples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"eval.{name} is {value}; it must be at least 1")


@dataclass
class Recipe:
    """A whole recipe file."""

    name: str | None = None
    task: Literal["sft", "clm"] = "sft"
    seed: int = 42
    model: ModelSettings = field(default_factory=ModelSettings)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    data: DataSettings = field(default_factory=DataSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    hub: HubSettings = field(default_factory=HubSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    fast: FastSettings = field(default_factory=FastSettings)
    peft: PeftSettings = field(default_factory=PeftSettings)
    path: Path | None = field(default=None, init=False, compare=False)

    def validate(self) -> None:
        if self.model.path is None and self.model.config is None:
            raise ConfigError(f"the recipe names no model: {MINIMAL_RECIPE}", key="model")
        if not self.data.source:
            raise ConfigError(f"the recipe names no data (data.source): {MINIMAL_RECIPE}", key="data")
        for section in (self.model, self.tokenizer, self.data, self.training, self.hub, self.eval, self.fast, self.peft):
            section.validate()
        if self.tokenizer.train is not None:
            self.tokenizer.train.validate()
        if self.peft.enabled:
            self._validate_peft()
        if self.name is not None:
            problem = name_problem(self.name)
            if problem:
                raise ConfigError(
                    f"name {shorten(self.name)!r} {problem}: the run's name is its directory under outputs/, so give a "
                    "short name of letters, digits, '-', '_' and '.'",
                    key="name",
                )
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed is {self.seed}; it must be between 0 and {2**32 - 1}", key="seed")
        if self.tokenizer.path is None and self.tokenizer.train is None and self.model.path is None:
            raise ConfigError(
                "a model trained from scratch (model.config) needs tokenizer.path, or tokenizer.train to train "
                "one on the data"
            )
        if self.data.streaming:
            if self.task != "clm":
                raise ConfigError("data.streaming is for causal-LM pretraining (task: clm); use ctrain prepare for sft")
            if self.training.max_steps is None:
                raise ConfigError("data.streaming needs training.max_steps: a stream has no length to count epochs")
            if self.tokenizer.train is not None:
                raise ConfigError(
                    "tokenizer.train needs the whole data set: turn off data.streaming, or use tokenizer.path"
                )
            if self.data.eval_size is not None:
                raise ConfigError("data.eval_size cannot hold out examples of a stream: use data.eval_split")
        if self.training.engine == "fast" and self.task != "sft":
            raise ConfigError("training.engine: fast is the SFT fast path; use engine hf (or auto) for task clm")
        if self.training.engine == "fast":
            for name in self.training.hf_speedups():
                raise ConfigError(
                    f"training.{name} is transformers' own speed-up and training.engine: fast already "
                    f"compiles its layers and fuses the loss: turn training.{name} off, or use engine hf"
                )
        positions = self.model.config_overrides.get("max_position_embeddings")
        if "max_position_embeddings" in self.model.config_overrides and (
            not isinstance(positions, int) or isinstance(positions, bool) or positions < 1
        ):
            raise ConfigError(
                f"model.config_overrides.max_position_embeddings is {positions!r}; it must be a positive integer"
            )
        if isinstance(positions, int):
            check_max_length(self.data.max_length, positions, "model.config_overrides")

    def _validate_peft(self) -> None:
        method = self.peft.method
        if self.model.path is None:
            raise ConfigError(
                f"peft.method: {method} adapts a pretrained model, and model.config makes a new one with random "
                "weights: set model.path (a local directory or hub name), or remove the peft section to train "
                "every weight"
            )
        if self.training.engine == "fast":
            raise ConfigError(
                f"training.engine: fast trains every weight; with peft.method: {method} use engine auto or hf"
            )
        if method == "qlora" and (self.training.deepspeed or self.training.fsdp):
            sharding = "deepspeed" if self.training.deepspeed else "fsdp"
            raise ConfigError(
                f"peft.method: qlora keeps a 4-bit base on every GPU (DDP) and does not combine with training."
                f"{sharding}: remove training.{sharding}, or use method lora"
            )
        if method == "qlora" and self.model.dtype == "float32":
            raise ConfigError("peft.method: qlora computes in bfloat16: set model.dtype to auto or bfloat16")

    # --- derived values ---------------------------------------------------------------------------

    @property
    def run_name(self) -> str:
        """The recipe's name: ``name``, else the file name without extension."""
        if self.name:
            return self.name
        return self.path.stem if self.path else "run"

    @property
    def output_dir(self) -> Path:
        """``training.output_dir``, else ``$CTRAIN_OUTPUT_DIR/NAME``, else ``outputs/NAME``."""
        if self.training.output_dir:
            return expand_path(self.training.output_dir)
        root = os.environ.get("CTRAIN_OUTPUT_DIR") or "outputs"
        return Path(root).expanduser() / self.run_name

    @property
    def prepared_dir(self) -> Path:
        """``data.prepared_dir``, else ``OUTPUT_DIR/prepared``."""
        if self.data.prepared_dir:
            return expand_path(self.data.prepared_dir)
        return self.output_dir / PREPARED_DIR

    def to_yaml(self) -> str:
        import yaml

        data = to_mapping(self)
        data.pop("path", None)
        return yaml.safe_dump(data, sort_keys=False)


def check_max_length(max_length: int, positions: int | None, where: str) -> None:
    """The one rule, wherever the model's size is known (its overrides, its config file, the loaded
    config): a sequence must fit the model's positions."""
    if positions is not None and max_length > positions:
        raise ConfigError(
            f"data.max_length ({max_length}) is larger than the model's max_position_embeddings "
            f"({positions}, {where}): lower data.max_length"
        )


def expand_path(value: str | Path) -> Path:
    """A recipe path with ``~`` and environment variables expanded."""
    return Path(os.path.expandvars(str(value))).expanduser()


def signal_number(name: str) -> int:
    """``SIGUSR1`` (or ``USR1``) -> its number; a ConfigError for names that cannot be caught."""
    full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    if full in ("SIGKILL", "SIGSTOP") or not hasattr(signal, full):
        raise ConfigError(f"training.preemption_signals: {name!r} is not a signal a process can catch (e.g. SIGUSR1)")
    return int(getattr(signal, full))


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file, apply ``key=value`` overrides, and validate the settings (no torch).

    Raises :class:`ConfigError` naming the bad key (and listing the valid ones) or value.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"recipe {path} does not exist (relative paths are relative to {Path.cwd()})")
    if path.is_dir():
        raise ConfigError(f"recipe {path} is a directory: name the recipe's YAML file")
    if not path.is_file():
        raise ConfigError(f"recipe {path} is not a regular file: name the recipe's YAML file")
    try:
        source = read_settings(path)
    except ConfigError as exc:
        if path.suffix.lower() in (".yaml", ".yml"):
            raise
        raise ConfigError(f"{exc} (a recipe is a YAML file, such as recipes/demo-addition.yaml)") from exc
    if not source.data:
        raise ConfigError(f"recipe {path} is empty: {MINIMAL_RECIPE}")
    recipe = build(Recipe, source, overrides)
    recipe.path = path
    return recipe


# --- batch layout ---------------------------------------------------------------------------------


def batch_layout(training: TrainingSettings, world_size: int, cap: int | None = None) -> tuple[int, int]:
    """(per-device batch, gradient accumulation steps) giving ``global_batch_size`` on ``world_size`` processes.

    Each process takes an equal share of the global batch, in micro-batches of at most
    ``max_per_device_batch_size`` (and ``cap``) rows; accumulation makes up the rest. The global
    batch, hence the schedule and the result, stays the same from one process to 16 nodes.
    """
    total = training.global_batch_size
    if world_size < 1:
        raise ConfigError(f"world size {world_size} is not a number of processes")
    if total % world_size:
        raise ConfigError(
            f"training.global_batch_size ({total}) does not divide among {world_size} processes: "
            f"make it a multiple of {world_size}"
        )
    share = total // world_size
    limit = min(x for x in (share, training.max_per_device_batch_size, cap) if x is not None)
    per_device = max(d for d in _divisors(share) if d <= limit)
    return per_device, share // per_device


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in small]


# --- sources --------------------------------------------------------------------------------------


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
        files = tuple(sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()))
        if not files:
            raise ConfigError(f"data.source: no files match {raw} (relative paths are relative to {Path.cwd()})")
        return Source("files", raw, _file_format(files, data), files)
    if path.exists():
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
    return tuple(sorted(p for p in found if p.is_file()))


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
        if what and not path.is_dir():
            raise ConfigError(
                f"{value} is a file; {what} is a directory holding a saved model (config.json, weights, tokenizer "
                "files) or a hub name"
            )
        return "local"
    if _looks_like_path(value) or not _HUB_NAME.match(value):
        raise ConfigError(f"{value} does not exist (relative paths are relative to {Path.cwd()})")
    return "hub"


def _settings_file(value: str, what: str) -> Path:
    """A file a setting names: it exists, is a file and can be read."""
    path = expand_path(value)
    if path.is_dir():
        raise ConfigError(f"{what}: {value} is a directory; name a file")
    if not path.is_file():
        raise ConfigError(f"{what}: {value} does not exist (relative paths are relative to {Path.cwd()})")
    _readable(path, what)
    return path


# --- checks without torch -------------------------------------------------------------------------


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
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"data.source: cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"data.source: {path} is not valid JSON ({exc}): save the data set again") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"data.source: {path} is not a JSON object: save the data set again")
    return data


def _disk_columns(directory: Path, split: str) -> list[str] | None:
    if (directory / "dataset_dict.json").is_file():
        splits = _json_object(directory / "dataset_dict.json").get("splits") or []
        if split not in splits:
            raise ConfigError(f"data.split: {directory} has no split '{split}'; splits: {', '.join(map(str, splits))}")
        directory = directory / split
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


def _model_positions(recipe: Recipe) -> tuple[int | None, str]:
    """The model's max_position_embeddings where it can be read without transformers, and from where."""
    positions = recipe.model.config_overrides.get("max_position_embeddings")
    if isinstance(positions, int):
        return positions, "model.config_overrides"
    reference = recipe.model.path or recipe.model.config
    assert reference is not None
    path = expand_path(reference)
    config = path / "config.json" if path.is_dir() else path
    if config.is_file() and config.suffix == ".json":
        try:
            data = json.loads(config.read_bytes())
        except OSError as exc:
            raise ConfigError(f"model: cannot read {config}: {exc.strerror or exc}") from exc
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ConfigError(f"model: {config} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"model: {config} is not a model config (a JSON object)")
        text = data.get("text_config")
        data = text if isinstance(text, dict) else data
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if isinstance(data.get(key), int):
                return data[key], str(config)
    return None, reference


def check_json_file(value: str, what: str) -> Path:
    """A JSON settings file (DeepSpeed config) that exists and parses."""
    path = _settings_file(value, what)
    try:
        data = json.loads(path.read_bytes())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{what}: {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} holds {type(data).__name__}, not a JSON object of settings")
    return path


def check_recipe(recipe: Recipe, world_size: int | None = None) -> list[str]:
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
        try:
            template.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"tokenizer.chat_template: {template} is not UTF-8 text") from None
    positions, where = _model_positions(recipe)
    check_max_length(data.max_length, positions, where)
    if recipe.training.deepspeed:
        check_json_file(recipe.training.deepspeed, "training.deepspeed")
    if recipe.training.resume not in ("auto", "never"):
        resume = expand_path(recipe.training.resume)
        if not resume.is_dir():
            raise ConfigError(f"training.resume: {recipe.training.resume} is not a checkpoint directory")
    if world_size is not None:
        batch_layout(recipe.training, world_size)
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


# Model types are lower-case words (llama, gpt2, qwen2, mistral ...); anything else is a path or hub name.
BUILTIN_MODEL_TYPE = re.compile(r"^[a-z][a-z0-9_-]*$")


# --- what a prepared data set was made from -------------------------------------------------------


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
        text = expand_path(recipe.tokenizer.chat_template).read_bytes()
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


def recipe_keys(cls: type = Recipe, prefix: str = "") -> list[str]:
    """Every settable key of a recipe, dotted (for docs and help)."""
    keys = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        name = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            keys.extend(recipe_keys(type(default), f"{name}."))
        elif f.name == "train" and cls is TokenizerSettings:
            keys.append(name)
            keys.extend(recipe_keys(TokenizerTraining, f"{name}."))
        else:
            keys.append(name)
    return keys


__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Recipe",
    "batch_layout",
    "check_recipe",
    "load_recipe",
    "prepared_settings",
    "resolve_source",
]
