"""Run one benchmark case in this process: build the trainer, train a few steps, time the steady state.

``seeds`` is TRL's ``SFTTrainer`` with the seeds' settings. The ``ctrain`` cases are what
``ctrain train`` runs: a recipe (engine fast), :func:`ctrain.train.trainer.plan`,
:func:`~ctrain.train.trainer.training_arguments` and :func:`~ctrain.train.trainer.build_trainer`
over the same data prepared the way :mod:`ctrain.train.data` prepares it. Both start from the
same model init. Tokens are the trainer's own count of non-padding input tokens, summed over ranks.

The LoRA cases train adapters on a frozen Llama-3.1-8B-shaped base (:data:`~ctrain.bench.spec.LLAMA_8B`,
random weights made on the GPU in bf16): TRL + PEFT with the seeds' settings, the strongest plain
TRL + PEFT setup, TRL's QLoRA, and a shipped ctrain LoRA recipe as ``ctrain train`` runs it.

The ``sft8b`` cases train every weight of the same shape in 4096-token rows
(:data:`~ctrain.bench.spec.LLAMA_8B_4K`), sharded over the GPUs of a ``--gpus`` sweep: TRL with
the seeds' settings under DeepSpeed ZeRO-3, the strongest plain TRL + FSDP2 setup, and
``recipes/llama-3.1-8b-sft.yaml`` as ``ctrain train`` runs it (FSDP2 on the fast engine).
"""

from __future__ import annotations

import functools
import gc
import gzip
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctrain import resources
from ctrain.bench import data
from ctrain.bench.spec import FULL, LLAMA_8B, LLAMA_8B_4K, PEAK_FLOPS, BenchSpec
from ctrain.errors import CtrainError
from ctrain.fast import FastSettings

# The adapters of every LoRA case: rank 16, alpha 32, dropout 0.05 (TRL's and ctrain's defaults)
# on all seven projections of every layer, which is what ``all-linear`` picks on a Llama.
LORA_R, LORA_ALPHA, LORA_DROPOUT = 16, 32, 0.05
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Lora:
    """TRL + PEFT adapters. ``tuned``: the strongest plain TRL setup (best-fit packing passed
    padding-free, Liger's kernels where installed, the best attention there) instead of the seeds'
    settings, ``rows`` packed 2048-token rows per micro-batch and ``accumulation`` micro-batches per
    step; ``four_bit``: QLoRA's base (nf4, double quantisation, bf16 compute)."""

    tuned: bool = False
    four_bit: bool = False
    rows: int = 9
    accumulation: int = 1
    # Without it the activations PEFT saves take ~6 MB per token of an 8B base (3 rows of 2048
    # tokens peak at 55 GiB with the 16 GB base): 9 rows do not fit 80 GB in one micro-batch.
    checkpointing: bool = False


@dataclass(frozen=True)
class Full:
    """TRL full fine-tuning of a model sharded over the GPUs: ``zero3`` (DeepSpeed with
    configs/deepspeed/zero3.json, the seeds' recipe) or ``fsdp`` (FSDP2 through accelerate, each
    decoder layer a unit). ``tuned``: the strongest plain TRL setup (best-fit packing passed
    padding-free, Liger's kernels where installed, the best attention there) instead of the seeds'
    padded batches; ``rows`` per micro-batch; ``checkpointing``: recompute every layer (FSDP's own
    activation checkpointing under fsdp, TRL's gradient checkpointing under zero3)."""

    sharding: str = "zero3"
    tuned: bool = False
    rows: int = 2
    checkpointing: bool = True
    # Liger's layer kernels in a tuned case, where installed.
    liger: bool = True


@dataclass(frozen=True)
class Case:
    """One configuration to measure: ctrain's fast engine (``fast``), a shipped ctrain recipe run
    as ``ctrain train`` runs it (``recipe``), TRL + PEFT (``lora``), else TRL with the seeds' settings."""

    name: str
    fast: FastSettings | None = None
    # Log the loss at every step (for the loss-curve comparison) instead of TRL's default interval.
    log_every_step: bool = False
    description: str = ""
    # Diagnostic only (the model does not train correctly): DDP skips the gradient all-reduce, so
    # the difference to the same case with it is what the communication costs.
    skip_allreduce: bool = False
    # The model shape (``--tiny`` replaces it).
    spec: BenchSpec = FULL
    lora: Lora | None = None
    # A file under recipes/ whose training and peft settings the case runs, and overrides of its keys.
    recipe: str | None = None
    overrides: tuple[str, ...] = ()
    # The case the table's ratio is taken against.
    baseline: str = "seeds"
    full: Full | None = None
    # A recipe case's global batch as rows per GPU (None: the recipe's): one micro-batch a step,
    # as a TRL case with that many rows takes it, so both see the same batches.
    rows_per_gpu: int | None = None

    @property
    def adapters(self) -> bool:
        """Whether the base is frozen and only adapters train."""
        return self.lora is not None or (self.recipe is not None and shipped(self).peft.enabled)


@functools.cache
def shipped(case: Case) -> Any:
    """The recipe a recipe case names, with its overrides, as shipped (``shipped_bench_recipe`` adapts a copy)."""
    from ctrain.train.recipe import load_recipe

    assert case.recipe is not None
    return load_recipe(resources.path("recipes", case.recipe), case.overrides)


def cannot_run(case: Case, cuda: bool) -> str | None:
    """Why ``case`` cannot run on this device, or None: said by ``ctrain bench`` before it starts a
    process for the case, and by :func:`run_case` when called directly."""
    if case.lora is not None and case.lora.four_bit and not cuda:
        return f"{case.name} quantises the base with bitsandbytes, which needs a GPU"
    if (case.full is not None or (case.recipe is not None and shipped(case).training.fsdp)) and not cuda:
        return f"{case.name} shards the model over GPUs (ZeRO-3 or FSDP), which needs them"
    return None


SFT_8B = "llama-3.1-8b-sft.yaml"
# The recipe on sft8b-trl-best's batches and schedule: the Trainer's row order, TRL's learning rate.
SAME_BATCHES = ("fast.balance_ranks=false", "training.learning_rate=2e-5", "training.lr_scheduler=linear",
                "training.warmup=0")  # fmt: skip


def _sft8b(name: str, description: str, **fields: Any) -> Case:
    """A full fine-tuning case of the 8B shape in 4096-token rows, measured against sft8b-trl-best."""
    return Case(name, spec=LLAMA_8B_4K, baseline="sft8b-trl-best", log_every_step=True,
                description=f"8B full SFT: {description}", **fields)  # fmt: skip


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("seeds", None, log_every_step=True, description="TRL SFTTrainer, seeds' settings (padded batches)"),
        Case(
            "ctrain-same-batches",
            FastSettings(batching="padding_free"),
            log_every_step=True,
            description="fast kernels on the seeds' exact batches (loss check)",
        ),
        Case("ctrain", FastSettings(), description="ctrain default: packed 32k tokens/device, varlen, compiled"),
        Case("ctrain-16k", FastSettings(tokens_per_device=16384), description="ctrain, 16k tokens (8 rows)/device"),
        Case("ctrain-eager", FastSettings(compile="off"), description="ctrain default without torch.compile"),
        Case(
            "ctrain-sync",
            FastSettings(sync_metrics=True, gc_every=0),
            description="ctrain default with TRL's per-step metric syncs and automatic GC",
        ),
        Case(
            "ctrain-unbalanced",
            FastSettings(balance_ranks=False),
            description="ctrain default, rows dealt to ranks in plain random order",
        ),
        Case(
            "ctrain-bucket25",
            FastSettings(ddp_bucket_mb=25),
            description="ctrain default with PyTorch's 25 MB DDP buckets",
        ),
        Case(
            "ctrain-bucket200",
            FastSettings(ddp_bucket_mb=200),
            description="ctrain default with 200 MB DDP buckets",
        ),
        Case(
            "ctrain-no-allreduce",
            FastSettings(),
            skip_allreduce=True,
            description="diagnostic: DDP without its gradient all-reduce (what communication costs)",
        ),
        Case(
            "ctrain-bf16-reduce",
            FastSettings(gradient_reduce="bf16"),
            description="ctrain default, DDP gradients all-reduced in bf16",
        ),
        Case(
            "lora-seeds",
            spec=LLAMA_8B,
            lora=Lora(),
            baseline="lora-trl-best",
            log_every_step=True,
            description="8B LoRA: TRL SFTTrainer + PEFT, seeds' settings",
        ),
        Case(
            "lora-trl-best",
            spec=LLAMA_8B,
            lora=Lora(tuned=True, rows=3, accumulation=3),
            baseline="lora-trl-best",
            log_every_step=True,
            description="8B LoRA: TRL + PEFT, best-fit packing, padding-free, Liger, best attention, "
            "no checkpointing, 3 rows x 3 micro-batches (~18k tokens) per step",
        ),
        Case(
            "lora-trl-checkpointed",
            spec=LLAMA_8B,
            lora=Lora(tuned=True, rows=9, checkpointing=True),
            baseline="lora-trl-best",
            log_every_step=True,
            description="8B LoRA: lora-trl-best with gradient checkpointing, 9 rows (~18k tokens) in one micro-batch",
        ),
        Case(
            "lora-ctrain",
            spec=LLAMA_8B,
            recipe="llama-3.1-8b-lora.yaml",
            baseline="lora-trl-best",
            log_every_step=True,
            description="8B LoRA: recipes/llama-3.1-8b-lora.yaml as ctrain train runs it (fast engine)",
        ),
        Case(
            "lora-ctrain-ungrouped",
            spec=LLAMA_8B,
            recipe="llama-3.1-8b-lora.yaml",
            overrides=("fast.group_adapters=false",),
            baseline="lora-trl-best",
            log_every_step=True,
            description="8B LoRA: lora-ctrain with PEFT's forward for every adapter (no q/k/v, gate/up groups)",
        ),
        Case(
            "lora-ctrain-hf",
            spec=LLAMA_8B,
            recipe="llama-3.1-8b-lora.yaml",
            overrides=("training.engine=hf", "training.gradient_checkpointing=true"),
            baseline="lora-trl-best",
            log_every_step=True,
            description="8B LoRA: the recipe under transformers' Trainer (engine hf, gradient checkpointing)",
        ),
        Case(
            "qlora-trl",
            spec=LLAMA_8B,
            lora=Lora(tuned=True, four_bit=True, rows=9, checkpointing=True),
            baseline="lora-trl-best",
            log_every_step=True,
            description="8B QLoRA: lora-trl-checkpointed on an nf4 base",
        ),
        Case(
            "qlora-ctrain",
            spec=LLAMA_8B,
            recipe="llama-3.1-8b-qlora.yaml",
            baseline="qlora-trl",
            log_every_step=True,
            description="8B QLoRA: recipes/llama-3.1-8b-qlora.yaml as ctrain train runs it (fast engine)",
        ),
        Case(
            "qlora-ctrain-checkpointed",
            spec=LLAMA_8B,
            recipe="llama-3.1-8b-qlora.yaml",
            overrides=(
                "fast.activation_memory_budget=null",
                "training.gradient_checkpointing=true",
                "training.max_per_device_batch_size=8",
            ),
            baseline="qlora-trl",
            log_every_step=True,
            description="8B QLoRA: qlora-ctrain recomputing whole layers, 8 rows (~16k tokens) per micro-batch",
        ),
        _sft8b("sft8b-seeds", "TRL SFTTrainer, seeds' settings (padded batches of 2, gradient checkpointing) under "
               "DeepSpeed ZeRO-3 (configs/deepspeed/zero3.json)", full=Full("zero3")),
        _sft8b("sft8b-trl-best", "TRL + FSDP2, best-fit packing into 4096-token rows, padding-free, Liger, best "
               "attention, FSDP activation checkpointing, 2 rows (8192 tokens) per GPU",
               full=Full("fsdp", tuned=True, rows=2)),
        _sft8b("sft8b-trl-no-liger", "sft8b-trl-best without Liger's kernels",
               full=Full("fsdp", tuned=True, rows=2, liger=False)),
        _sft8b("sft8b-ctrain", "recipes/llama-3.1-8b-sft.yaml as ctrain train runs it (FSDP2, fast engine, 32 rows "
               "per step in micro-batches of 2 rows per GPU)", recipe=SFT_8B),
        _sft8b("sft8b-ctrain-bf16-reduce", "sft8b-ctrain with the gradients reduce-scattered in bf16",
               recipe=SFT_8B, overrides=("fast.gradient_reduce=bf16",)),
        _sft8b("sft8b-ctrain-same-batches", "sft8b-ctrain on sft8b-trl-best's batches and schedule (loss check)",
               recipe=SFT_8B, overrides=SAME_BATCHES, rows_per_gpu=2),
        _sft8b("sft8b-ctrain-same-batches-bf16-reduce", "sft8b-ctrain-same-batches with the gradients "
               "reduce-scattered in bf16, as accelerate's FSDP2 does for TRL",
               recipe=SFT_8B, overrides=(*SAME_BATCHES, "fast.gradient_reduce=bf16"), rows_per_gpu=2),
    )
}

# Multi-GPU strategies of the sweep, as recipe settings (training.fsdp / training.deepspeed).
STRATEGIES = ("ddp", "fsdp", "fsdp-no-reshard", "zero2")


# Steps after the timed window, profiled when asked; always run so every case has the same
# max_steps, hence the same learning-rate schedule, and loss curves compare step by step.
TAIL_STEPS = 3


def compile_summary() -> dict[str, Any]:
    """What torch.compile did so far in this process: graphs compiled and loaded from its caches,
    and the seconds of its phases over every compile (dynamo's own timers), longest first."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    phases = {name: round(sum(times), 2) for name, times in compilation_time_metrics.items()}
    return {
        "graphs_compiled": counters["inductor"]["fxgraph_cache_miss"],
        "graphs_from_cache": counters["inductor"]["fxgraph_cache_hit"],
        "autograd_from_cache": counters["aot_autograd"]["autograd_cache_hit"],
        "phases_s": dict(sorted(phases.items(), key=lambda kv: -kv[1])[:12]),
    }


@dataclass
class _Clock:
    """Trainer callback: wall time and tokens between the end of warm-up and the last measured step,
    and the time from the start of training to the end of its first step (compilation, mostly)."""

    warmup: int
    steps: int
    cuda: bool
    profile_dir: Path | None = None
    t0: float = 0.0
    t1: float = 0.0
    started: float = 0.0
    first_step: float = 0.0
    compile: dict[str, Any] = field(default_factory=dict)
    tokens0: int = 0
    tokens1: int = 0
    peak_bytes: int = 0
    _profiler: Any = None

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.started = time.perf_counter()

            def on_step_begin(self, args, state, control, **kwargs):
                if clock.profile_dir and state.global_step == clock.warmup + clock.steps:
                    clock._start_profile()

            def on_step_end(self, args, state, control, **kwargs):
                # Token counts are read at the log this forces: ctrain's trainer reduces its
                # per-rank counts only when it logs (ctrain.fast.trainer).
                if state.global_step == 1:
                    clock._sync()
                    clock.first_step = time.perf_counter() - clock.started
                    clock.compile = compile_summary()
                if state.global_step == clock.warmup:
                    clock._sync()
                    clock.t0 = time.perf_counter()
                    control.should_log = True
                    if clock.cuda:
                        import torch

                        torch.cuda.reset_peak_memory_stats()
                elif state.global_step == clock.warmup + clock.steps:
                    clock._sync()
                    clock.t1 = time.perf_counter()
                    control.should_log = True
                    if clock.cuda:
                        import torch

                        clock.peak_bytes = torch.cuda.max_memory_allocated()
                elif clock._profiler is not None and state.global_step == clock.warmup + clock.steps + TAIL_STEPS:
                    clock._stop_profile()

            def on_log(self, args, state, control, **kwargs):
                if state.global_step == clock.warmup:
                    clock.tokens0 = state.num_input_tokens_seen
                elif state.global_step == clock.warmup + clock.steps:
                    clock.tokens1 = state.num_input_tokens_seen

        return Clock()

    def _start_profile(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()

    def _stop_profile(self) -> None:
        prof, self._profiler = self._profiler, None
        self._sync()
        prof.__exit__(None, None, None)
        assert self.profile_dir is not None
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        sort = "cuda_time_total" if self.cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        trace = self.profile_dir / "trace.json"
        prof.export_chrome_trace(str(trace))
        summary = kernel_summary(json.loads(trace.read_text()))
        (self.profile_dir / "profile.txt").write_text(json.dumps(summary, indent=1) + "\n\n" + table)
        with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()


# Kernel name fragments -> what the time is spent on (first match wins).
_KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "matmul")),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
    ("communication", ("nccl",)),
    ("compiled (triton)", ("triton",)),
)


def kernel_summary(trace: dict[str, Any]) -> dict[str, Any]:
    """GPU time by kind of kernel, and how much of the profiled wall time the GPU was busy."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {}
    by_kind: dict[str, float] = {}
    for e in kernels:
        name = e["name"].lower()
        kind = next((k for k, keys in _KERNEL_KINDS if any(key in name for key in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, spans[0][0]
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    wall = spans[-1][1] - spans[0][0]
    total = sum(by_kind.values())
    return {
        "profiled_us": wall,
        "gpu_busy_fraction": busy / wall,
        "kernel_us_by_kind": {k: round(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernel_share_by_kind": {k: round(v / total, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernels": len(kernels),
    }


def _distributed() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def seeds_args(spec: BenchSpec, device: str, max_steps: int, output_dir: str) -> dict[str, Any]:
    """``SFTConfig`` keyword arguments of the seeds' settings (TRL's defaults otherwise)."""
    return {
        "output_dir": output_dir,
        "max_steps": max_steps,
        "per_device_train_batch_size": spec.batch,
        "max_length": spec.max_length,
        "bf16": device == "cuda",
        "use_cpu": device == "cpu",
        "report_to": "none",
        "save_strategy": "no",
        "seed": spec.seed,
        "disable_tqdm": True,
        "include_num_input_tokens_seen": "non_padding",
        "logging_steps": 1,
    }


def recipe(case: Case, spec: BenchSpec, strategy: str, world: int, max_steps: int) -> Any:
    """The ``ctrain train`` recipe of a fast case: the seeds' schedule, the case's fast settings, the strategy."""
    from ctrain.train.recipe import DataSettings, LoggingSettings, Recipe, TrainingSettings

    assert case.fast is not None
    packed = case.fast.batching == "packed"
    rows = (case.fast.rows_per_device(spec.max_length) if packed else None) or spec.batch
    training = TrainingSettings(
        engine="fast",
        global_batch_size=rows * world,
        max_steps=max_steps,
        learning_rate=2e-5,  # TRL's defaults, as the seeds' run has them
        lr_scheduler="linear",
        logging_steps=1 if case.log_every_step else 10,
        resume="never",
        preemption_signals=["SIGUSR1"],  # ctrain train's per-step agreement, timed with the rest
    )
    if strategy in ("fsdp", "fsdp-no-reshard"):
        training.fsdp = True
        training.fsdp_config = {"version": 2, "reshard_after_forward": strategy == "fsdp"}
    elif strategy == "zero2":
        training.deepspeed = str(resources.path("configs", "deepspeed", "zero2.json"))
    elif strategy != "ddp":
        raise ValueError(f"unknown strategy {strategy}")
    return Recipe(
        name=f"bench-{case.name}",
        task="sft",
        seed=spec.seed,
        data=DataSettings(source="bench", max_length=spec.max_length, packing=packed),
        training=training,
        logging=LoggingSettings(report_to=[], memory=False),
        fast=case.fast,
    )


def best_attention(device: str) -> str:
    """The fastest attention transformers has here for padding-free packed rows: FlashAttention 2
    where installed, else flex attention (document masks as block masks) on a GPU, else SDPA."""
    if device != "cuda":
        return "sdpa"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention"


def lora_args(case: Case, spec: BenchSpec, device: str, max_steps: int, output_dir: str) -> dict[str, Any]:
    """``SFTConfig`` keyword arguments of a TRL + PEFT case: the seeds' settings, or the tuned ones."""
    assert case.lora is not None
    settings = seeds_args(spec, device, max_steps, output_dir)
    if case.lora.tuned:
        settings.update(
            packing=True,
            packing_strategy="bfd",
            padding_free=True,
            per_device_train_batch_size=case.lora.rows,
            gradient_accumulation_steps=case.lora.accumulation,
            gradient_checkpointing=case.lora.checkpointing,
            use_liger_kernel=device == "cuda" and importlib.util.find_spec("liger_kernel") is not None,
        )
    return settings


def full_args(case: Case, spec: BenchSpec, device: str, max_steps: int, output_dir: str) -> dict[str, Any]:
    """``SFTConfig`` keyword arguments of a TRL full fine-tuning case, sharded as the case says."""
    assert case.full is not None
    full = case.full
    settings = seeds_args(spec, device, max_steps, output_dir)
    settings.update(per_device_train_batch_size=full.rows, gradient_checkpointing=full.checkpointing)
    if full.sharding == "zero3":
        settings["deepspeed"] = str(resources.path("configs", "deepspeed", "zero3.json"))
    else:
        # FSDP's own activation checkpointing, as transformers asks under FSDP.
        settings.update(gradient_checkpointing=False, fsdp=True)
        settings["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                                   "activation_checkpointing": full.checkpointing}  # fmt: skip
    if full.tuned:
        settings.update(
            packing=True,
            packing_strategy="bfd",
            padding_free=True,
            use_liger_kernel=full.liger and device == "cuda" and importlib.util.find_spec("liger_kernel") is not None,
        )
    return settings


def lora_config() -> Any:
    """PEFT's adapter settings, the same for every LoRA case."""
    from peft import LoraConfig

    return LoraConfig(
        r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_dropout=LORA_DROPOUT,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
    )


def shipped_bench_recipe(case: Case, spec: BenchSpec, max_steps: int, world: int = 1) -> Any:
    """The case's shipped recipe with the bench's data and run length; its training and peft settings stay."""
    import copy

    from ctrain.train.recipe import DataSettings, LoggingSettings

    adapted = copy.deepcopy(shipped(case))
    adapted.name = f"bench-{case.name}"
    adapted.seed = spec.seed
    adapted.data = DataSettings(source="bench", max_length=spec.max_length, packing=adapted.data.packing)
    training = adapted.training
    training.max_steps = max_steps
    if case.rows_per_gpu is not None:
        training.global_batch_size = case.rows_per_gpu * world
    training.logging_steps = 1 if case.log_every_step else 10
    training.eval_steps = None
    training.resume = "never"
    training.preemption_signals = ["SIGUSR1"]
    adapted.logging = LoggingSettings(report_to=[], memory=False)
    return adapted


def base_model(spec: BenchSpec, device: str, dtype: Any, attention: str) -> Any:
    """A random-init Llama made on ``device`` in ``dtype``: an 8B base in float32 on the host would
    take 32 GB and minutes to initialise before it reached the GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(spec.model_config(), dtype=dtype, attn_implementation=attention)


def four_bit_model(model: Any, directory: Path, attention: str) -> Any:
    """``model`` saved and loaded back in 4 bits, the way QLoRA loads a checkpoint: bitsandbytes
    quantises each weight as it loads (nf4, double quantisation, bf16 compute)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ctrain.train.model import _four_bits

    model.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(
        directory,
        quantization_config=_four_bits(),
        dtype=torch.bfloat16,
        attn_implementation=attention,
        device_map={"": torch.cuda.current_device()},
    )


# What each result records of the arguments the trainer ran with.
_RECORDED_ARGS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "packing", "padding_free", "bf16",
    "optim", "learning_rate", "lr_scheduler_type", "max_grad_norm", "dataloader_num_workers", "logging_steps",
    "logging_nan_inf_filter", "activation_checkpointing", "fsdp", "fsdp_config", "deepspeed", "save_strategy",
)  # fmt: skip


def _skip_allreduce(trainer: Any) -> None:
    """Diagnostic: make the trainer's DDP wrapper skip its gradient all-reduce (a no-op comm hook)."""
    import dataclasses

    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    handler = getattr(trainer.accelerator, "ddp_handler", None)
    if handler is None:
        return

    class NoAllreduce(type(handler)):  # type: ignore[misc]
        def register_comm_hook(self, model: Any) -> None:
            model.register_comm_hook(None, noop_hook)

    trainer.accelerator.ddp_handler = NoAllreduce(
        **{f.name: getattr(handler, f.name) for f in dataclasses.fields(handler)}
    )


def run_case(
    case: Case,
    spec: BenchSpec,
    *,
    device: str,
    warmup: int,
    steps: int,
    strategy: str = "ddp",
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """Train ``warmup + steps + TAIL_STEPS`` steps and return the measurements of the timed ``steps``."""
    import torch
    from transformers import LlamaForCausalLM

    rank, world = _distributed()
    cuda = device == "cuda"
    if cuda:  # each rank of a sweep makes its model on its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    clock = _Clock(warmup, steps, cuda, profile_dir if rank == 0 else None)
    max_steps = warmup + steps + TAIL_STEPS
    preemption: Any = None
    with tempfile.TemporaryDirectory(prefix="ctrain-bench-") as tmp:
        if case.fast is None and case.recipe is None:
            from trl import SFTConfig, SFTTrainer

            extra: dict[str, Any] = {}
            if (why := cannot_run(case, cuda)) is not None:
                raise CtrainError(why)
            if case.full is not None:
                settings: dict[str, Any] = full_args(case, spec, device, max_steps, tmp)
                attention = best_attention(device) if case.full.tuned else "sdpa"
                # FSDP keeps float32 masters: made in float32, as the recipe cases' are, so both start
                # from the same weights (made in bf16 and upcast, the masters would sit on the bf16
                # grid, where Adam's first small updates round away). DeepSpeed wants the bf16 model.
                made = torch.float32 if case.full.sharding == "fsdp" else torch.bfloat16
                model = base_model(spec, device, made, attention)
            elif case.lora is None:
                settings = seeds_args(spec, device, max_steps, tmp)
                torch.manual_seed(spec.seed)
                model = LlamaForCausalLM(spec.model_config())
            else:
                settings = lora_args(case, spec, device, max_steps, tmp)
                attention = best_attention(device) if case.lora.tuned else "sdpa"
                model = base_model(spec, device, torch.bfloat16 if cuda else torch.float32, attention)
                if case.lora.four_bit:
                    model = four_bit_model(model, Path(tmp) / "base", attention)
                extra["peft_config"] = lora_config()
            trainer = SFTTrainer(
                model=model,
                args=SFTConfig(**settings),
                train_dataset=data.dataset(spec),
                processing_class=data.tokenizer(spec),
                callbacks=[clock.callback()],
                **extra,
            )
            if case.full is not None or case.lora is not None:
                settings["attn_implementation"] = attention
            if case.full is not None:
                settings["weights_made_in"] = str(made).removeprefix("torch.")
            if case.lora is not None:
                settings["peft"] = _peft_settings(trainer.model, four_bit=case.lora.four_bit)
        else:
            from ctrain.train import trainer as ctrain_trainer
            from ctrain.train.callbacks import Preemption
            from ctrain.train.data import Prepared, shape_sft
            from ctrain.train.model import add_adapters, load_dtype
            from ctrain.train.model import attention as recipe_attention
            from ctrain.train.recipe import signal_number
            from transformers.trainer_utils import SaveStrategy

            if case.recipe is not None:
                bench_recipe = shipped_bench_recipe(case, spec, max_steps, world)
            else:
                bench_recipe = recipe(case, spec, strategy, world, max_steps)
            layout = ctrain_trainer.plan(bench_recipe)
            # Before the model: the arguments start the process group and pick this rank's GPU.
            args = ctrain_trainer.training_arguments(bench_recipe, layout, Path(tmp), [])
            # No checkpoint: none inside the measured steps, and none at the end, where transformers
            # saves one (at 8B that is the sharded optimizer state, 96 GB, minutes of writing).
            args.save_strategy = SaveStrategy.NO
            if case.recipe is not None:
                attention = recipe_attention(bench_recipe, layout.device_type, layout.precision)
                made = load_dtype(bench_recipe, layout.precision)
                model = base_model(spec, args.device, made, attention)
                if bench_recipe.peft.method == "qlora":
                    model = four_bit_model(model, Path(tmp) / "base", attention)
                if bench_recipe.peft.enabled:
                    model = add_adapters(bench_recipe, model)
            else:
                torch.manual_seed(spec.seed)
                model = LlamaForCausalLM(spec.model_config())
            prepared = Prepared(shape_sft(data.labelled(spec), bench_recipe), None, data.tokenizer(spec), None, {})
            signals = [signal_number(name) for name in bench_recipe.training.preemption_signals]
            preemption = Preemption(signals, args.device)
            callbacks = [clock.callback(), preemption]
            trainer = ctrain_trainer.build_trainer(bench_recipe, layout, args, model, prepared, callbacks)
            if case.skip_allreduce:
                _skip_allreduce(trainer)
            settings = {name: getattr(args, name, None) for name in _RECORDED_ARGS}
            settings["engine"] = layout.engine
            settings["trainer"] = type(trainer).__name__
            if case.fast is not None:
                settings["fast"] = vars(case.fast)
            else:
                settings["recipe"] = case.recipe
                settings["peft"] = vars(bench_recipe.peft)
                settings["attn_implementation"] = model.config._attn_implementation
                settings["weights_made_in"] = str(made).removeprefix("torch.")
        start = time.perf_counter()
        try:
            trainer.train()
        finally:
            if preemption is not None:
                preemption.restore()
        total = time.perf_counter() - start
        losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    seconds = clock.t1 - clock.t0
    tokens = clock.tokens1 - clock.tokens0
    context = data.attention_context(data.lengths(spec))
    dense, with_attention = spec.flops_per_token(context, frozen=case.adapters)
    return {
        "case": case.name,
        "description": case.description,
        "spec": spec.name,
        "baseline": case.baseline,
        "strategy": _strategy(case, strategy) if world > 1 else "single",
        "world_size": world,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "settings": settings,
        "warmup_steps": warmup,
        "measured_steps": steps,
        "measured_tokens": tokens,
        "measured_seconds": seconds,
        **figures(tokens, seconds, steps, world, dense, with_attention),
        "peak_memory_gib": clock.peak_bytes / 2**30,
        "wall_seconds": total,
        "first_step_seconds": clock.first_step,
        "compile": clock.compile,
        "process": os.getpid(),  # each case its own (ctrain.bench.suite)
        "losses": losses,
        "versions": _versions(),
    }


def figures(tokens: int, seconds: float, steps: int, world: int, dense: float, with_attention: float,
            peak: float = PEAK_FLOPS) -> dict[str, float]:
    """What a case reports from what it measured: tokens/s (in all, and per device), the step's time,
    and MFU per device against ``peak`` FLOP/s, from ``dense`` FLOPs per token (6N; 4N for a frozen
    base: BenchSpec.flops_per_token) and ``with_attention`` (the same plus causal attention)."""
    rate = tokens / seconds if seconds > 0 else 0.0
    return {
        "tokens_per_s": rate,
        "tokens_per_s_per_device": rate / world,
        "step_ms": 1000 * seconds / steps if steps else 0.0,
        "mfu_6n": rate / world * dense / peak,
        "mfu_with_attention": rate / world * with_attention / peak,
    }


def _strategy(case: Case, asked: str) -> str:
    """How a multi-GPU case shares the work: its own sharding, else the sweep's strategy (fast cases)."""
    if case.full is not None:
        return case.full.sharding
    if case.recipe is not None:
        training = shipped(case).training
        return "fsdp" if training.fsdp else "zero" if training.deepspeed else "ddp"
    return "ddp" if case.fast is None else asked


def _peft_settings(model: Any, four_bit: bool) -> dict[str, Any]:
    """What PEFT built: the adapter settings and how many parameters train."""
    config = model.peft_config["default"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    return {
        "r": config.r,
        "alpha": config.lora_alpha,
        "dropout": config.lora_dropout,
        "target_modules": sorted(config.target_modules),
        "four_bit": four_bit,
        "trainable_parameters": trainable,
        "trainable_dtypes": dtypes,
    }


def _versions() -> dict[str, str]:
    """The training stack's versions; the optional packages only where installed."""
    import importlib.metadata

    names = ("torch", "transformers", "trl", "accelerate", "peft", "liger-kernel", "bitsandbytes")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
