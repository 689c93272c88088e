"""The fast path's trainer: TRL's SFTTrainer without host syncs inside a step.

Out of the box, every step of ``SFTTrainer`` stops the CPU several times until the GPU has
caught up: after the forward (TRL gathers entropy, token accuracy and token counts across
ranks and calls ``.item()`` on each), after the backward (the Trainer's NaN filter on the
loss, and its gather-and-``.item()`` of the input-token count). Each stop empties the queue of
launched kernels, so the GPU idles while the CPU launches the next phase, and on several GPUs
every stop also waits for the slowest rank. :class:`FastSFTTrainer` keeps the same loss and
the same metrics, but accumulates them on the device and reduces them once per logging step.

It also sets DDP up for the fast path (:func:`tune_ddp`) and takes Python's garbage collector
off the step (:class:`CollectGarbage`): an automatic collection pauses one rank at a random
step, and on several GPUs every rank waits for it.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

from ctrain.fast import FastSettings

# The metrics FastSFTTrainer sums on the device between logging steps, in this order.
_SUMS = ("label_tokens", "entropy", "correct")


@functools.cache
def trainer_class() -> type:
    """``FastSFTTrainer``, built on first use so that importing ctrain needs no TRL."""
    import torch
    from trl import SFTTrainer

    class FastSFTTrainer(SFTTrainer):
        """``SFTTrainer`` whose steps never wait for the GPU (see the module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._ctrain_sums: Any = None
            self._ctrain_local_tokens = 0

        def _plain_loss(self) -> bool:
            """Whether TRL would take its plain fused-head path, the one this class replicates."""
            sp = getattr(getattr(self.accelerator, "parallelism_config", None), "sp_enabled", False)
            return (
                self.compute_loss_func is None
                and self.label_smoother is None
                and getattr(self.args, "loss_type", "nll") == "nll"
                and not self.aux_loss_enabled
                and not sp
            )

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs or not self.model.training or not self._plain_loss():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            inputs["use_cache"] = False
            outputs = model(**inputs, fused_lm_head=True)
            count = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = -outputs.log_probs.sum() / torch.as_tensor(count).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            with torch.no_grad():
                sums = torch.stack(
                    [
                        outputs.label_mask.sum().float(),
                        outputs.entropy.detach().sum().float(),
                        outputs.is_top1.sum().float(),
                    ]
                )
                self._ctrain_sums = sums if self._ctrain_sums is None else self._ctrain_sums + sums
            return loss

        def _track_num_input_tokens(self, inputs):
            # Padding-free batches hold no padding: their token count is a shape, known without the GPU.
            main = getattr(self.model, "main_input_name", "input_ids")
            mode = self.args.include_num_input_tokens_seen
            if mode == "no" or main not in inputs:
                return super()._track_num_input_tokens(inputs)
            if mode == "all" or ("attention_mask" not in inputs and "position_ids" in inputs):
                self._ctrain_local_tokens += inputs[main].numel()
                return None
            return super()._track_num_input_tokens(inputs)

        def _reduce_deferred(self) -> None:
            """Add up what every rank deferred since the last call: one collective, at logging time.

            Every rank logs and saves at the same steps, so every rank reaches this together.
            """
            values = torch.zeros(len(_SUMS) + 1, device=self.args.device, dtype=torch.float64)
            if self._ctrain_sums is not None:
                values[: len(_SUMS)] = self._ctrain_sums.double()
            values[len(_SUMS)] = self._ctrain_local_tokens
            if self.accelerator.num_processes > 1:
                values = self.accelerator.reduce(values, reduction="sum")
            label_tokens, entropy, correct, tokens = values.tolist()
            self.state.num_input_tokens_seen += int(tokens)
            if label_tokens:
                metrics = self._metrics["train"]
                metrics["entropy"] = [entropy / label_tokens]
                metrics["mean_token_accuracy"] = [correct / label_tokens]
            self._ctrain_sums, self._ctrain_local_tokens = None, 0

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if self.model.training:
                self._reduce_deferred()
                self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]
            super().log(logs, start_time)

        def _save_checkpoint(self, model, trial):
            self._reduce_deferred()  # the saved trainer state carries the exact token count
            return super()._save_checkpoint(model, trial)

    return FastSFTTrainer


def tune_ddp(trainer: Any, settings: FastSettings) -> None:
    """DDP settings of the fast path, set on the trainer's Accelerator before it wraps the model.

    Gradients become views into DDP's communication buckets (no copy in and out each step), and
    with ``fast.gradient_reduce: bf16`` they are all-reduced in bf16 (half the bytes).
    """
    handler = getattr(trainer.accelerator, "ddp_handler", None)
    if handler is None:
        return
    from accelerate.utils import DDPCommunicationHookType

    handler.gradient_as_bucket_view = True
    if settings.gradient_reduce == "bf16":
        handler.comm_hook = DDPCommunicationHookType.BF16


def collect_garbage_callback(every: int) -> Any:
    """A TrainerCallback that turns automatic GC off for the run and collects every ``every`` steps."""
    from transformers import TrainerCallback

    class CollectGarbage(TrainerCallback):
        """Collect on every rank at the same step instead of at random points (torchtitan's gc_freq)."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % every == 0:
                gc.collect(1)

        def on_train_end(self, args, state, control, **kwargs):
            if getattr(self, "was_enabled", True):
                gc.enable()

    return CollectGarbage()


def build(settings: FastSettings, **kwargs: Any) -> Any:
    """The fast path's SFT trainer over ``SFTTrainer``'s keyword arguments."""
    if settings.sync_metrics:
        from trl import SFTTrainer

        trainer = SFTTrainer(**kwargs)
    else:
        trainer = trainer_class()(**kwargs)
    tune_ddp(trainer, settings)
    if settings.gc_every:
        trainer.add_callback(collect_garbage_callback(settings.gc_every))
    return trainer
