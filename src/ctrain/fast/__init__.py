"""The fast GPU training path: settings and the pieces that plug into TRL's SFTTrainer.

What makes SFT slow out of the box (measured in docs/benchmarks.md): padding every batch to its
longest example, recomputing activations (TRL turns gradient checkpointing on by default), SDPA
with a materialised padding mask, and un-fused element-wise kernels. The fast path keeps the
Trainer (checkpoints, resume, logging, DDP/FSDP all unchanged) and changes only:

- batches: TRL's best-fit-decreasing packing, padding-free (one row of real tokens per step);
- attention: :mod:`ctrain.fast.attention`, document-masked so packed examples never see each other;
- loss: TRL's fused LM head (chunked logits, never the full ``tokens x vocab`` fp32 tensor);
- kernels: each decoder layer compiled with ``torch.compile`` (fused norms, RoPE, SwiGLU);
- no gradient checkpointing, fused AdamW, bf16 autocast, DDP without unused-parameter search,
  data loader workers that keep the GPU fed.

Use: ``kwargs = sft_overrides(settings, "cuda")`` into ``SFTConfig``, and
``prepare_model(model, settings, "cuda")`` before building the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ctrain.errors import ConfigError

__all__ = ["FastSettings", "compile_layers", "decoder_layers", "prepare_model", "sft_overrides"]


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
    gradient_checkpointing: bool = False
    dataloader_workers: int = 2

    def validate(self) -> None:
        if self.batching != "padded" and self.attention != "varlen":
            raise ConfigError(
                f"fast.batching: {self.batching} needs fast.attention: varlen "
                "(with sdpa, examples in one row would attend to each other)"
            )
        if self.tokens_per_device is not None and self.tokens_per_device < 1:
            raise ConfigError(f"fast.tokens_per_device must be positive, got {self.tokens_per_device}")
        if self.dataloader_workers < 0:
            raise ConfigError(f"fast.dataloader_workers must be >= 0, got {self.dataloader_workers}")

    def compiles(self, device_type: str) -> bool:
        return self.compile == "layers" or (self.compile == "auto" and device_type == "cuda")


def sft_overrides(settings: FastSettings, device_type: str, max_length: int | None = None) -> dict[str, Any]:
    """``SFTConfig`` fields the fast path sets (everything else stays as the recipe says).

    ``max_length`` is the recipe's: packed rows are that long, so ``tokens_per_device`` becomes
    ``per_device_train_batch_size`` rows.
    """
    import dataclasses

    from transformers import TrainingArguments

    settings.validate()
    # Newer transformers call it activation_checkpointing (gradient_checkpointing is a deprecated alias).
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    out: dict[str, Any] = {
        checkpointing: settings.gradient_checkpointing,
        "ddp_find_unused_parameters": False,
        "ddp_broadcast_buffers": False,
        "dataloader_num_workers": settings.dataloader_workers,
        "dataloader_persistent_workers": settings.dataloader_workers > 0,
        "dataloader_pin_memory": device_type == "cuda",
    }
    if device_type == "cuda":
        out.update(bf16=True, optim="adamw_torch_fused")
    if settings.batching == "packed":
        out.update(packing=True, packing_strategy="bfd", padding_free=True)
        if settings.tokens_per_device and max_length:
            out["per_device_train_batch_size"] = max(1, settings.tokens_per_device // max_length)
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


def prepare_model(model: Any, settings: FastSettings, device_type: str) -> Any:
    """Switch ``model`` to the fast path (before the trainer wraps it); returns it."""
    settings.validate()
    if settings.attention == "varlen":
        from ctrain.fast.attention import register

        if getattr(model.config, "attention_dropout", 0.0):
            raise ConfigError("fast.attention: varlen has no attention dropout; set the model's attention_dropout to 0")
        model.set_attn_implementation(register())
    if settings.compiles(device_type):
        compile_layers(model)
    return model
