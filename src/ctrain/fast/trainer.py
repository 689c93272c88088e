"""The fast path's trainer: TRL's SFTTrainer without host syncs inside a step.

Out of the box, every step of ``SFTTrainer`` stops the CPU several times until the GPU has
caught up: after the forward (TRL gathers entropy, token accuracy and token counts across
ranks and calls ``.item()`` on each), after the backward (the Trainer's NaN filter on the
loss, and its gather-and-``.item()`` of the input-token count). Each stop empties the queue of
launched kernels, so the GPU idles while the CPU launches the next phase, and on several GPUs
every stop also waits for the slowest rank. :class:`FastSFTTrainer` keeps the same loss and
the same metrics, but accumulates them on the device and reduces them once per logging step.

On several GPUs every step waits for the slowest rank, and packed rows of the same length cost
different time: attention grows with the square of each document's length. The
:class:`RankBalancedSampler` deals each step's rows to the ranks so that every rank gets an
equal share of that cost (``fast.balance_ranks``).

It also sets DDP up for the fast path (:func:`tune_ddp`) and takes Python's garbage collector
off the step (:func:`collect_garbage_callback`): an automatic collection pauses one rank at a
random step, and on several GPUs every rank waits for it.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ctrain.fast import FastSettings

log = logging.getLogger("ctrain.train")

# The metrics FastSFTTrainer sums on the device between logging steps, in this order.
_SUMS = ("label_tokens", "entropy", "correct")


@functools.cache
def trainer_class(mixins: tuple[type, ...] = ()) -> type:
    """``FastSFTTrainer``, built on first use so that importing ctrain needs no TRL; ``mixins`` come
    between it and ``SFTTrainer`` (the trainer's background saves)."""
    import datasets
    import torch
    from trl import SFTTrainer

    class FastSFTTrainer(*mixins, SFTTrainer):
        """``SFTTrainer`` whose steps never wait for the GPU, with rank-balanced batches (module docstring)."""

        def __init__(self, *args: Any, fast_settings: FastSettings, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._ctrain_fast = fast_settings
            self._ctrain_sums: Any = None
            self._ctrain_local_tokens = 0

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            dataset = self.train_dataset if train_dataset is None else train_dataset
            world = self.args.world_size
            if (
                self._ctrain_fast.balance_ranks
                and world > 1
                and self.args.train_sampling_strategy == "random"
                and isinstance(dataset, datasets.Dataset)
            ):
                return RankBalancedSampler(
                    attention_cost(dataset), world, self.args.per_device_train_batch_size, self.args.seed
                )
            return super()._get_train_sampler(train_dataset)

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
            if self._ctrain_fast.sync_metrics or return_outputs or not self.model.training or not self._plain_loss():
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
            if self._ctrain_fast.sync_metrics or mode == "no" or main not in inputs:
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


def fsdp_plugin(trainer: Any) -> Any:
    """The Trainer's FSDP plugin (accelerate's), or None when it does not shard the model."""
    return getattr(trainer.accelerator.state, "fsdp_plugin", None)


def tune_fsdp(trainer: Any, settings: FastSettings) -> None:
    """FSDP2's mixed precision on the fast path, set on the trainer's Accelerator before it shards
    the model: each layer's parameters gathered in bf16 for its forward and backward (the float32
    shards stay the optimizer's), its gradients reduce-scattered in ``fast.gradient_reduce``'s
    dtype. Accelerate's own policy reduces in bf16 whenever training is bf16; the fast path's
    default, fp32, keeps every rank's gradient at full precision in the sum."""
    plugin = fsdp_plugin(trainer)
    if plugin is None or not trainer.args.bf16:
        return
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.float32 if settings.gradient_reduce == "fp32" else torch.bfloat16
    plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=reduce, output_dtype=torch.bfloat16
    )


def fused_head_problem(model: Any) -> str | None:
    """Why TRL's fused LM head would train a sharded output head wrongly, or None.

    The fused head reads ``lm_head.weight`` without calling ``lm_head``. FSDP2 gathers a weight
    and reduce-scatters its gradient through hooks of the module calls of its group; accelerate
    puts the head in one group with the final norm, whose call gathers it. A head sharded alone
    would be gathered by TRL itself and its gradient never averaged over the ranks: each rank's
    shard would train on its own batch only (tests/integration/test_fsdp_fast_model.py).
    """
    from torch.distributed.fsdp import FSDPModule

    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(head, FSDPModule):
        return None
    if any(module is not head for module in head._get_fsdp_state()._modules):
        return None
    return (
        f"training.fsdp: the output head of {type(model).__name__} is an FSDP unit of its own (no final norm "
        "found to share it), and the fast engine's fused loss reads its weight without calling it, so its "
        "gradient would not be averaged over the GPUs; use training.engine: hf for this model"
    )


def fused_head_guard() -> Any:
    """A TrainerCallback that refuses, before the first step, a sharding :func:`fused_head_problem` finds wrong."""
    from transformers import TrainerCallback

    from ctrain.errors import ConfigError

    class FusedHeadGuard(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            problem = None if model is None else fused_head_problem(model)
            if problem:
                raise ConfigError(problem)

    return FusedHeadGuard()


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


def compile_report_callback() -> Any:
    """A TrainerCallback that says, at the run's first step (step 1, or the first after a resume),
    how long it took and how many of the compiled graphs torch's caches served: a requeue or a
    second job that compiles everything again (a cache on storage the nodes do not share, a
    changed image) shows in its log."""
    from transformers import TrainerCallback

    class CompileReport(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()
            self.reported = False

        def on_step_end(self, args, state, control, **kwargs):
            if self.reported or not state.is_world_process_zero:
                return
            self.reported = True
            from torch._dynamo.utils import counters
            from torch._inductor.runtime.runtime_utils import cache_dir

            graphs = counters["inductor"]
            loaded, compiled = graphs["fxgraph_cache_hit"], graphs["fxgraph_cache_miss"]
            if loaded + compiled:
                log.info(
                    "step %d came %.1f s after training started: %d compiled graphs, %d of them from "
                    "torch's compile cache in %s",
                    state.global_step, time.perf_counter() - self.started, loaded + compiled, loaded, cache_dir(),
                )  # fmt: skip

    return CompileReport()


def attention_cost(dataset: Any) -> np.ndarray:
    """Per row, the sum of its documents' squared lengths (packed rows carry ``seq_lengths``)."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    if "seq_lengths" in table.column_names:
        column = table.column("seq_lengths").combine_chunks()
        lengths = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.float64)
        rows = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        return np.bincount(rows, weights=lengths**2, minlength=len(column))
    lengths = pc.list_value_length(table.column("input_ids").combine_chunks()).to_numpy(zero_copy_only=False)
    return lengths.astype(np.float64) ** 2


class RankBalancedSampler:
    """Rows in a random order in which each step's rows are dealt evenly to the ranks by cost.

    Each epoch shuffles the rows (the same on every rank: seeded with ``seed`` and the epoch).
    Every ``world * per_device`` consecutive rows form one step; they are sorted by cost and
    dealt in a snake (0, 1, .. world-1, world-1, .. 0, ...), so each rank gets ``per_device``
    rows and about the same total cost, then emitted rank by rank: the data loader gives its
    batch ``k * world + r`` to rank ``r`` (accelerate's batch sharding). A last, short step
    keeps the shuffled order.
    """

    def __init__(self, costs: np.ndarray, world: int, per_device: int, seed: int) -> None:
        self.costs = np.asarray(costs, dtype=np.float64)
        self.world, self.per_device, self.seed = world, per_device, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.costs)

    def __iter__(self) -> Iterator[int]:
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.costs))
        step = self.world * self.per_device
        whole = len(order) - len(order) % step
        dealt = [deal(order[i : i + step], self.costs, self.world) for i in range(0, whole, step)]
        return iter(np.concatenate([*dealt, order[whole:]]).tolist())


def deal(rows: np.ndarray, costs: np.ndarray, world: int) -> np.ndarray:
    """``rows`` reordered rank by rank, each rank's rows chosen by a snake deal over descending cost."""
    by_cost = rows[np.argsort(-costs[rows], kind="stable")]
    turn = np.arange(len(rows)) % (2 * world)
    rank = np.where(turn < world, turn, 2 * world - 1 - turn)
    return np.concatenate([by_cost[rank == r] for r in range(world)])


def build(settings: FastSettings, mixins: tuple[type, ...] = (), **kwargs: Any) -> Any:
    """The fast path's SFT trainer over ``SFTTrainer``'s keyword arguments."""
    trainer = trainer_class(mixins)(fast_settings=settings, **kwargs)
    tune_ddp(trainer, settings)
    tune_fsdp(trainer, settings)
    if fsdp_plugin(trainer) is not None:
        trainer.add_callback(fused_head_guard())
    if settings.gc_every:
        trainer.add_callback(collect_garbage_callback(settings.gc_every))
    if settings.compile != "off":
        trainer.add_callback(compile_report_callback())
    return trainer
