"""Trainer callbacks: progress lines, memory and throughput, complete checkpoints, preemption, NaN stop.

All run on every rank; only rank 0 writes files. Collective calls (barrier, all-reduce) happen at
points every rank reaches in the same order (a step's end, a save), so they cannot deadlock.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ctrain.errors import NonFiniteTraining
from ctrain.train import checkpoint, goodput
from ctrain.train.artifacts import METRICS_FILE, PREEMPTED_EXIT_CODE
from ctrain.train.script import HeartbeatFile

log = logging.getLogger("ctrain.train")

GIB = 1024**3

# Dense bf16 tensor-core peak per GPU in TFLOP/s (vendor datasheets), for the MFU estimate.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "A10G": 125.0,
    "A10": 125.0,
    "L4": 121.0,
    "B200": 2250.0,
    "V100": 125.0,  # fp16: V100 has no bf16
}


def _distributed() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def barrier(group: Any = None) -> None:
    """A barrier of every rank (of ``group``: a background writer's own; else the default group)."""
    dist = _distributed()
    if dist is not None:
        dist.barrier(group=group)


def peak_tflops(configured: float | None) -> float | None:
    """The recipe's ``training.peak_tflops``, else the datasheet value of this GPU; None on CPU or unknown GPUs."""
    if configured is not None:
        return configured
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name.replace("NVIDIA ", ""):
            return PEAK_TFLOPS[key]
    return None


def memory_stats() -> dict[str, float]:
    """This process's memory in GiB: host RSS (now and peak) and, on CUDA, allocated/reserved peaks."""
    import torch

    stats = {"host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    try:
        with open("/proc/self/statm") as handle:
            stats["host_rss_gib"] = int(handle.read().split()[1]) * resource.getpagesize() / GIB
    except OSError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats["gpu_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        stats["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        stats["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        stats["gpu_total_gib"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    return stats


def _memory_line(stats: dict[str, float]) -> str:
    text = f"host RSS {stats.get('host_rss_gib', 0):.2f} GiB (peak {stats['host_rss_peak_gib']:.2f})"
    if "gpu_peak_allocated_gib" in stats:
        text += (
            f", GPU allocated {stats['gpu_allocated_gib']:.2f} GiB (peak {stats['gpu_peak_allocated_gib']:.2f}, "
            f"reserved peak {stats['gpu_peak_reserved_gib']:.2f} of {stats['gpu_total_gib']:.0f})"
        )
    return text


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress(TrainerCallback):
    """Log lines at each logging step (rank 0), per-rank memory, throughput/MFU, and ``metrics.jsonl``.

    Runs before the reporting callbacks, so what it adds to the logs reaches TensorBoard and W&B.
    """

    def __init__(
        self, output_dir: Path, world_size: int, rank: int, peak: float | None, memory: bool, run_id: str
    ) -> None:
        self.metrics_file = output_dir / METRICS_FILE
        self.world_size = world_size
        self.rank = rank
        self.peak = peak
        self.memory = memory
        self.run_id = run_id
        self.flops_per_token = 0.0
        self.convention = ""
        self._last_time = 0.0
        self._last_tokens = 0
        self._last_step = 0
        self._started = 0.0
        self._first_step = 0
        self._step_ended = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        from ctrain.train.model import flops_per_token

        if model is not None:
            self.flops_per_token, self.convention = flops_per_token(model)
        self._started = self._last_time = time.perf_counter()
        self._last_tokens = state.num_input_tokens_seen
        self._first_step = self._last_step = state.global_step
        if self.rank == 0:
            goodput.mark("train", state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_ended = time.perf_counter()  # an evaluation comes right after a step's end

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.rank == 0 and self._step_ended:
            goodput.mark("eval", f"{time.perf_counter() - self._step_ended:.3f}")
            self._step_ended = time.perf_counter()  # a second evaluation set after this one is timed from here

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is None:
            return
        now = time.perf_counter()
        if "loss" in logs:
            elapsed = now - self._last_time
            tokens = state.num_input_tokens_seen - self._last_tokens
            if elapsed > 0 and tokens > 0:
                rate = tokens / elapsed
                logs["throughput/tokens_per_second"] = rate
                if self.peak and self.flops_per_token:
                    logs["throughput/mfu"] = self.flops_per_token * rate / (self.peak * 1e12 * self.world_size)
            self._last_time, self._last_tokens = now, state.num_input_tokens_seen
        if self.memory:
            stats = memory_stats()
            if "loss" in logs:
                log.info("step %d memory: %s", state.global_step, _memory_line(stats))
            logs.update({f"memory/{k}": v for k, v in stats.items() if k != "gpu_total_gib"})
        if self.rank != 0:
            return
        log.info(self._line(state, logs, now))
        if "loss" in logs:
            rate, mfu = logs.get("throughput/tokens_per_second"), logs.get("throughput/mfu")
            goodput.mark("step", state.global_step, f"{rate:.1f}" if rate else "-", f"{mfu:.5f}" if mfu else "-")
        record = {"run": self.run_id, "step": state.global_step, "time": time.time(), **logs}
        with self.metrics_file.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _line(self, state: Any, logs: dict[str, Any], now: float) -> str:
        if "loss" not in logs:
            shown = {k: v for k, v in logs.items() if not k.startswith(("memory/", "throughput/"))}
            kind = "eval" if any(k.startswith("eval_") for k in shown) else "summary"
            return f"{kind}: " + ", ".join(f"{k} {_number(v)}" for k, v in shown.items())
        parts = [f"step {state.global_step}/{state.max_steps}", f"loss {logs['loss']:.4f}"]
        for key, label in (("learning_rate", "lr"), ("grad_norm", "grad_norm")):
            if key in logs:
                parts.append(f"{label} {_number(logs[key])}")
        if "throughput/tokens_per_second" in logs:
            parts.append(f"{logs['throughput/tokens_per_second']:,.0f} tok/s")
        if "throughput/mfu" in logs:
            parts.append(f"MFU {100 * logs['throughput/mfu']:.1f}% ({self.convention})")
        done = state.global_step - self._first_step
        if done > 0 and state.max_steps > state.global_step:
            remaining = (now - self._started) / done * (state.max_steps - state.global_step)
            parts.append(f"eta {timedelta(seconds=round(remaining))}")
        return ", ".join(parts)


class CompleteCheckpoints(TrainerCallback):
    """After every rank has written a checkpoint, the ranks check and checksum it, rank 0 marks it
    complete and only then drops the oldest (:func:`checkpoint.seal`, :func:`checkpoint.rotate`).

    With a background ``writer`` (:mod:`ctrain.train.asyncsave`) that holds the checkpoint, the
    check, marker and rotation are its next job, on its own process group; a failure of that
    writer ends the run at the next step (:meth:`on_step_end`), as a failed blocking save would.
    """

    def __init__(self, output_dir: Path, keep: int | None, world_size: int, writer: Any = None) -> None:
        self.output_dir = output_dir
        self.keep = keep
        self.world_size = world_size
        self.writer = writer
        self._step_ended = 0.0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.writer is not None:
            self.writer.after_step()
        # A save comes right after a step's end, asked for here or by a callback after this one
        # (preemption): the save's time starts at the step's end either way.
        self._step_ended = time.perf_counter()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_ended = time.perf_counter()  # the Trainer evaluates before it saves: the save starts here

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        directory = self.output_dir / f"checkpoint-{state.global_step}"
        info = {"step": state.global_step, "world_size": self.world_size}
        writer = self.writer
        if writer is not None and writer.directory == directory:
            blocked = time.perf_counter() - (self._step_ended or time.perf_counter())
            if state.is_world_process_zero:
                goodput.mark("save", state.global_step, f"{blocked:.3f}")
                log.info(
                    "%s: training stopped %.2f s to copy its %.1f MiB of tensors into host memory (buffers kept "
                    "for the next save); written in the background", directory.name, blocked, writer.staged / 2**20,
                )  # fmt: skip
            zero, rank, staged = state.is_world_process_zero, args.process_index, time.perf_counter()
            writer.submit(lambda: self._complete(directory, info, rank, zero, writer.group, staged))
            return
        barrier()
        started = time.perf_counter()
        damage = checkpoint.seal(directory, info, args.process_index, self.world_size)
        if state.is_world_process_zero:
            took = time.perf_counter() - (self._step_ended or started)
            if damage is None:
                goodput.mark("save", state.global_step, f"{took:.3f}")
            self._sealed(directory, damage, f"checksummed in {time.perf_counter() - started:.2f} s; training "
                         f"stopped {took:.2f} s to write and check it")  # fmt: skip
        # No rank moves on (and may exit, ending rank 0 through the launcher) before the marker is written.
        barrier()

    def _complete(self, directory: Path, info: dict[str, Any], rank: int, zero: bool, group: Any,
                  staged: float) -> None:  # fmt: skip
        """The background writer's last job of a checkpoint: every rank's files are written (the
        first barrier), checked and marked (seal), and no rank starts the next save or exits before
        the marker is there (the second)."""
        barrier(group)
        damage = checkpoint.seal(directory, info, rank, self.world_size, group)
        if zero:
            self._sealed(directory, damage, f"written and checksummed in the background in "
                         f"{time.perf_counter() - staged:.2f} s")  # fmt: skip
        barrier(group)

    def _sealed(self, directory: Path, damage: Any, how: str) -> None:
        """Rank 0, once ``directory`` is sealed: say so, and rotate the older checkpoints away."""
        if damage is not None:
            log.warning(
                "%s was written but cannot be read back (%s): not marked complete; older checkpoints kept",
                directory, damage,
            )  # fmt: skip
            return
        removed = checkpoint.rotate(self.output_dir, self.keep, directory)
        log.info(
            "checkpoint %s complete (%s)%s", directory, how,
            f"; removed older {', '.join(p.name for p in removed)}" if removed else "",
        )  # fmt: skip
        self._warn_if_the_next_will_not_fit(directory)

    def _warn_if_the_next_will_not_fit(self, newest: Path) -> None:
        """The next checkpoint is written before the oldest is removed, so it needs as much free
        space as this one took: say so now, a save interval before the disk would fill."""
        size, free = checkpoint.size_of(newest), checkpoint.free_bytes(self.output_dir)
        if free is not None and free < size:
            log.warning(
                "%s took %.1f MiB and %s has %.1f MiB free: the next checkpoint will not fit. Free space there, "
                "keep fewer checkpoints (training.save_total_limit, now %s) or set training.output_dir on another "
                "file system", newest.name, size / 2**20, self.output_dir, free / 2**20, self.keep,
            )  # fmt: skip


class Heartbeat(TrainerCallback):
    """This rank's :class:`~ctrain.train.script.HeartbeatFile`, rewritten at each step, eval batch
    and save, for the job's hang watchdog."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.file = HeartbeatFile(directory, rank)

    def beat(self, step: int) -> None:
        self.file.beat(step)

    def done(self) -> None:
        """This rank has finished (the watchdog stops expecting steps from it)."""
        self.file.done()

    def _progress(self, step: int) -> None:
        self.file.progress(step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._progress(state.global_step)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._progress(state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.beat(state.global_step)


class AlreadyTrained(Exception):
    """Raised by :class:`StopAtMaxSteps`: the checkpoint resumed from is at (or past) the last step."""

    def __init__(self, step: int) -> None:
        super().__init__(f"resumed at step {step}: nothing left to train")
        self.step = step


class StopAtMaxSteps(TrainerCallback):
    """Train no step when resuming from a checkpoint at ``max_steps``.

    Left alone, the Trainer runs one more step before it notices that the schedule is done (and
    saves ``checkpoint-MAX+1``), again on every restart. The model and optimizer are loaded by
    then, so the caller can save the final model from the checkpoint's weights.
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            raise AlreadyTrained(state.global_step)


class FiniteGuard(TrainerCallback):
    """Stop the run at a NaN or infinite loss or gradient norm, before anything of that step is saved.

    It reads only numbers the Trainer brings to the host for logging anyway (the engines keep the
    loss and gradient norm on the device between logging steps), so it adds no host sync to a
    step. A step that saves without logging is made a logging step too: a save waits for the
    device anyway, and this way no checkpoint (and no final model) is written from a state whose
    loss was not looked at. Must come after every callback that can ask for a save.

    With fp16 loss scaling an infinite gradient norm is normal (the scaler skips that step and
    lowers its scale), so then only the loss counts.
    """

    def __init__(self, check_grad_norm: bool) -> None:
        self.check_grad_norm = check_grad_norm

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save:
            control.should_log = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        keys = ("loss", "grad_norm") if self.check_grad_norm else ("loss",)
        values = {key: logs[key] for key in keys if isinstance(logs.get(key), (int, float))}
        bad = [f"{key} {value}" for key, value in values.items() if not math.isfinite(value)]
        if bad:
            raise NonFiniteTraining(
                f"step {state.global_step}: {' and '.join(bad)}; training stopped before saving this state (no "
                "checkpoint or final model of it): lower training.learning_rate or check the data, then run again "
                "to resume from the last complete checkpoint"
            )


class Preemption(TrainerCallback):
    """Turn a preemption signal into a complete checkpoint and exit code 75 (requeue me).

    The handler only records the signal. At the end of each step all ranks agree through an
    all-reduce of the signal's number (a signal may reach only some of them, and at different
    times); if any rank was signalled, all save the checkpoint of that same step and stop, and all
    know which signal it was (``signal``).

    On GPUs the all-reduce of step k is read at the end of step k+1, so no step waits for the
    GPU to drain: by then step k's work is done unless the CPU has run a whole step ahead. All
    ranks read the same step's answer, so they still stop at the same step, one step later. The
    flag lives on the device and is set with a fill kernel, and its answer comes back into one of
    two pinned host buffers: a tensor made from Python values would be copied to the GPU
    synchronously, which waits for all queued work, every step.
    """

    def __init__(self, signals: list[int], device: Any) -> None:
        self.device = device
        self.received: int | None = None  # the signal this rank got
        self.signal: int | None = None  # the signal the ranks agreed to stop on (any rank's)
        self.stopped_at: int | None = None
        self._flag: Any = None  # the device tensor all-reduced every step
        self._hosts: list[Any] = []  # two pinned buffers, alternating between steps
        self._events: list[Any] = []
        self._steps = 0
        self._previous = {number: signal.signal(number, self._handle) for number in signals}

    def _handle(self, number: int, frame: Any) -> None:
        self.received = number

    def _agreed(self) -> int:
        """The highest signal number any rank has received (0: none), the same on every rank."""
        import torch

        mine = self.received or 0
        dist = _distributed()
        if dist is None:
            return mine
        device = torch.device(self.device)
        if device.type != "cuda":
            flag = torch.tensor([mine], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return int(flag.item())
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
            self._hosts = [torch.zeros(1, dtype=torch.int32).pin_memory() for _ in range(2)]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._flag.fill_(mine)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        slot, self._steps = self._steps % 2, self._steps + 1
        self._hosts[slot].copy_(self._flag, non_blocking=True)
        self._events[slot].record()
        if self._steps == 1:
            return 0
        self._events[1 - slot].synchronize()  # the previous step's answer: long done by now
        return int(self._hosts[1 - slot][0])

    def _keep_handlers(self) -> None:
        """Keep the signals deliverable: unblock them and install ctrain's handler again, every step."""
        blocked = set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) & set(self._previous)
        if blocked:
            log.warning(
                "%s blocked in the training thread; unblocking for ctrain's preemption handler",
                ", ".join(signal.Signals(n).name for n in sorted(blocked)),
            )
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        for number in self._previous:
            current = signal.getsignal(number)
            if current != self._handle:
                log.warning(
                    "the %s handler was replaced by %r during training; restoring ctrain's preemption handler",
                    signal.Signals(number).name, current,
                )  # fmt: skip
            # Always: a native library can take the signal over with sigaction() behind Python's
            # back (signal.getsignal still names ctrain's handler); installing again takes it back.
            signal.signal(number, self._handle)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._keep_handlers()
        if self.stopped_at is not None:
            return
        agreed = self._agreed()
        if agreed:
            self.signal, self.stopped_at = agreed, state.global_step
            what = signal.Signals(agreed).name + ("" if self.received else " on another rank")
            log.info(
                "preemption (%s): saving a complete checkpoint at step %d, then exiting with %d so the job is requeued",
                what, state.global_step, PREEMPTED_EXIT_CODE,
            )  # fmt: skip
            control.should_save = True
            control.should_training_stop = True

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
