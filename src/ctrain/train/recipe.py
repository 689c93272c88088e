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
MAX_STEPS = 10**9  # a billion steps: far past any run, far below where step arithmetic overflows
MAX_EPOCHS = 10**6
MAX_LENGTH = 2**24
# A LoRA rank above this is no low-rank adapter of any model that exists (hidden sizes stay below it).
MAX_RANK = 2**16
# Parameters a model config may describe: 10 trillion is beyond any model trained; more is a typo
# in a size (hidden_size: 1000000000) that would only reach the allocator.
MAX_PARAMETERS = 10**13
# Processes a setting may start on one machine (data.num_proc, training.dataloader_workers): more
# than any node has cores, so only a typo gets there, and forking that many takes the machine down.
MAX_PROCESSES = 1024
# A tokenizer trained here holds at most this many tokens (the largest vocabularies in use are ~256k).
MAX_VOCAB = 2**22

# What `ctrain train` needs at the least, shown when a recipe lacks it.
MINIMAL_RECIPE = (
    "the minimal recipe is `model: {path: MODEL}` (a local directory or hub name) and `data: {source: FILE}` "
    "(chats in .jsonl, .json, .csv or .parquet); recipes/demo-addition.yaml trains a model from scratch"
)


@dataclass
class ModelSettings:
    """Which model to train: a pretrained one (``path``) or a new one from a config (``config``)."""

    #: A pretrained model: a local directory (save_pretrained's) or a hub name.
    path: str | None = None
    #: A new model with random weights: a model type (llama, gpt2, qwen2 ...), or a config file, directory or hub name.
    config: str | None = None
    #: Fields set on the model config (run_clm's --config_overrides); unknown fields are errors.
    config_overrides: dict[str, Any] = field(default_factory=dict)
    #: Hub revision (branch, tag or commit) of the model and its tokenizer.
    revision: str | None = None
    #: Weights dtype at load; ``auto``: float32 master weights with autocast (bf16/fp16 under DeepSpeed).
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    #: Weights dtype of the final model (and of ``final/merged``); ``auto``: the pretrained checkpoint's own,
    #: for a new model the dtype it trained in. Checkpoints keep the training weights as they are.
    save_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    #: ``auto``: FlashAttention 2 on CUDA in bf16/fp16 when installed, else SDPA; or one by name.
    attn_implementation: Literal[
        "auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"
    ] = "auto"
    #: Allow model code from the hub.
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

    #: Vocabulary size: at least 300 (256 byte symbols plus the special tokens).
    vocab_size: int = 512
    #: A merge must occur at least this often.
    min_frequency: int = 2
    #: Train on the first N training examples only; None: all of them.
    max_examples: int | None = None

    def validate(self) -> None:
        # 256 byte symbols plus ctrain's special tokens must fit.
        if not 300 <= self.vocab_size <= MAX_VOCAB:
            raise ConfigError(f"tokenizer.train.vocab_size is {self.vocab_size}; it must be between 300 and {MAX_VOCAB}")
        if self.min_frequency < 1:
            raise ConfigError("tokenizer.train.min_frequency must be at least 1")
        if self.max_examples is not None and self.max_examples < 1:
            raise ConfigError(f"tokenizer.train.max_examples is {self.max_examples}; it must be at least 1")


@dataclass
class TokenizerSettings:
    """The tokenizer: from a path or hub name (default: the model's), or trained on the data."""

    #: A tokenizer directory or hub name; None: the model's (``model.path``).
    path: str | None = None
    #: Train a byte-level BPE tokenizer on the training data instead (models trained from scratch).
    train: TokenizerTraining | None = None
    #: A Jinja chat template file used instead of the tokenizer's own.
    chat_template: str | None = None

    def validate(self) -> None:
        if self.path is not None and self.train is not None:
            raise ConfigError("set at most one of tokenizer.path and tokenizer.train")


@dataclass
class DataSettings:
    """Where the training examples come from and how they become token sequences."""

    #: A file, glob or directory of data files, a save_to_disk folder, a hub data set, or ``builtin:NAME``.
    source: str = ""
    #: ``auto``: from the file extensions (save_to_disk folders are recognised); else the loader by name.
    format: Literal["auto", "json", "csv", "parquet", "arrow", "disk", "hub"] = "auto"
    #: Hub data set configuration (e.g. ``wikitext-2-raw-v1``).
    config_name: str | None = None
    #: Split to train on (hub data sets and save_to_disk DatasetDicts).
    split: str = "train"
    #: Hub data set revision.
    revision: str | None = None
    #: Split to evaluate on; at most one of this and ``eval_size``.
    eval_split: str | None = None
    #: Hold out this many training examples (>= 1) or this fraction (< 1) for evaluation, by the seed.
    eval_size: float | None = None
    #: Train on the first N examples only (after the hold-out): for trial runs.
    max_examples: int | None = None
    #: Text column (clm; sft on plain text).
    text_column: str = "text"
    #: Chat column: lists of ``{role, content}`` messages (sft).
    messages_column: str = "messages"
    #: Prompt column of prompt/completion data (sft).
    prompt_column: str = "prompt"
    #: Completion column of prompt/completion data; the loss is on the completion only.
    completion_column: str = "completion"
    #: Chats: the loss is on what the assistant says (and its end-of-turn token) only.
    assistant_only_loss: bool = True
    #: Tokens per sequence: longer sft examples are cut; the packing row length; the clm block size.
    max_length: int = 1024
    #: sft: pack examples into rows of ``max_length`` tokens and train padding-free; False: one example a row.
    packing: bool = True
    #: ``bfd`` (cuts overflow), ``bfd_split`` (moves overflow to another row), ``wrapped`` (cuts anywhere).
    packing_strategy: Literal["bfd", "bfd_split", "wrapped"] = "bfd"
    #: clm only: read and tokenize the corpus while training instead of preparing it (needs max_steps).
    streaming: bool = False
    #: Where ``ctrain prepare`` writes and ``ctrain train`` looks for prepared data; None: OUTPUT_DIR/prepared.
    prepared_dir: str | None = None
    #: Tokenization processes; None: the CPUs this process may use, at most one per 5000 examples.
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
        if self.num_proc is not None and not 1 <= self.num_proc <= MAX_PROCESSES:
            raise ConfigError(f"data.num_proc is {self.num_proc}; it must be between 1 and {MAX_PROCESSES}")


#: The TrainingArguments / SFTConfig fields ctrain sets itself, and from what (``training.trainer_args``
#: cannot name them). ``ctrain.train.trainer.argument_values`` sets exactly these (a test holds it).
OWNED_ARGS: dict[str, str] = {
    "output_dir": "training.output_dir",
    "per_device_train_batch_size": "training.global_batch_size and training.max_per_device_batch_size",
    "per_device_eval_batch_size": "training.global_batch_size and training.max_per_device_batch_size",
    "gradient_accumulation_steps": "training.global_batch_size and training.max_per_device_batch_size",
    "max_steps": "training.max_steps",
    "num_train_epochs": "training.epochs",
    "learning_rate": "training.learning_rate",
    "lr_scheduler_type": "training.lr_scheduler",
    "warmup_steps": "training.warmup",
    "weight_decay": "training.weight_decay",
    "max_grad_norm": "training.max_grad_norm",
    "optim": "training.optim",
    "bf16": "training.precision",
    "fp16": "training.precision",
    "use_cpu": "the device the run has",
    "activation_checkpointing": "training.gradient_checkpointing",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "torch_compile": "training.torch_compile",
    "use_liger_kernel": "training.liger_kernel",
    "logging_strategy": "training.logging_steps",
    "logging_steps": "training.logging_steps",
    "logging_first_step": "training.logging_steps (step 1 is always logged)",
    "logging_nan_inf_filter": "its NaN stop, which must see the loss",
    "save_strategy": "training.save_steps",
    "save_steps": "training.save_steps",
    "save_total_limit": "training.save_total_limit (it rotates complete checkpoints only)",
    "eval_strategy": "training.eval_steps",
    "eval_steps": "training.eval_steps",
    "report_to": "logging.report_to",
    "run_name": "logging.run_name",
    "seed": "seed",
    "deepspeed": "training.deepspeed",
    "fsdp": "training.fsdp",
    "fsdp_config": "training.fsdp_config",
    "dataloader_num_workers": "training.dataloader_workers",
    "ddp_timeout": "training.ddp_timeout_minutes",
    "ddp_find_unused_parameters": "the model (no unused parameters)",
    "include_num_input_tokens_seen": "its token counts",
    "disable_tqdm": "its progress lines",
    "remove_unused_columns": "its prepared data",
    "push_to_hub": "hub.repo_id (it pushes the final model once)",
    "max_length": "data.max_length",
    "packing": "data.packing",
    "padding_free": "data.packing",
    "dataset_kwargs": "its prepared data",
    "assistant_only_loss": "data.assistant_only_loss (the labels carry it)",
    "completion_only_loss": "the labels of its prepared data",
}


# What ``training.fsdp`` means unless ``training.fsdp_config`` says otherwise: FSDP2, every decoder
# layer (the model's ``_no_split_modules``) sharded as one unit and its parameters freed again after
# its forward; checkpoints written by each rank for its own shards (torch.distributed.checkpoint),
# which load on any number of GPUs, instead of gathered on rank 0. The final model is always saved
# whole (``ctrain.train.trainer``).
FSDP_DEFAULTS: dict[str, Any] = {
    "version": 2,
    "reshard_after_forward": True,
    "state_dict_type": "SHARDED_STATE_DICT",
}


@dataclass
class TrainingSettings:
    """How to train: batch, schedule, precision, checkpoints, distribution."""

    #: Checkpoints, final model and logs; None: ``$CTRAIN_OUTPUT_DIR/NAME``, else ``outputs/NAME``.
    output_dir: str | None = None
    #: ``hf`` (TRL/transformers), ``fast`` (the SFT fast path, GPU), ``auto`` (fast where it fits, else hf).
    engine: Literal["auto", "hf", "fast"] = "auto"
    #: Rows per optimizer step over all processes; must divide among them.
    global_batch_size: int = 64
    #: Largest micro-batch per process (accumulation makes up the rest); None: no limit.
    max_per_device_batch_size: int | None = None
    #: Optimizer steps; overrides ``epochs``.
    max_steps: int | None = None
    #: Passes over the data (without ``max_steps``).
    epochs: float = 1.0
    #: Peak learning rate.
    learning_rate: float = 2e-5
    #: Learning rate schedule after warm-up (transformers' scheduler names).
    lr_scheduler: Literal[
        "linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup", "inverse_sqrt", "polynomial"
    ] = "cosine"
    #: Linear warm-up: a fraction of the steps (< 1) or a number of steps.
    warmup: float = 0.0
    #: AdamW weight decay.
    weight_decay: float = 0.0
    #: Gradient clipping norm (0: none).
    max_grad_norm: float = 1.0
    #: A transformers optimizer name; ``auto``: adamw_torch_fused on CUDA, adamw_torch on CPU.
    optim: str = "auto"
    #: ``auto``: bf16 on GPUs that have it, else fp16; fp32 on CPU.
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    #: Recompute activations in the backward pass: less memory, slower.
    gradient_checkpointing: bool = False
    #: ``torch.compile`` the whole model (hf engine only).
    torch_compile: bool = False
    #: Liger's fused kernels (hf engine only; needs the liger-kernel package).
    liger_kernel: bool = False
    #: Log a line, metrics and memory every N steps (and at step 1).
    logging_steps: int = 10
    #: Checkpoint every N steps.
    save_steps: int = 500
    #: Complete checkpoints kept (older ones deleted once a newer one is whole); None: all.
    save_total_limit: int | None = 2
    #: Write each checkpoint in the background: training stops only to copy the tensors into host
    #: memory (ctrain.train.asyncsave); false, or FSDP/DeepSpeed: the blocking save.
    save_async: bool = True
    #: Evaluate every N steps (needs ``data.eval_split`` or ``data.eval_size``); None: not while training.
    eval_steps: int | None = None
    #: ``auto``: from the newest complete checkpoint in the output directory, if that run had the same
    #: settings; ``continue``: the same, also after settings that define the run changed (more
    #: ``max_steps``, say); ``never``; or a checkpoint directory.
    resume: str = "auto"
    #: Signals that make the run checkpoint and exit with PREEMPTED_EXIT_CODE (75).
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    #: A DeepSpeed config file (ZeRO through the Trainer); at most one of this and ``fsdp``.
    deepspeed: str | None = None
    #: Shard the model with PyTorch FSDP2 (GPUs only): each decoder layer its own unit, checkpoints
    #: sharded through torch.distributed.checkpoint, the final model one HF checkpoint (FSDP_DEFAULTS).
    fsdp: bool = False
    #: transformers' ``fsdp_config``, on top of FSDP_DEFAULTS.
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    #: Data loader worker processes; None: 2 on GPUs, 0 on CPU.
    dataloader_workers: int | None = None
    #: Timeout of a collective (NCCL/gloo) before the job fails.
    ddp_timeout_minutes: int = 30
    #: Peak dense TFLOP/s of one device, for the MFU estimate; None: from the GPU's name.
    peak_tflops: float | None = None
    #: Any other field of transformers' TrainingArguments (TRL's SFTConfig for sft), by its own name,
    #: e.g. ``{adam_beta2: 0.95, neftune_noise_alpha: 5}``; the fields ctrain sets are refused with the key to use.
    trainer_args: dict[str, Any] = field(default_factory=dict)

    def fsdp_settings(self) -> dict[str, Any]:
        """transformers' ``fsdp_config`` of this run: :data:`FSDP_DEFAULTS` under the recipe's own keys."""
        return {**FSDP_DEFAULTS, **self.fsdp_config}

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
        for name in ("max_steps", "eval_steps", "save_steps", "logging_steps", "save_total_limit"):
            value = getattr(self, name)
            if value is not None and value > MAX_STEPS:
                raise ConfigError(f"training.{name} is {value}; at most {MAX_STEPS:,}")
        if self.epochs > MAX_EPOCHS:
            raise ConfigError(f"training.epochs is {self.epochs}; at most {MAX_EPOCHS:,}")
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
        if self.dataloader_workers is not None and not 0 <= self.dataloader_workers <= MAX_PROCESSES:
            raise ConfigError(
                f"training.dataloader_workers is {self.dataloader_workers}; it must be between 0 and {MAX_PROCESSES}"
            )
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError("training.peak_tflops must be positive")
        for name in self.preemption_signals:
            signal_number(name)
        if self.resume not in RESUME_WORDS and not self.resume:
            raise ConfigError("training.resume must be auto, continue, never, or a checkpoint directory")
        for name in self.trainer_args:
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"training.trainer_args: {shorten(str(name))!r} is not a field name")
            if name in OWNED_ARGS:
                raise ConfigError(f"training.trainer_args.{name} is set by ctrain from {OWNED_ARGS[name]}; "
                                  f"remove it from training.trainer_args")  # fmt: skip


@dataclass
class PeftSettings:
    """Train LoRA adapters on a pretrained model instead of every weight (PEFT, as TRL's ``--use_peft``).

    ``method: lora`` adds rank-``r`` adapters to ``target_modules`` (``all-linear``: every linear
    layer but the output head; or module names such as ``[q_proj, v_proj]``); ``qlora`` also loads
    the frozen base in 4 bits (bitsandbytes nf4, double quantisation), on GPUs only. Checkpoints and
    ``final/`` hold the adapter; ``merge: true`` also writes ``final/merged``, the base model with
    the adapter folded in, loadable without PEFT.
    """

    #: ``none``: train every weight; ``lora``: adapters on a frozen base; ``qlora``: the same, base in 4 bits.
    #: A recipe without a ``peft`` section has ``none``; a written section must say which (None: not said),
    #: since a section of adapter settings without it would train every weight of the base.
    method: Literal["none", "lora", "qlora"] | None = None
    #: Adapter rank.
    r: int = 16
    #: LoRA alpha: the adapter's output is scaled by ``alpha / r``.
    alpha: float = 32.0
    #: Dropout on the adapter's input.
    dropout: float = 0.05
    #: Layers that get adapters: ``all-linear`` (every linear layer but the output head) or names.
    target_modules: str | list[str] = "all-linear"
    #: Modules trained in full and saved with the adapter (e.g. ``[lm_head]`` after adding tokens).
    modules_to_save: list[str] = field(default_factory=list)
    #: Also write ``final/merged``: the base model with the adapter folded in.
    merge: bool = False

    @property
    def enabled(self) -> bool:
        return self.method not in (None, "none")

    def validate(self) -> None:
        if self.method is None:
            raise ConfigError(
                "peft.method is not set: lora (adapters on the frozen base), qlora (the same, base in 4 bits, GPU) "
                "or none (train every weight; or remove the peft section)",
                key="peft",
            )
        if self.r < 1 or self.r > MAX_RANK:
            raise ConfigError(f"peft.r is {self.r}; the adapter rank must be between 1 and {MAX_RANK} (8 to 64 is usual)")
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

    #: Metric sinks: ``tensorboard`` (in OUTPUT_DIR/runs), ``wandb``; empty: none.
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=lambda: ["tensorboard"])
    #: Also report to Weights & Biases, in this project.
    wandb_project: str | None = None
    #: Run name in TensorBoard/W&B; None: the recipe's name.
    run_name: str | None = None
    #: Each rank logs its memory at every logging step.
    memory: bool = True
    #: Put ``[rank R host H]`` before every output line.
    rank_prefix: bool = True


@dataclass
class HubSettings:
    """Push the final model to the Hugging Face Hub (token from HF_TOKEN or `hf auth login`)."""

    #: Push the final model and tokenizer to this Hub repository when training ends; None: no push.
    repo_id: str | None = None
    #: Create the repository private.
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

    #: Ask at most N held-out examples; None: all of them.
    max_examples: int | None = None
    #: Longest answer generated.
    max_new_tokens: int = 32
    #: Prompts generated at once.
    batch_size: int = 64
    #: Evaluate the final model when training ends (rank 0, after the others finish): its accuracy goes to
    #: the job's log and OUTPUT_DIR/eval.json, so a job followed from a laptop ends with its score.
    after_training: bool = False

    def validate(self) -> None:
        for name in ("max_new_tokens", "batch_size", "max_examples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"eval.{name} is {value}; it must be at least 1")
        for name, most in (("max_new_tokens", MAX_LENGTH), ("batch_size", MAX_GLOBAL_BATCH)):
            if getattr(self, name) > most:
                raise ConfigError(f"eval.{name} is {getattr(self, name)}; at most {most}")


@dataclass
class Recipe:
    """A whole recipe file."""

    #: The run's name, which names its output directory; None: the recipe's file name without extension.
    name: str | None = None
    #: ``sft``: supervised fine-tuning (TRL's SFTTrainer); ``clm``: causal-LM pretraining on one text column.
    task: Literal["sft", "clm"] = "sft"
    #: Seeds model init, data order, the eval hold-out and builtin data.
    seed: int = 42
    #: The model to train.
    model: ModelSettings = field(default_factory=ModelSettings)
    #: Its tokenizer.
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    #: The training examples.
    data: DataSettings = field(default_factory=DataSettings)
    #: How to train.
    training: TrainingSettings = field(default_factory=TrainingSettings)
    #: Metric sinks and output lines.
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    #: Pushing the final model to the Hub.
    hub: HubSettings = field(default_factory=HubSettings)
    #: ``ctrain eval``.
    eval: EvalSettings = field(default_factory=EvalSettings)
    #: Switches of the fast engine (``training.engine: fast``).
    fast: FastSettings = field(default_factory=FastSettings)
    #: LoRA/QLoRA adapters instead of full training.
    peft: PeftSettings = field(default_factory=lambda: PeftSettings(method="none"))
    #: The file the recipe was read from (set by :func:`load_recipe`, not a key).
    path: Path | None = field(default=None, init=False, compare=False)

    def hf_engine_reason(self) -> str | None:
        """Why this recipe trains under transformers' Trainer on any device (None: ``training.engine:
        auto`` picks the fast engine where there is a GPU)."""
        training = self.training
        if training.engine != "auto":
            return "training.engine is hf" if training.engine == "hf" else None
        if self.task != "sft":
            return f"task {self.task} trains under transformers' Trainer"
        if not self.data.packing and self.fast.batching == "packed":
            return "data.packing is off (the fast engine packs, or set fast.batching)"
        for name in training.hf_speedups():
            return f"training.{name} is transformers' own speed-up"
        if self.peft.enabled and (training.fsdp or training.deepspeed):
            return "adapters on a sharded base (training.fsdp, training.deepspeed) train under transformers' Trainer"
        return None

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
        if self.eval.after_training:
            if self.task != "sft":
                raise ConfigError("eval.after_training asks held-out chats or prompt/completion examples: task clm "
                                  "trains on plain text; turn it off")  # fmt: skip
            if not (self.data.eval_split or self.data.eval_size):
                raise ConfigError("eval.after_training asks held-out examples: set data.eval_size or data.eval_split")
        if self.training.engine == "fast" and self.task != "sft":
            raise ConfigError("training.engine: fast is the SFT fast path; use engine hf (or auto) for task clm")
        if self.training.engine == "fast":
            for name in self.training.hf_speedups():
                raise ConfigError(
                    f"training.{name} is transformers' own speed-up and training.engine: fast already "
                    f"compiles its layers and fuses the loss: turn training.{name} off, or use engine hf"
                )
        self.fast.check_recompute(self.training.gradient_checkpointing)
        reason = self.hf_engine_reason()
        if self.fast.activation_memory_budget is not None and reason:
            raise ConfigError(
                f"fast.activation_memory_budget is a setting of the fast engine, and {reason}: nothing would be "
                "recomputed; remove it (or set it to null) and set training.gradient_checkpointing: true"
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

    def record(self) -> dict[str, Any]:
        """The recipe as run (overrides applied), without where its file was: what a run's
        ``recipe.yaml`` holds and what ``ctrain.train.rundir`` compares it with."""
        data = to_mapping(self)
        data.pop("path", None)
        return data

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.record(), sort_keys=False)


#: training.resume's words; anything else is a checkpoint directory.
RESUME_WORDS = ("auto", "continue", "never")

#: Recipe keys (sections, or section.key) a run may change between its starts without becoming
#: another run: where output goes and how often, logging, the hub, evaluation after training,
#: and speed settings that leave what is learned as it was. Every other key defines the run
#: (``ctrain.train.rundir``).
RUN_INDEPENDENT = frozenset({
    "name", "logging", "hub", "eval", "data.num_proc", "data.prepared_dir", "training.output_dir",
    "training.logging_steps", "training.save_steps", "training.save_total_limit", "training.save_async",
    "training.eval_steps",
    "training.resume", "training.preemption_signals", "training.dataloader_workers", "training.ddp_timeout_minutes",
    "training.peak_tflops", "fast.sync_metrics", "fast.gc_every", "fast.ddp_bucket_mb", "peft.merge",
    "model.save_dtype",
})  # fmt: skip


def check_max_length(max_length: int, positions: int | None, where: str) -> None:
    """The one rule, wherever the model's size is known (its overrides, its config file, the loaded
    config): a sequence must fit the model's positions."""
    if positions is not None and max_length > positions:
        raise ConfigError(
            f"data.max_length ({max_length}) is larger than the model's max_position_embeddings "
            f"({positions}, {where}): lower data.max_length"
        )


def check_rank(rank: int, hidden: int | None, where: str) -> None:
    """The one rule for a LoRA rank, wherever the model's width is known: at most its hidden size."""
    if hidden is not None and rank > hidden:
        raise ConfigError(
            f"peft.r ({rank}) is larger than the model's hidden size ({hidden}, {where}): an adapter of that rank "
            "is no low-rank update, only memory; lower peft.r (8 to 64 is usual)"
        )


def expand_path(value: str | Path) -> Path:
    """A recipe path with ``~`` and environment variables expanded."""
    return Path(os.path.expandvars(str(value))).expanduser()


_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def unset_variables(value: str | None) -> list[str]:
    """The variables VALUE names that this environment does not set: expand_path would leave them as
    text, and a directory made from it would be named ``$NAME``."""
    return sorted({a or b for a, b in _VARIABLE.findall(value or "") if (a or b) not in os.environ})


def signal_number(name: str) -> int:
    """``SIGUSR1`` (or ``USR1``) -> its number; a ConfigError for names that cannot be caught."""
    full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    if full in ("SIGKILL", "SIGSTOP") or full not in signal.Signals.__members__:  # not SIG_DFL, SIG_IGN
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
