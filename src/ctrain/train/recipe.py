"""Training recipes: the schema of a recipe file, mapped to typed settings and validated without torch.

A login node (``ctrain submit``, ``ctrain train --check``) imports this module: no torch,
transformers or datasets. :func:`load_recipe` reads a recipe and checks it against the schema
(unknown keys list the valid ones); what a recipe points at is checked by :mod:`ctrain.train.preflight`.

Relative paths in a recipe are relative to the working directory (where ``ctrain train`` runs;
``/workspace`` in the training image); ``$VAR`` and ``${VAR}`` are expanded in every path.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ctrain.errors import ConfigError
from ctrain.fast import FastSettings
from ctrain.files import name_problem, shorten
from ctrain.settings import build, read_settings, to_mapping
from ctrain.train.artifacts import PREPARED_DIR

# The generators `data.source: builtin:NAME` may name (ctrain.train.demo makes their rows).
BUILTIN_SOURCES = ("addition", "subtraction")

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



__all__ = ["Recipe", "load_recipe", "recipe_keys"]
