"""What a training script of your own gets by opting in, when the sbatch scripts run it (``-- SCRIPT``).

Without it a script still gets the image, the launch, the rendezvous, requeue at the time limit
(Slurm's USR1 warning is passed to its processes) and the handling of a lost node or a killed rank.
With it, a few lines give a script what a recipe run has:

    from ctrain.train import script as ctrain_job

    ctrain_job.start()                        # why this rank ends is recorded; USR1/TERM are caught
    for step in range(start, steps):
        train_one_step()
        ctrain_job.beat(step)                 # the hang watchdog's heartbeat
        if ctrain_job.stop_requested():       # a preemption signal reached any rank
            save_checkpoint(step)
            ctrain_job.exit_preempted()       # exit 75: the job is requeued and resumes
    ctrain_job.finished()

A transformers ``Trainer`` gets all of it from one line: ``trainer.add_callback(ctrain.train.hf.Callback())``.
Stdlib only (torch is used when it is there, for the ranks' agreement), so it costs a script nothing.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from ctrain import protocol
from ctrain.train import exits
from ctrain.train.artifacts import PREEMPTED_EXIT_CODE
from ctrain.train.logs import deadline, exit_process

log = logging.getLogger("ctrain.train")

HEARTBEAT_ENV = protocol.HEARTBEATS_ENV  # where the library wants this rank's heartbeat
SIGNALS = ("SIGUSR1", "SIGTERM")


class HeartbeatFile:
    """``DIRECTORY/rank-R`` ("STEP HOST PID", :class:`ctrain.protocol.HeartbeatLine`), rewritten as this
    rank makes progress, for the job's watchdog (``ctrain_watchdog``), which ends the step when a rank
    goes silent.

    Only the training loop beats, never a thread of its own, so a rank stuck in a collective goes
    silent too. Written to a hidden file and renamed, so the watchdog never reads half a line.
    Progress beats at most once every :attr:`EVERY` seconds: the directory is on the cluster's
    shared filesystem, and 128 ranks renaming a file at every 200 ms step would be a metadata load
    the watchdog (which counts in seconds) has no use for.
    """

    EVERY = 1.0

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / protocol.rank_file(rank)
        self.partial = directory / f".{protocol.rank_file(rank)}"
        self.host = socket.gethostname()
        self.last = -math.inf
        self.warned = False

    def beat(self, step: int) -> None:
        self._write(step)
        self.last = time.monotonic()

    def progress(self, step: int) -> None:
        """A beat, unless one was written less than :attr:`EVERY` seconds ago."""
        if time.monotonic() - self.last >= self.EVERY:
            self.beat(step)

    def done(self) -> None:
        """This rank has finished (the watchdog stops expecting steps from it)."""
        self._write(None)

    def _write(self, step: int | None) -> None:
        try:
            self.partial.write_text(protocol.HeartbeatLine(step, self.host, os.getpid()).line())
            os.replace(self.partial, self.path)
        except OSError as exc:
            # A full file system (the project's: the outputs may be elsewhere, with room): a new file needs
            # space, a new time stamp does not, and the watchdog goes by the time stamp. Raised, the error
            # would end a run that could go on; swallowed, the watchdog would end it as hung.
            try:
                os.utime(self.path)
            except OSError:
                raise exc from None
            if not self.warned:
                self.warned = True
                log.warning("cannot write the heartbeat %s (%s); its time stamp is renewed instead, which is what "
                            "the job's watchdog reads", self.path, exc.strerror or exc)  # fmt: skip


def heartbeat_file() -> HeartbeatFile | None:
    """This rank's heartbeat file under the sbatch scripts (``$CTRAIN_HEARTBEATS``), else None."""
    from ctrain.train.logs import rank_from_env

    directory = protocol.heartbeats_dir()
    return HeartbeatFile(directory, rank_from_env()) if directory is not None else None


def record_exits() -> None:
    """Record why this rank ends (``CTRAIN_EXITS``) when an exception ends the script, then report it as Python does."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, trace: TracebackType | None) -> None:
        exits.record(exc.with_traceback(trace))
        previous(kind, exc, trace)

    sys.excepthook = hook


_state: dict[str, object] = {"received": 0, "heartbeat": None}


def start(signals: tuple[str, ...] = SIGNALS) -> None:
    """Opt in: record why this rank ends, catch the preemption signals, start the heartbeat."""
    record_exits()
    for name in signals:
        signal.signal(getattr(signal, name), _received)
    _state["heartbeat"] = heartbeat_file()


def _received(number: int, frame: object) -> None:
    _state["received"] = number


def beat(step: int) -> None:
    """This rank finished STEP (at most one write a second)."""
    heartbeat = _state["heartbeat"]
    if isinstance(heartbeat, HeartbeatFile):
        heartbeat.progress(step)


def stop_requested() -> bool:
    """Whether a preemption signal reached any rank (all ranks get the same answer: call it on every
    rank at the same point of each step, as it is a collective when torch.distributed is running)."""
    mine = int(_state["received"])  # type: ignore[call-overload]
    dist = process_group()
    if dist is None:
        return mine != 0
    import torch

    flag = torch.tensor([mine], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) != 0


def exit_preempted() -> None:
    """After the checkpoint, on every rank: wait for the others (so none is still writing when the
    launcher ends them), record it, close the process group, and exit with the code that asks the
    batch script to requeue the job."""
    dist = process_group()
    if dist is not None:
        dist.barrier()
    exits.record(None, PREEMPTED_EXIT_CODE)
    close_process_group(PREEMPTED_EXIT_CODE)
    exit_process(PREEMPTED_EXIT_CODE)


def process_group() -> Any:
    """``torch.distributed`` while this process is in a process group, else None (torch is not imported here)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed


def close_process_group(code: int = 0) -> None:
    """End the process group on an orderly exit, while the interpreter is still whole.

    Left to interpreter shutdown, gloo's worker threads can outlive the objects they hold and the
    process aborts ("terminate called without an active exception", SIGABRT) after a run that
    succeeded, and torchrun reports the run as failed. Only for exits every rank reaches together
    (after a barrier): on an error another rank may still be inside a collective. Closing can
    itself stay blocked in a backend thread (pytorch#75097); past :data:`logs.SHUTDOWN_SECONDS`
    the rank exits with CODE, the outcome it had already reached.
    """
    dist = process_group()
    if dist is not None:
        with deadline("closing the process group", code):
            dist.destroy_process_group()




def finished() -> None:
    """The run is over on this rank: the watchdog stops expecting steps from it."""
    heartbeat = _state["heartbeat"]
    if isinstance(heartbeat, HeartbeatFile):
        heartbeat.done()
