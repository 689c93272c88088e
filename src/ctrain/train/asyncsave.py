"""Checkpoints written while training goes on.

A blocking save stops every rank for the whole write and checksum of the checkpoint: seconds for an
adapter, minutes for a full fine-tune's weights and optimizer state. Here a save stops training
only while the tensors it writes are copied into host memory (:class:`Staging`: pinned buffers,
reused from one save to the next); a background thread (:class:`Writer`) then writes them in the
Trainer's own formats (``save_pretrained`` with the copied state dict, ``torch.save`` of the
optimizer's), checksums the checkpoint with the other ranks over a process group of its own (gloo)
and marks it complete (:class:`ctrain.train.callbacks.CompleteCheckpoints`).

What does not change: a checkpoint counts only once its marker is written, after every file is
checked; a run killed during a background save leaves that checkpoint without a marker, and the
next start removes it and resumes from the newest complete one; older checkpoints are rotated away
only after the new one is marked. One save is in flight at a time: the next save, the end of
training (a preemption's included: the job exits only after its checkpoint is complete) and a
failure wait for it, and a failed background write ends the run at the next step as a failed
blocking save would. The small files (trainer state, scheduler, RNG states, tokenizer, arguments)
are written before training resumes.

Sharded layouts (FSDP, DeepSpeed) keep the Trainer's blocking save.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("ctrain.train")

__all__ = ["AsyncSaves", "Staging", "Writer", "attach"]


class Staging:
    """Host copies of the tensors of a nested state (dicts, lists, tuples), in buffers kept from one
    save to the next. Tensors that share storage (tied weights) share one copy, so a state dict
    written from the copies ties them as the original would."""

    def __init__(self, pin: bool, device: Any = None) -> None:
        self.pin = pin
        self.device = device  # the rank's torch.device
        self._buffers: dict[tuple[Any, ...], Any] = {}

    @property
    def bytes(self) -> int:
        """Host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def copy(self, name: str, state: Any) -> Any:
        """``state`` with every tensor replaced by its host copy (in the buffers kept under ``name``);
        returns once the copies are done."""
        import torch

        copied = self._walk(state, (name,), {}, copy=True)
        if any(t.is_cuda for t in _tensors(state)):
            torch.cuda.synchronize()
        return copied

    def reserve(self, name: str, state: Any) -> None:
        """Allocate the buffers :meth:`copy` of ``state`` will use, without copying: pinning host
        memory takes seconds per 10 GiB, which the first save would otherwise wait for. Run in the
        writer's thread, whose CUDA device is set here: a thread starts on device 0, and a
        registration there would open a context on another rank's GPU."""
        import torch

        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._walk(state, (name,), {}, copy=False)

    def _walk(self, value: Any, where: tuple[Any, ...], seen: dict[Any, Any], copy: bool) -> Any:
        import torch

        if isinstance(value, torch.Tensor):
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.dtype)
            if key in seen and value.untyped_storage().data_ptr() != 0:
                return seen[key]
            buffer = self._buffers.get(where)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                if buffer is not None:
                    _unpin(buffer)
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu")
                if self.pin and value.is_cuda:
                    _pin(buffer)
                self._buffers[where] = buffer
            if copy:
                buffer.copy_(value.detach(), non_blocking=value.is_cuda)
            seen[key] = buffer
            return buffer
        if isinstance(value, dict):
            return type(value)((k, self._walk(v, (*where, k), seen, copy)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            items = [self._walk(v, (*where, i), seen, copy) for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, list) else tuple(items)
        return value


def _cudart() -> Any:
    """The CUDA runtime library torch loaded, through ctypes; None where none is loaded.

    ctypes lets go of the interpreter during the call, and the registration bypasses torch's
    pinned-memory allocator, whose lock the training thread's own pinned batches wait on: measured
    on an H200 (docs/benchmarks.md), reserving 8 GiB this way stalled a training loop by at most
    83 ms, torch's pinned allocation in a thread stalled it for all of its 5.9 s."""
    global _CUDART
    if _CUDART is None:
        import ctypes

        from ctrain.files import read_regular

        _CUDART = False
        try:
            maps = read_regular(Path("/proc/self/maps"), 16 << 20).decode(errors="replace")
        except OSError:
            maps = ""
        for line in maps.splitlines():
            if "/libcudart.so" in line:
                try:
                    _CUDART = ctypes.CDLL(line.split(maxsplit=5)[-1])
                except OSError:
                    continue
                break
    return _CUDART or None


_CUDART: Any = None


def _pin(buffer: Any) -> None:
    """Page-lock ``buffer`` (a host tensor) so the GPU copies into it at full speed; where that
    cannot be done it stays pageable, which copies about 4x slower."""
    import ctypes

    buffer.zero_()  # its pages mapped here, in the writer's thread, not by the first save
    lib, size = _cudart(), buffer.numel() * buffer.element_size()
    if lib is not None and size and lib.cudaHostRegister(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(size), 0):
        lib.cudaGetLastError()  # a failed registration leaves an error the next CUDA call would report


def _unpin(buffer: Any) -> None:
    import ctypes

    lib = _cudart()
    if lib is not None and buffer.numel():
        lib.cudaHostUnregister(ctypes.c_void_p(buffer.data_ptr()))
        lib.cudaGetLastError()


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class Writer:
    """One background thread that runs a checkpoint's jobs in order (write, then seal).

    ``group`` is the process group the jobs' collectives use: never the training's, whose
    collectives run on the main thread at the same time."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.group: Any = None
        self.directory: Path | None = None  # the checkpoint in flight
        self.staging: Staging | None = None
        self.staged = 0  # bytes of tensors the checkpoint in flight copied
        self.blocking: str | None = None  # why saves went back to blocking during the run
        self._prepare: Callable[[], None] | None = None  # once, after the first step (attach)

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ctrain-checkpoint-writer", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:  # after a failure the checkpoint's later jobs are not run
                    job()
            except BaseException as exc:  # handed to the main thread by check()
                self._error = exc
            finally:
                self._jobs.task_done()

    @property
    def busy(self) -> bool:
        return self._jobs.unfinished_tasks > 0

    def after_step(self) -> None:
        """At each step's end, on the main thread: :meth:`check`; after the first step (the
        optimizer's state exists by then) the staging buffers are reserved in the background."""
        self.check()
        if self._prepare is not None:
            prepare, self._prepare = self._prepare, None
            prepare()

    def check(self) -> None:
        """Raise, on the main thread, what a background job failed with."""
        if self._error is not None:
            error, self._error = self._error, None
            self.directory = None
            raise error

    def wait(self, raise_errors: bool = True) -> None:
        """Until every job submitted is done; then :meth:`check` (unless ``raise_errors`` is false)."""
        if self._thread is not None:
            self._jobs.join()
        if raise_errors:
            self.check()
        self.directory = None

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


def supported(trainer: Any) -> str | None:
    """Why ``trainer`` saves blocking, or None where its checkpoints can be written in the background."""
    args = trainer.args
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP shards the state"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed writes its own checkpoints"
    if args.save_only_model or args.load_best_model_at_end or args.metric_for_best_model or args.push_to_hub:
        return "the Trainer's save options (save_only_model, load_best_model_at_end, metric_for_best_model, push_to_hub)"
    from transformers import PreTrainedModel

    if not isinstance(_unwrapped(trainer), (PreTrainedModel, *_peft_model())):
        return "the model is neither a transformers nor a PEFT model"
    return None


def _peft_model() -> tuple[type, ...]:
    """PEFT's model class where PEFT is imported: a run without adapters never imports it (ctrain.train.stack)."""
    peft = sys.modules.get("peft")
    return (peft.PeftModel,) if peft is not None else ()


def _unwrapped(trainer: Any) -> Any:
    """The model ``save_pretrained`` is called on: without DDP's or torch.compile's wrapper."""
    return trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)


def attach(trainer: Any, writer: Writer) -> str | None:
    """Give ``trainer`` (an :class:`AsyncSaves`) its writer; returns why it keeps blocking saves, or None."""
    why = supported(trainer) if isinstance(trainer, AsyncSaves) else "its class has no background saves"
    if why is None:
        trainer._ctrain_writer = writer
        writer.staging = Staging(pin=trainer.args.device.type == "cuda", device=trainer.args.device)
        writer._prepare = trainer._ctrain_reserve
    return why


#: The share of the host memory still free (the node's, and the job's cgroup limit's) that the
#: staging buffers may take; more, and checkpoints are written with training stopped.
HOST_SHARE = 0.5


def host_room() -> int | None:
    """Bytes this process may still take from the host: the smaller of the node's available memory
    and what its cgroup (a Slurm job's memory limit) has left; None where neither can be read."""
    from ctrain.files import read_regular

    room: list[int] = []
    try:
        for line in read_regular(Path("/proc/meminfo"), 1 << 16).decode().splitlines():
            if line.startswith("MemAvailable:"):
                room.append(int(line.split()[1]) * 1024)
        entry = read_regular(Path("/proc/self/cgroup"), 1 << 16).decode().splitlines()
        unified = [line.split(":", 2)[2] for line in entry if line.startswith("0::")]
        if unified:
            group = Path("/sys/fs/cgroup") / unified[0].lstrip("/")
            limit = read_regular(group / "memory.max", 64).decode().strip()
            if limit.isdigit():
                room.append(int(limit) - int(read_regular(group / "memory.current", 64).decode().strip()))
    except (OSError, ValueError, IndexError):
        pass
    return min(room) if room else None


def _size(*states: Any) -> int:
    return sum(t.numel() * t.element_size() for state in states for t in _tensors(state))


def _peft_keys(model: Any) -> list[str]:
    """The keys of ``model.state_dict()`` that PEFT's ``save_pretrained`` writes (renamed, in the
    file): the ones whose tensors its own selection returns, found by identity."""
    from peft.utils import get_peft_model_state_dict

    state = model.state_dict()
    chosen = {id(tensor) for tensor in get_peft_model_state_dict(model, state_dict=state).values()}
    keys = [key for key, tensor in state.items() if id(tensor) in chosen]
    if len(keys) != len(chosen):  # PEFT made new tensors (not references): stage the whole state
        return list(state)
    return keys


class AsyncSaves:
    """A Trainer mixin: checkpoints staged in host memory and written by a :class:`Writer` (see the
    module's docstring); without a writer (:func:`attach`) the Trainer's own blocking save."""

    _ctrain_writer: Writer | None = None
    _ctrain_peft_keys: list[str] | None = None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        writer = self._ctrain_writer
        try:
            result = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            if writer is not None:
                writer.wait(raise_errors=False)  # the first failure is the one reported
            raise
        if writer is not None:
            writer.wait()
        return result

    def _model_state(self, model: Any) -> dict[str, Any]:
        """The tensors ``save_pretrained`` of ``model`` would write, as live references (staged next):
        an adapter's alone for a PEFT model, whose frozen base is not saved."""
        state = model.state_dict()
        if isinstance(model, _peft_model()):
            if self._ctrain_peft_keys is None:
                self._ctrain_peft_keys = _peft_keys(model)
            return {key: state[key] for key in self._ctrain_peft_keys}
        return state

    def _ctrain_reserve(self) -> None:
        """After the first step (main thread): hand the writer the buffers' shapes to reserve, or
        go back to blocking saves where the host has no room for them."""
        writer = self._ctrain_writer
        if writer is None:
            return
        args = self.args  # type: ignore[attr-defined]
        why = None
        if args.should_save:  # the one rank that writes the tensors, and stages them
            model_state = self._model_state(_unwrapped(self))
            optimizer_state = self.optimizer.state_dict()  # type: ignore[attr-defined]
            need, room = _size(model_state, optimizer_state), host_room()
            if room is not None and need > HOST_SHARE * room:
                why = (f"its {need / 2**20:.0f} MiB of tensors to copy are more than {HOST_SHARE:.0%} of the "
                       f"host memory left ({room / 2**20:.0f} MiB)")  # fmt: skip
        if args.world_size > 1:  # every rank saves the same way, or their checkpoints' collectives differ
            import torch.distributed as dist

            box = [why]
            dist.broadcast_object_list(box, src=0)
            why = box[0]
        if why is not None:
            writer.blocking = why
            if args.should_save:
                log.warning("checkpoints are written with training stopped: %s", why)
        if why is not None or not args.should_save:
            return
        staging = writer.staging
        assert staging is not None

        def reserve() -> None:
            staging.reserve("model", model_state)
            staging.reserve("optimizer", optimizer_state)

        writer.submit(reserve)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        writer = self._ctrain_writer
        if (writer is None or writer.blocking is not None or trial is not None
                or getattr(self, "hp_search_backend", None) is not None):  # fmt: skip
            return super()._save_checkpoint(model, trial)  # type: ignore[misc]
        import torch
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        writer.wait()  # the save before is complete (or its failure raised here)
        self.store_flos()
        output_dir = Path(self._get_output_dir(trial=None)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        output_dir.mkdir(parents=True, exist_ok=True)
        args = self.args
        staging = writer.staging
        assert staging is not None
        unwrapped = _unwrapped(self)
        if args.should_save:
            card = getattr(self, "create_model_card", None)
            if card is not None:  # TRL's trainers rewrite the run's model card at each save
                card(model_name=Path(args.output_dir).name if args.hub_model_id is None else args.hub_model_id.split("/")[-1])
            model_state = staging.copy("model", self._model_state(unwrapped))
            optimizer_state = staging.copy("optimizer", self.optimizer.state_dict())
            if self.processing_class is not None:
                self.processing_class.save_pretrained(str(output_dir))
            torch.save(args, output_dir / TRAINING_ARGS_NAME)
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(), output_dir / SCHEDULER_NAME)
        self._save_scaler(str(output_dir))
        self._save_rng_state(str(output_dir))
        if args.should_save:
            exportable = [cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)]
            for cb in exportable:
                name, cb_state = cb.__class__.__name__, cb.state()
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb_state)
                else:
                    self.state.stateful_callbacks[name] = cb_state
            self.state.save_to_json(str(output_dir / TRAINER_STATE_NAME))
        if writer.group is None and args.world_size > 1:
            import torch.distributed as dist

            # Every rank saves at the same steps, so every rank gets here for the first save together.
            writer.group = dist.new_group(backend="gloo", timeout=_timeout(args))
        writer.directory = output_dir
        if not args.should_save:
            return

        def write() -> None:
            unwrapped.save_pretrained(str(output_dir), state_dict=model_state, is_main_process=True)
            # Through Python's file: its open and writes let go of the interpreter while they wait
            # on the file system (torch.save of a path holds it while it opens the file).
            with (output_dir / OPTIMIZER_NAME).open("wb") as handle:
                torch.save(optimizer_state, handle)

        writer.submit(write)
        writer.staged = _size(model_state, optimizer_state)


def _timeout(args: Any) -> Any:
    import datetime

    seconds = getattr(args, "ddp_timeout", None) or 1800
    return datetime.timedelta(seconds=seconds)
