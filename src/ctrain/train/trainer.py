"""``ctrain train``: check everything cheap first, then data, model, trainer, training, final model.

Launch-agnostic: one process, ``torchrun`` (DDP), ``accelerate launch`` and DeepSpeed/FSDP through
the Trainer all run :func:`run` unchanged; the launcher's environment (RANK, WORLD_SIZE, ...) says
which process this is. :func:`training_arguments` and :func:`build_trainer` are the one place the
trainer is put together, so ``training.engine`` can switch how.

Exit codes: 0 done (or already done), 75 (:data:`PREEMPTED_EXIT_CODE`) stopped on a preemption
signal after a complete checkpoint, 65 (:data:`NONFINITE_EXIT_CODE`) stopped at a NaN or infinite
loss or gradient norm before saving it, 2 recipe errors (nothing was trained or written).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ctrain import protocol
from ctrain.errors import ConfigError, CtrainError, DiskFull
from ctrain.files import atomic_write_json, atomic_write_text, check_tree, load_json_bounded, read_regular
from ctrain.settings import MAX_SETTINGS_BYTES
from ctrain.train import checkpoint, exits, goodput, health, logs, rundir
from ctrain.train.artifacts import (
    COMPLETE_MARKER,
    FINAL_DIR,
    MERGED_DIR,
    PREEMPTED_EXIT_CODE,
    PREVIOUS_FINAL_DIR,
    PREEMPTED_FILE,
    RECIPE_COPY,
    TENSORBOARD_DIR,
    WANDB_RUN_FILE,
)
from ctrain.train.layout import batch_layout
from ctrain.train.preflight import check_trainer_args, preflight, trainer_config_class
from ctrain.train.recipe import RESUME_WORDS, Recipe, expand_path, signal_number, unset_variables
from ctrain.train.script import close_process_group

log = logging.getLogger("ctrain.train")

PREPARED_KEY = "ctrain/prepared"
# Ranks other than 0 wait this long for rank 0 to prepare the data; the launcher ends them sooner
# if rank 0 fails, so this only bounds a hang.
PREPARE_WAIT = timedelta(days=2)
# Where each rank reports its progress for the job's hang watchdog (sbatch/lib/ctrain.sh sets it).


@dataclass
class Layout:
    """Where and how this process trains, decided before anything expensive happens."""

    rank: int
    world_size: int
    device_type: str
    precision: str  # bf16, fp16 or fp32
    engine: str  # hf or fast
    per_device_batch: int
    accumulation: int


def _precision(recipe: Recipe, device_type: str) -> str:
    import torch

    wanted = recipe.training.precision
    if wanted != "auto":
        if wanted in ("bf16", "fp16") and device_type != "cuda":
            raise ConfigError(f"training.precision: {wanted} needs a GPU; this process has none (use auto or fp32)")
        return wanted
    if device_type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def plan(recipe: Recipe) -> Layout:
    """Device, precision, engine and batch layout for this process (raises ConfigError on impossible ones)."""
    import torch

    rank, world = logs.rank_from_env(), logs.world_size_from_env()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    engine = recipe.training.engine
    if engine == "auto":
        # The fast path: SFT on a GPU, with the batches it is built for (packed unless told otherwise),
        # unless the recipe asks for transformers' own speed-ups instead (whole-model compile, Liger).
        engine = "fast" if device_type == "cuda" and recipe.hf_engine_reason() is None else "hf"
    # The fast path sizes micro-batches in tokens (fast.tokens_per_device): rows of max_length each.
    cap = recipe.fast.rows_per_device(recipe.data.max_length) if engine == "fast" else None
    per_device, accumulation = batch_layout(recipe.training, world, cap=cap)
    if recipe.training.fsdp and device_type != "cuda":
        raise ConfigError(
            "training.fsdp shards the model over GPUs and this process has none (use DDP or DeepSpeed on CPU)"
        )
    if engine == "fast" and recipe.fast.batching == "packed" and not recipe.data.packing:
        raise ConfigError("fast.batching: packed needs data.packing: true (or set fast.batching: padded)")
    if recipe.peft.enabled:
        _check_peft(recipe, device_type)
    if engine == "hf" and recipe.fast.activation_memory_budget is not None:
        # The budget stands in for checkpointing: under transformers' Trainer it would run out of memory.
        raise ConfigError(
            f"fast.activation_memory_budget needs the fast engine, which trains on GPUs, and this process has "
            f"none ({device_type}): remove it and set training.gradient_checkpointing: true to train here"
        )
    from transformers.training_args import OptimizerNames

    optimizers = [o.value for o in OptimizerNames]
    if recipe.training.optim not in ("auto", *optimizers):
        raise ConfigError(f"training.optim is {recipe.training.optim!r}; valid: auto, {', '.join(optimizers)}")
    return Layout(rank, world, device_type, _precision(recipe, device_type), engine, per_device, accumulation)


def _check_peft(recipe: Recipe, device_type: str) -> None:
    """The packages and the device adapters need, before the process group or the model."""
    import importlib.util

    method = recipe.peft.method
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"peft.method: {method} trains adapters with PEFT, which is not installed (pip install peft)")
    if method != "qlora":
        return
    if device_type != "cuda":
        raise ConfigError(
            "peft.method: qlora loads the base model in 4 bits with bitsandbytes, which needs a GPU, and this "
            "process has none: use peft.method: lora"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "peft.method: qlora needs bitsandbytes, which is not installed (pip install bitsandbytes), or use "
            "peft.method: lora"
        )


def _report_to(recipe: Recipe) -> list[str]:
    """The metric sinks, each imported here, so that one that is not installed, or does not import, is one
    line before the run starts instead of a traceback in the trainer's first log."""
    import importlib
    import importlib.util

    targets = list(dict.fromkeys(recipe.logging.report_to + (["wandb"] if recipe.logging.wandb_project else [])))
    for target in targets:
        if target == "tensorboard" and importlib.util.find_spec("tensorboardX"):
            continue
        try:
            importlib.import_module("torch.utils.tensorboard" if target == "tensorboard" else target)
        except ModuleNotFoundError as exc:
            if exc.name not in (target, "tensorboard"):
                raise ConfigError(f"logging.report_to includes {target}, which does not import here ({exc}): "
                                  f"reinstall it (pip install {target})") from None  # fmt: skip
            raise ConfigError(f"logging.report_to includes {target}, which is not installed (pip install {target})") \
                from None  # fmt: skip
        except ImportError as exc:
            raise ConfigError(f"logging.report_to includes {target}, which does not import here ({exc}): "
                              f"reinstall it (pip install {target})") from None  # fmt: skip
    if recipe.logging.wandb_project:
        os.environ.setdefault("WANDB_PROJECT", recipe.logging.wandb_project)
    return targets


_WANDB_ID = re.compile(r"[a-z0-9]{8,64}")


def one_logged_run(report_to: list[str], output_dir: Path, resume: str | None) -> None:
    """One TensorBoard and W&B run per training, however often it is requeued or continued (rank 0, which
    logs): TensorBoard's events in OUTPUT_DIR/runs, not a directory per start; the W&B run's id kept in
    OUTPUT_DIR/wandb-run-id and resumed when the training resumes from a checkpoint (a training started
    afresh gets a new one). A sweep's tasks are grouped by their sweep and named by their values.
    What the user set (WANDB_RUN_ID, TENSORBOARD_LOGGING_DIR, ...) wins."""
    if "tensorboard" in report_to:
        os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(output_dir / TENSORBOARD_DIR))
    if "wandb" not in report_to:
        return
    path = output_dir / WANDB_RUN_FILE
    run_id = None
    if resume is not None and path.is_file():
        try:
            kept = read_regular(path, 128).decode(errors="replace").strip()
        except OSError:
            kept = ""
        run_id = kept if _WANDB_ID.fullmatch(kept) else None
    if run_id is None:
        import uuid

        run_id = uuid.uuid4().hex[:16]
        atomic_write_text(path, run_id + "\n")
    os.environ.setdefault("WANDB_RUN_ID", run_id)
    os.environ.setdefault("WANDB_RESUME", "allow")
    if os.environ.get("CTRAIN_SWEEP"):
        os.environ.setdefault("WANDB_RUN_GROUP", Path(os.environ["CTRAIN_SWEEP"]).stem)


def _check_hub(recipe: Recipe) -> None:
    if not recipe.hub.repo_id:
        return
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"hub.repo_id is {recipe.hub.repo_id} but HF_HUB_OFFLINE is set: unset hub.repo_id to train offline "
            "(jobs run offline unless slurm.hf_offline is false, for nodes that reach the hub)"
        )
    if not get_token():
        raise ConfigError(
            f"hub.repo_id is {recipe.hub.repo_id} but no Hugging Face token is configured: set HF_TOKEN "
            "(or run `hf auth login`) before training"
        )


def training_arguments(recipe: Recipe, layout: Layout, output_dir: Path, report_to: list[str]) -> Any:
    """The TrainingArguments (SFTConfig for sft) of this run. Creating them starts the process group."""
    kwargs = argument_values(recipe, layout, output_dir, report_to)
    extra = recipe.training.trainer_args
    clash = sorted(set(extra) & set(kwargs))
    if clash:
        engine = " (the fast engine sets it; see fast.*)" if layout.engine == "fast" else ""
        raise ConfigError(f"training.trainer_args.{clash[0]} is set by ctrain itself{engine}; remove it")
    config = trainer_config_class(recipe.task)
    check_trainer_args(extra, config)
    return config(**kwargs, **extra)


def argument_values(recipe: Recipe, layout: Layout, output_dir: Path, report_to: list[str]) -> dict[str, Any]:
    """What ctrain sets in the run's TrainingArguments / SFTConfig (:data:`recipe.OWNED_ARGS` names them)."""
    training = recipe.training
    optim = training.optim
    if optim == "auto":
        optim = "adamw_torch_fused" if layout.device_type == "cuda" else "adamw_torch"
    workers = training.dataloader_workers
    if workers is None:
        workers = 2 if layout.device_type == "cuda" else 0
    has_eval = bool(recipe.data.eval_split or recipe.data.eval_size)
    kwargs: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": layout.per_device_batch,
        "per_device_eval_batch_size": layout.per_device_batch,
        "gradient_accumulation_steps": layout.accumulation,
        "max_steps": training.max_steps or -1,
        "num_train_epochs": training.epochs,
        "learning_rate": training.learning_rate,
        "lr_scheduler_type": training.lr_scheduler,
        "warmup_steps": training.warmup,
        "weight_decay": training.weight_decay,
        "max_grad_norm": training.max_grad_norm,
        "optim": optim,
        "bf16": layout.precision == "bf16",
        "fp16": layout.precision == "fp16",
        "use_cpu": layout.device_type == "cpu",
        "activation_checkpointing": training.gradient_checkpointing,
        "torch_compile": training.torch_compile,
        "use_liger_kernel": training.liger_kernel,
        "logging_strategy": "steps",
        "logging_steps": training.logging_steps,
        "logging_first_step": True,
        # The filter replaces a NaN loss by the running mean (and reads the loss back every step):
        # ctrain stops at a NaN instead (callbacks.FiniteGuard), so it must see it.
        "logging_nan_inf_filter": False,
        "save_strategy": "steps",
        "save_steps": training.save_steps,
        "save_total_limit": None,  # ctrain rotates complete checkpoints only (callbacks.CompleteCheckpoints)
        "eval_strategy": "steps" if training.eval_steps and has_eval else "no",
        "eval_steps": training.eval_steps,
        "report_to": report_to or "none",
        # A sweep's task is named by its values (CTRAIN_SWEEP_NAME, from its line of the sweep's table).
        "run_name": recipe.logging.run_name or "/".join(filter(None, [recipe.run_name,
                                                                      os.environ.get("CTRAIN_SWEEP_NAME")])),  # fmt: skip
        "seed": recipe.seed,
        "deepspeed": str(expand_path(training.deepspeed)) if training.deepspeed else None,
        "fsdp": training.fsdp,
        "fsdp_config": training.fsdp_settings() if training.fsdp else None,
        "dataloader_num_workers": workers,
        "ddp_timeout": training.ddp_timeout_minutes * 60,
        "ddp_find_unused_parameters": False,
        "include_num_input_tokens_seen": "non_padding",
        "disable_tqdm": True,  # ctrain prints one line per logging step (callbacks.Progress)
        "remove_unused_columns": False,
        "push_to_hub": False,  # ctrain pushes the final model itself, once (hub.repo_id)
    }
    if training.fsdp:
        # Reduce-scatter each micro-batch's gradients into the shards: waiting until the last one
        # would keep a whole unsharded float32 gradient on every GPU (32 GB for an 8B model).
        kwargs["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    if recipe.task == "clm":
        return kwargs
    kwargs.update(
        max_length=recipe.data.max_length,
        packing=recipe.data.packing,
        padding_free=recipe.data.packing,
        dataset_kwargs={"skip_prepare_dataset": True},  # ctrain.train.data prepared it
        assistant_only_loss=False,  # labels already carry it
        completion_only_loss=False,
    )
    if layout.engine == "fast":
        from ctrain.fast import sft_overrides

        kwargs.update(sft_overrides(recipe.fast, layout.device_type), dataloader_persistent_workers=workers > 0)
        if recipe.fast.batching == "padding_free" and not recipe.data.packing:
            # TRL cannot enforce max_length on unpacked padding-free batches; ctrain.train.data truncated them.
            kwargs["max_length"] = None
    return kwargs


def build_trainer(recipe: Recipe, layout: Layout, args: Any, model: Any, data: Any, callbacks: list[Any]) -> Any:
    """The Trainer for the recipe's task and engine: TRL's SFTTrainer (sft) or transformers' Trainer (clm)."""
    if layout.engine == "fast":
        from ctrain.fast import prepare_model

        model = prepare_model(model, recipe.fast, layout.device_type, recipe.training.gradient_checkpointing)
    common = {
        "model": model,
        "args": args,
        "train_dataset": data.train,
        "eval_dataset": data.eval if args.eval_strategy != "no" else None,
        "processing_class": data.tokenizer,
        "callbacks": callbacks,
    }
    from ctrain.train.asyncsave import AsyncSaves

    if layout.engine == "fast":
        from ctrain.fast import trainer as fast_trainer

        return fast_trainer.build(recipe.fast, mixins=(AsyncSaves,), **common)
    if recipe.task == "sft":
        from trl import SFTTrainer

        return _with(AsyncSaves, SFTTrainer)(**common)
    from transformers import Trainer, default_data_collator

    return _with(AsyncSaves, Trainer)(data_collator=default_data_collator, **common)


@functools.cache
def _with(mixin: type, base: type) -> type:
    """``base`` with ``mixin``'s methods in front of its own, made once per pair."""
    return type(base.__name__, (mixin, base), {"__doc__": base.__doc__})


# --- data on every rank ---------------------------------------------------------------------------


def _store() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def obtain_data(recipe: Recipe, layout: Layout) -> Any:
    """The prepared data set: rank 0 prepares it if needed while the other ranks wait, then all load it.

    The others wait on the rendezvous store, not in a collective, so a long tokenization cannot
    trip the NCCL timeout.
    """
    from ctrain.train import data

    if recipe.data.streaming:
        return data.streamed(recipe)
    directory = recipe.prepared_dir
    store = _store() if layout.world_size > 1 else None
    if layout.rank == 0:
        try:
            if data.usable_prepared(recipe, directory) is None:
                log.info("no prepared data in %s: preparing it now (other ranks wait)", directory)
                data.prepare(recipe, directory)
            else:
                log.info("using prepared data in %s", directory)
        except BaseException:
            if store is not None:
                store.set(PREPARED_KEY, "failed")
            raise
        if store is not None:
            store.set(PREPARED_KEY, "ready")
    elif store is not None:
        store.wait([PREPARED_KEY], PREPARE_WAIT)
        if store.get(PREPARED_KEY) != b"ready":
            raise CtrainError("rank 0 could not prepare the data; its error is in the log above")
    else:
        from ctrain.train.callbacks import barrier

        barrier()
    return data.load_prepared(recipe, directory)


# --- resume ---------------------------------------------------------------------------------------


def resume_point(recipe: Recipe, output_dir: Path, rank: int, world: int = 1) -> str | None:
    """The checkpoint to resume from (``training.resume``): auto picks the newest one that verifies.

    Every rank calls it and gets the same answer: the ranks verify the files together, and only
    rank 0 removes torn checkpoints and moves damaged ones aside (checkpoint.choose).
    """
    from ctrain.train.callbacks import barrier

    setting = recipe.training.resume
    if setting == "never":
        return None
    if setting not in RESUME_WORDS:
        path = expand_path(setting)
        if checkpoint.read_marker(path) is None:
            raise ConfigError(f"training.resume: {path} is not a complete checkpoint (no ctrain-complete.json)")
        verdict = checkpoint.verify(path, rank, world)
        if verdict.damage is not None:
            raise ConfigError(
                f"training.resume: {path} is damaged ({verdict.damage}); point it at another checkpoint "
                "(or set training.resume: auto to take the newest intact one in the output directory)"
            )
        if rank == 0:
            log.info("resuming from %s (%s)", path, verdict.summary())
        return str(path)
    found = checkpoint.scan(output_dir)
    if rank == 0:
        for line in checkpoint.explain(found):
            log.info(line)
        checkpoint.remove(found.torn)
    barrier()
    chosen = checkpoint.choose(found, rank, world)
    return str(chosen) if chosen else None


# --- the run --------------------------------------------------------------------------------------


def _push(recipe: Recipe, final: Path) -> None:
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(recipe.hub.repo_id, private=recipe.hub.private, exist_ok=True)
    api.upload_folder(repo_id=recipe.hub.repo_id, folder_path=str(final), commit_message=f"ctrain: {recipe.run_name}")
    log.info("pushed the final model to https://huggingface.co/%s", recipe.hub.repo_id)


def openmp_defaults() -> None:
    """Let idle OpenMP threads sleep instead of spin, unless OMP_WAIT_POLICY says otherwise.

    On a CPU shared with other work (a login or CI machine, or more threads than cores) spinning
    threads take the cores the working ones need, and small CPU models train several times slower
    (docs/benchmarks.md). Takes effect only before torch is first imported.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _release_training_memory(trainer: Any) -> None:
    """Give back the optimizer's state and the gradients once training is over. The model itself
    stays (:func:`logs.keep_until_exit`: freeing a DDP model can deadlock with gloo's threads)."""
    import gc

    import torch

    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()
    trainer.model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def whole_final_model(trainer: Any) -> None:
    """Under FSDP, save the final model as one Hugging Face checkpoint (gathered on rank 0), as
    ``from_pretrained`` and ``ctrain eval`` read it; the checkpoints during training stay sharded."""
    from ctrain.fast.trainer import fsdp_plugin

    plugin = fsdp_plugin(trainer)
    if plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        plugin.set_state_dict_type("FULL_STATE_DICT")


def _check_memory(recipe: Recipe, config: Any, layout: Layout, device: Any) -> None:
    """A full fine-tune's floor of GPU memory against this GPU's (:func:`ctrain.train.model.check_fits`).
    Every rank checks its own GPU's total, not its free memory (the preflight's business), so all
    ranks of a job on one kind of GPU decide alike."""
    import torch

    from ctrain.train.model import check_fits, count_parameters

    count = count_parameters(recipe, config)
    if count is None:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    line = check_fits(recipe, count, layout.precision, layout.world_size, total, torch.cuda.get_device_name(device))
    if layout.rank == 0:
        log.info("%s", line)


def save_final_model(trainer: Any, final: Path, dtype: Any, adapters: bool) -> None:
    """Save the trained model (or adapter) to ``final``, a full model's weights in ``dtype``.

    The Trainer gathers the weights one way under DDP, another under FSDP or DeepSpeed, and every
    way ends in ``_save(output_dir, state_dict)``: the cast goes there, one tensor at a time (the
    float32 copy of each is freed as its cast is made, so rank 0 never holds both whole), tied
    tensors cast once so that they stay tied. An adapter is saved as it trained.
    """
    whole_final_model(trainer)
    if adapters:
        trainer.save_model(str(final))
        return
    original = trainer._save

    def cast_save(output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        if trainer.args.should_save:
            if state_dict is None:
                state_dict = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False).state_dict()
            made: dict[tuple[Any, ...], Any] = {}
            for name in list(state_dict):
                tensor = state_dict[name]
                if tensor.is_floating_point() and tensor.dtype != dtype:
                    key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
                    if key not in made:
                        made[key] = tensor.to(device="cpu", dtype=dtype)
                    state_dict[name] = made[key]
                del tensor
        original(output_dir, state_dict)

    trainer._save = cast_save
    try:
        trainer.save_model(str(final))
    finally:
        del trainer._save
    config = final / "config.json"
    if trainer.args.should_save and config.is_file():
        # save_pretrained names the dtype of the model in memory (the float32 masters): name the saved one.
        values = load_json_bounded(config, MAX_SETTINGS_BYTES, "the saved model's config")
        values["dtype"] = str(dtype).removeprefix("torch.")
        atomic_write_text(config, json.dumps(values, indent=2, sort_keys=True) + "\n")


@contextmanager
def _full_disk_ends_the_run(recipe: Recipe, final: Path, rank: int) -> Iterator[None]:
    """A save that fills training.output_dir's file system ends the run with one ``error:`` line
    saying so and what to do (torch's own message for it is ``unexpected pos``), the unfinished
    checkpoint removed so that its space is free again; the complete checkpoints stay, and the next
    run resumes from the newest. The cause is ``disk-full``: a requeue would fill the same disk."""
    try:
        yield
    except CtrainError:
        raise
    except Exception as exc:
        output_dir = recipe.output_dir
        if not checkpoint.out_of_space(exc, output_dir):
            raise
        full = checkpoint.full_disk(output_dir)  # before the removal frees space
        removed = checkpoint.discard_unfinished(output_dir, final) if rank == 0 else []
        latest = checkpoint.scan(output_dir).latest
        raise DiskFull(
            f"{full} and a save failed ({exits.one_line(f'{type(exc).__name__}: {exc}')}); "
            + (f"removed the unfinished {', '.join(p.name for p in removed)}; " if removed else "")
            + (f"{latest.name} is the newest complete checkpoint. " if latest else "no checkpoint is complete yet. ")
            + "Free space there, keep fewer checkpoints (training.save_total_limit, now "
            f"{recipe.training.save_total_limit}) or set training.output_dir on another file system, then run "
            "the same command again" + (f": it resumes from {latest.name}" if latest else "")
        ) from exc


def run(recipe: Recipe) -> int:
    """Train the recipe in this process (one of the launcher's processes); returns the exit code."""
    openmp_defaults()
    logs.setup(prefix=recipe.logging.rank_prefix)
    rank, world = logs.rank_from_env(), logs.world_size_from_env()
    if rank == 0:
        goodput.mark("process")
    # 0. The node's driver against the image's CUDA, before anything imports torch (the preflight).
    checks = health.level_from_env()
    nccl_logs = False
    if checks != "off":
        health.check_driver(log)
        if world > 1:
            nccl_logs = health.ask_nccl_for_its_transports(health.pids_dir())
    # 1. What can be checked without torch: paths, columns, sizes, the batch against the world size.
    notes = preflight(recipe, world_size=world)
    for key, value in (("training.output_dir", recipe.training.output_dir),
                       ("data.prepared_dir", recipe.data.prepared_dir)):  # fmt: skip
        unset = unset_variables(value)
        if unset:
            raise ConfigError(f"{key} {value} names {', '.join('$' + n for n in unset)}, which this job's environment "
                              "does not set: set it, or write the path out")  # fmt: skip
    output_dir = recipe.output_dir
    final = output_dir / FINAL_DIR
    # Every rank reads the record before rank 0 rewrites it (after resume_point's barrier).
    changed = rundir.check(output_dir, recipe)
    if changed and rank == 0:
        log.info("the run in %s had other settings (training.resume: %s): %s", output_dir, recipe.training.resume,
                 "; ".join(changed))  # fmt: skip
    if checkpoint.read_marker(final) is not None and not changed:
        if rank == 0:
            log.info(
                "%s is complete: this run already finished; nothing to do (use another training.output_dir to train again)",
                final,
            )
        return 0
    # A run as another user (root in a container) leaves the directory to it: say so before any work.
    check_tree(output_dir, "training.output_dir", "set training.output_dir to a directory you can write",
               skip=[recipe.prepared_dir])  # fmt: skip
    for directory in (final, recipe.prepared_dir):
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"{directory} is a file where ctrain keeps a directory: move it away")
    rundir.check_owned(output_dir, recipe.prepared_dir)
    if rank == 0 and not recipe.data.streaming:
        from ctrain.train import data

        if data.prepared_info(recipe, recipe.prepared_dir) is None:
            data.check_target(recipe.prepared_dir)
            data.check_cache(recipe)
    if rank == 0:
        for note in notes:
            log.info("note: %s", note)
    # 2. With the training stack: device, precision, the model's config, reporting, the hub.
    from transformers import PrinterCallback, set_seed

    from ctrain.train.asyncsave import Writer, attach
    from ctrain.train.callbacks import (
        AlreadyTrained,
        CompleteCheckpoints,
        FiniteGuard,
        Heartbeat,
        Preemption,
        Progress,
        StopAtMaxSteps,
        barrier,
        peak_tflops,
    )
    from ctrain.train.model import (
        add_adapters,
        build_model,
        check_adapters,
        check_sizes,
        final_dtype,
        load_config,
        merge_adapters,
    )

    logs.quiet_libraries()
    layout = plan(recipe)
    config = load_config(recipe)
    check_sizes(recipe, config)
    saved_dtype = final_dtype(recipe, config, layout.precision)
    if recipe.peft.enabled:
        check_adapters(recipe, config)
    report_to = _report_to(recipe)
    _check_hub(recipe)
    signals = [signal_number(name) for name in recipe.training.preemption_signals]
    # 3. The process group starts here; then data (rank 0 first), the model, the trainer.
    args = training_arguments(recipe, layout, output_dir, report_to)
    if checks != "off":
        summary = health.rank_checks(checks, args.device, log, nccl_logs=nccl_logs)
        if rank == 0:
            goodput.mark("checked", summary["seconds"])
    if layout.device_type == "cuda" and not recipe.peft.enabled and not recipe.training.deepspeed:
        _check_memory(recipe, config, layout, args.device)
    data = obtain_data(recipe, layout)
    if rank == 0:
        goodput.mark("data")
    logs.rebind_handlers()
    set_seed(recipe.seed)  # a new model's weights: the same on every rank and every world size
    # Sharded over GPUs, each rank makes (or reads) the weights on its own GPU, which FSDP then
    # shards there: the node's host memory does not grow with its GPU count.
    place = args.device if recipe.training.fsdp else None
    model = build_model(recipe, config, data.tokenizer, layout.precision, layout.device_type, place)
    if recipe.peft.enabled:
        model = add_adapters(recipe, model)
    resume = resume_point(recipe, output_dir, rank, world)
    run_id = time.strftime("%Y%m%dT%H%M%S")
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RECIPE_COPY).write_text(recipe.to_yaml())
        (output_dir / PREEMPTED_FILE).unlink(missing_ok=True)
        if checkpoint.read_marker(final) is not None:  # finished before, continued with other settings
            previous = output_dir / PREVIOUS_FINAL_DIR
            log.info("the final model of the run before is kept in %s", previous)
            checkpoint.remove([previous])
            final.rename(previous)
        elif final.exists():
            log.info("removing %s: it has no %s (the run stopped while saving it); it is saved again", final,
                     COMPLETE_MARKER)  # fmt: skip
            checkpoint.remove([final])
        one_logged_run(report_to, output_dir, resume)
    preemption = Preemption(signals, args.device)
    writer = Writer()
    callbacks = [
        CompleteCheckpoints(output_dir, recipe.training.save_total_limit, world, writer),
        preemption,
        StopAtMaxSteps(),
        FiniteGuard(check_grad_norm=layout.precision != "fp16"),  # last: after every callback that asks to save
    ]
    heartbeat = None
    beats = protocol.heartbeats_dir()  # set by the sbatch scripts, whose watchdog reads it
    if beats is not None:
        heartbeat = Heartbeat(beats, rank)
        callbacks.append(heartbeat)
    trainer = build_trainer(recipe, layout, args, model, data, callbacks)
    blocking = attach(trainer, writer) if recipe.training.save_async else "training.save_async is false"
    if rank == 0 and blocking is not None:
        log.info("checkpoints are written with training stopped: %s", blocking)
    logs.keep_until_exit(trainer)  # never freed: the process ends through os._exit (see keep_until_exit)
    progress = Progress(
        output_dir, world, rank, peak_tflops(recipe.training.peak_tflops), recipe.logging.memory, run_id
    )
    # First in line, so what it adds to the logs reaches TensorBoard and W&B; it also replaces the
    # Trainer's printing of raw log dictionaries.
    trainer.callback_handler.callbacks.insert(0, progress)
    trainer.remove_callback(PrinterCallback)
    if rank == 0:
        log.info(
            "training %s (%s, engine %s, %s) on %d process(es), %s, %s: global batch %d = %d per device x %d "
            "accumulation x %d; output %s",
            recipe.run_name, recipe.task, layout.engine, trainer.accelerator.distributed_type.value, world,
            layout.device_type, layout.precision, recipe.training.global_batch_size, layout.per_device_batch,
            layout.accumulation, world, output_dir,
        )  # fmt: skip
    logs.rebind_handlers()
    with _full_disk_ends_the_run(recipe, final, rank):
        try:
            trainer.train(resume_from_checkpoint=resume)
        except AlreadyTrained as done:
            if rank == 0:
                log.info("%s is at step %d of %d: nothing left to train; saving the final model from it",
                         resume, done.step, trainer.state.max_steps)  # fmt: skip
        finally:
            preemption.restore()
        stopped = preemption.stopped_at
        if stopped is not None and trainer.state.global_step < trainer.state.max_steps:
            if rank == 0:
                atomic_write_json(
                    output_dir / PREEMPTED_FILE,
                    {
                        "step": stopped,
                        "checkpoint": str(output_dir / f"checkpoint-{stopped}"),
                        "signal": signal.Signals(preemption.signal).name if preemption.signal else None,
                        "exit_code": PREEMPTED_EXIT_CODE,
                    },
                )
                log.info("stopped at step %d on a preemption signal; exit %d: requeue to resume",
                         stopped, PREEMPTED_EXIT_CODE)  # fmt: skip
            barrier()  # the launcher may end every rank once one exits non-zero: rank 0 has written first
            close_process_group(PREEMPTED_EXIT_CODE)
            return PREEMPTED_EXIT_CODE
        save_final_model(trainer, final, saved_dtype, recipe.peft.enabled)
        barrier()
        if rank == 0:
            (final / RECIPE_COPY).write_text(recipe.to_yaml())
            if recipe.peft.merge:
                log.info("merging the adapter into the base model: %s", final / MERGED_DIR)
                merge_adapters(recipe, final, final / MERGED_DIR, saved_dtype)
        barrier()
        damage = checkpoint.seal(final, {"step": trainer.state.global_step, "world_size": world}, rank, world)
        if damage is not None:
            raise CtrainError(f"the final model in {final} cannot be read back ({damage}); it is not marked complete")
    if rank == 0:
        goodput.mark("end", trainer.state.global_step)
        what = "adapter" if recipe.peft.enabled else "model"
        log.info("saved the final %s and tokenizer to %s", what, final)
        if recipe.hub.repo_id:
            _push(recipe, final)
    close_process_group()
    if rank == 0 and recipe.eval.after_training:
        from ctrain.train.evaluate import evaluate, summary

        step = trainer.state.global_step
        _release_training_memory(trainer)  # the evaluation loads the saved model
        log.info("evaluating the final %s on the held-out examples (eval.after_training)",
                 "adapter" if recipe.peft.enabled else "model")  # fmt: skip
        beat = None if heartbeat is None else (lambda: heartbeat.beat(step))
        started = time.perf_counter()
        log.info("%s", summary(evaluate(recipe, final, on_batch=beat)))
        goodput.mark("eval", f"{time.perf_counter() - started:.3f}")
    if rank == 0:
        _log_goodput()
    if heartbeat is not None:
        heartbeat.done()
    return 0


def _log_goodput() -> None:
    """At the end of a run that finished, the job's account so far (`ctrain report JOB` has it all)."""
    timeline = protocol.timeline_path()
    if timeline is None:
        return
    try:
        _, lines = goodput.report(timeline, os.environ.get(protocol.JOB_ID_ENV, "?"), now=time.time())
    except (CtrainError, OSError) as exc:
        log.info("goodput: no account of the job's time (%s)", exc)
        return
    for line in lines:
        log.info("%s", line)
