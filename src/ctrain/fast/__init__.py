"""The fast GPU training path: settings and the pieces that plug into TRL's SFTTrainer.

What makes SFT slow out of the box (measured in docs/benchmarks.md): padding every batch to its
longest example, recomputing activations (TRL turns gradient checkpointing on by default), SDPA
with a materialised padding mask, and un-fused element-wise kernels. The fast path keeps the
Trainer (checkpoints, resume, logging, DDP/FSDP all unchanged) and changes only:

- batches: TRL's best-fit-decreasing packing, padding-free (one row of real tokens per step);
- attention: :mod:`ctrain.fast.attention`, document-masked so packed examples never see each other;
- loss: TRL's fused LM head (chunked logits, never the full ``tokens x vocab`` fp32 tensor);
- kernels: each decoder layer compiled with ``torch.compile`` (fused norms, RoPE, SwiGLU);
- LoRA: adapters of projections that share an input computed together (:mod:`ctrain.fast.adapters`);
- QLoRA: the 4-bit base weights dequantised inside the compiled layers (:mod:`ctrain.fast.nf4`);
- no gradient checkpointing, fused AdamW, bf16 autocast, DDP without unused-parameter search
  and with gradients as views of its buckets, data loader workers that keep the GPU fed;
- steps without host syncs (:mod:`ctrain.fast.trainer`): metrics and token counts are summed on
  the device and reduced once per logging step; garbage collection at fixed steps.

Use: ``kwargs = sft_overrides(settings, "cuda")`` into ``SFTConfig``,
``prepare_model(model, settings, "cuda")``, then ``ctrain.fast.trainer.build(settings, ...)``
with ``SFTTrainer``'s arguments. ``ctrain.train.trainer.build_trainer`` does all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ctrain.errors import ConfigError

__all__ = ["FastSettings", "checkpoint_layers", "compile_layers", "decoder_layers", "prepare_model", "sft_overrides"]


@dataclass
class FastSettings:
    """Switches of the fast path; the defaults are what ``ctrain train`` uses on GPUs."""

    # ``varlen``: document-masked packed attention; ``sdpa``: transformers' own (padded batches).
    attention: Literal["varlen", "sdpa"] = "varlen"
    # ``auto``: compile the decoder layers on CUDA, not on CPU (compiling there costs more than it saves).
    compile: Literal["auto", "layers", "off"] = "auto"
    # ``packed``: examples packed into rows of ``max_length`` tokens (best-fit decreasing), each batch
    # passed padding-free; ``padding_free``: a batch's examples as they come, concatenated without
    # padding (same batches as padded training); ``padded``: the trainer's default padded batches.
    batching: Literal["packed", "padding_free", "padded"] = "packed"
    # Packed tokens per device and step (rows of max_length); None keeps per_device_train_batch_size.
    # Below ~24k tokens a step of a 24-layer model is bound by CPU launch overhead on an H100.
    tokens_per_device: int | None = 32768
    # Activation checkpointing of every decoder layer (also on with training.gradient_checkpointing).
    gradient_checkpointing: bool = False
    # LoRA: the adapters of projections that read one input (q/k/v, gate/up) share one dropout
    # mask and one A matmul (ctrain.fast.adapters): 4% faster and 9 GiB less on an 8B model
    # (docs/benchmarks.md); false keeps PEFT's forward for each.
    group_adapters: bool = True
    # QLoRA: the compiled layers dequantise the 4-bit base weights themselves (ctrain.fast.nf4: one
    # fused kernel a projection, no Python per call) instead of calling bitsandbytes for each
    # projection; false keeps bitsandbytes' forward. Only where the layers compile and recompute
    # (an activation_memory_budget below 1, or checkpointing): otherwise the compiler would keep
    # every dequantised weight for the backward pass.
    inline_4bit: bool = True
    # Fraction of each compiled layer's activations kept for the backward pass (0 < f <= 1); the
    # compiler recomputes the rest, what is cheapest to recompute first. Between keeping all
    # (None: the compiler's default, 1.0) and fast.gradient_checkpointing (whole layers recomputed).
    activation_memory_budget: float | None = None
    # Dtype of the gradients' sum over ranks (DDP's all-reduce, FSDP's reduce-scatter): fp32 (the
    # gradients' own) or bf16 (half the bytes, for slow links; each rank's gradient is rounded to
    # bf16 before the sum).
    gradient_reduce: Literal["fp32", "bf16"] = "fp32"
    # Reduce TRL's per-step metrics (entropy, accuracy, tokens) at every step as TRL does, which
    # waits for the GPU several times a step; the default sums them on the device until logging.
    sync_metrics: bool = False
    # On several GPUs, deal each step's packed rows to the ranks so that every rank gets the same
    # share of attention work (the sum of squared document lengths); every step waits for the slowest.
    balance_ranks: bool = True
    # DDP's gradient bucket size in MB (PyTorch's default is 25): fewer, larger all-reduces.
    ddp_bucket_mb: int | None = 100
    # Collect Python garbage every N steps on every rank, automatic collection off; 0 leaves
    # Python's automatic collection on (one rank's pause then stalls all of them at random steps).
    gc_every: int = 50

    def validate(self) -> None:
        if self.batching != "padded" and self.attention != "varlen":
            raise ConfigError(
                f"fast.batching: {self.batching} needs fast.attention: varlen "
                "(with sdpa, examples in one row would attend to each other)"
            )
        if self.tokens_per_device is not None and self.tokens_per_device < 1:
            raise ConfigError(f"fast.tokens_per_device must be positive, got {self.tokens_per_device}")
        if self.ddp_bucket_mb is not None and self.ddp_bucket_mb < 1:
            raise ConfigError(f"fast.ddp_bucket_mb must be at least 1, got {self.ddp_bucket_mb}")
        budget = self.activation_memory_budget
        if budget is not None and not 0 < budget <= 1:
            raise ConfigError(f"fast.activation_memory_budget must be in (0, 1], got {budget}")
        self.check_recompute()
        if self.gc_every < 0:
            raise ConfigError(f"fast.gc_every must be >= 0 (0: Python's automatic collection), got {self.gc_every}")

    def check_recompute(self, training_checkpointing: bool = False) -> None:
        """fast.activation_memory_budget and whole-layer checkpointing (fast.gradient_checkpointing, or
        ``training_checkpointing``: training.gradient_checkpointing) both choose what to recompute."""
        if self.activation_memory_budget is None:
            return
        for name, on in (
            ("fast.gradient_checkpointing", self.gradient_checkpointing),
            ("training.gradient_checkpointing", training_checkpointing),
        ):
            if on:
                raise ConfigError(
                    f"fast.activation_memory_budget and {name} both choose what to recompute: set one of them"
                )

    def rows_per_device(self, max_length: int) -> int | None:
        """Micro-batch cap in rows of ``max_length`` tokens that ``tokens_per_device`` gives (None: no cap)."""
        return max(1, self.tokens_per_device // max_length) if self.tokens_per_device else None

    def compiles(self, device_type: str) -> bool:
        return self.compile == "layers" or (self.compile == "auto" and device_type == "cuda")


def sft_overrides(settings: FastSettings, device_type: str) -> dict[str, Any]:
    """``SFTConfig`` fields the fast path sets (everything else stays as the recipe says).

    Data loader workers are ``training.dataloader_workers`` (2 on GPUs unless set); the fast
    path keeps them alive between epochs. The micro-batch is the recipe's batch layout, capped
    at :meth:`FastSettings.rows_per_device` (``ctrain.train.trainer.plan``).
    """
    import dataclasses

    from transformers import TrainingArguments

    settings.validate()
    # Newer transformers call it activation_checkpointing (gradient_checkpointing is a deprecated alias).
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    out: dict[str, Any] = {
        # The fast path checkpoints each decoder layer itself (prepare_model).
        checkpointing: False,
        "ddp_find_unused_parameters": False,
        "ddp_broadcast_buffers": False,
        "dataloader_pin_memory": device_type == "cuda",
        # The NaN filter reads the loss back every step (a host sync); a NaN then shows in the logged loss.
        "logging_nan_inf_filter": settings.sync_metrics,
    }
    if settings.ddp_bucket_mb is not None:
        out["ddp_bucket_cap_mb"] = settings.ddp_bucket_mb
    if device_type == "cuda":
        out.update(bf16=True, optim="adamw_torch_fused")
    if settings.batching == "packed":
        out.update(packing=True, packing_strategy="bfd", padding_free=True)
    elif settings.batching == "padding_free":
        out.update(padding_free=True)
    return out


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks of a transformers model (the classes it declares unsplittable)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} to compile; set fast.compile: off")
    return layers


def _checkpointed(forward: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward`` (a decoder layer's, compiled or not) under activation checkpointing.

    Re-entrant checkpointing: the forward runs without autograd and again, with it, in the
    backward pass; both are graphs the compiler handles. Non-reentrant checkpointing, around
    the compiled layer (transformers' own) or inside it, makes torch 2.11's partitioner fail on
    GPUs (``Node ... was invalid, but is output``). The CUDA random state is restored for the
    second run, so adapter dropout draws the same mask twice.
    """
    from torch.utils.checkpoint import checkpoint

    return checkpoint(lambda h, *a: forward(h, *a, **kwargs), hidden_states, *args, use_reentrant=True)


def checkpoint_layers(model: Any) -> int:
    """Recompute each decoder layer's activations in the backward pass; returns how many layers.

    After :func:`compile_layers`: the wrapper stays outside the compiled graph. Re-entrant
    checkpointing passes gradients only to inputs that need one, so the embeddings' output is
    made to need one even when they are frozen (adapters).
    """
    import functools

    layers = decoder_layers(model)
    if not getattr(model, "_require_grads_hooks", None):  # add_adapters may have done it already
        model.enable_input_require_grads()
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward)
    return len(layers)


def compile_layers(model: Any, backend: str = "inductor") -> int:
    """Compile each decoder layer's forward in place; returns how many.

    Only ``forward`` is compiled, not the module call, so FSDP's and DDP's hooks stay outside
    the graph. All layers share one code object, so they share one compiled graph; shapes are
    dynamic from the start because packed batches differ in length.
    """
    import torch
    import torch.fx.experimental._config as fx_config

    # Duck sizing would tie a batch's sequence count to any other size that happens to be equal
    # in the first batch (the head count, say) and compile again when they differ.
    fx_config.use_duck_shape = False
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)
    return len(layers)


def prepare_model(model: Any, settings: FastSettings, device_type: str, checkpointing: bool = False) -> Any:
    """Switch ``model`` to the fast path (before the trainer wraps it); returns it.

    ``checkpointing`` (``training.gradient_checkpointing``) or ``fast.gradient_checkpointing``
    recompute each layer's activations in the backward pass; the trainer's own checkpointing
    stays off (:func:`sft_overrides`).
    """
    settings.validate()
    if settings.attention == "varlen":
        from ctrain.fast.attention import register

        if getattr(model.config, "attention_dropout", 0.0):
            raise ConfigError("fast.attention: varlen has no attention dropout; set the model's attention_dropout to 0")
        model.set_attn_implementation(register())
    if settings.group_adapters:
        from ctrain.fast.adapters import group_adapters

        group_adapters(model)
    settings.check_recompute(checkpointing)
    if settings.activation_memory_budget is not None:
        if not settings.compiles(device_type):
            raise ConfigError(
                f"fast.activation_memory_budget needs compiled layers (fast.compile: {settings.compile} "
                f"on {device_type} does not compile them)"
            )
        import torch._functorch.config as functorch_config

        # Read when a layer's graph is split into forward and backward, at its first step.
        functorch_config.activation_memory_budget = settings.activation_memory_budget
        if device_type == "cuda":
            # Dropout masks drawn from a seed the backward pass can draw again (CUDA's Philox), so the
            # compiler may recompute them rather than keep a byte per element of every adapter input.
            functorch_config.functionalize_rng_ops = True
    if settings.compiles(device_type):
        budget = settings.activation_memory_budget
        if settings.inline_4bit and (checkpointing or settings.gradient_checkpointing or (budget or 1) < 1):
            from ctrain.fast.nf4 import inline_4bit

            inline_4bit(model)
        compile_layers(model)
    if checkpointing or settings.gradient_checkpointing:
        checkpoint_layers(model)
    return model
