"""Why a rank ended, recorded where the batch script reads it.

torchrun reports every worker failure as exit 1, so the batch script cannot tell a NaN stop or a
recipe error (the same again on every retry) from a rank killed by the kernel or a lost peer
(worth a retry). Each rank therefore writes its own record when it ends through Python, and the
batch script (``ctrain_rank_exit`` in sbatch/lib/) decides from those records; the rule for what
is worth retrying lives here, once, as the RETRY word of each record.

One file per rank, ``$CTRAIN_EXITS/rank-R``, one line: ``CODE CAUSE RETRY HOST MESSAGE``
(:class:`ctrain.protocol.ExitRecord`, which writes and reads it), where RETRY is ``retry`` or
``end`` and MESSAGE is the rank's own error line (printable, at most :data:`MESSAGE_CHARS`
characters). A rank killed by a signal writes nothing; the batch script
treats that as before: a killed rank, retried once. Stdlib only: it also runs for a failure while
the recipe is being read, before the training stack is imported.
"""

from __future__ import annotations

import errno
import os
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path

from ctrain import protocol
from ctrain.errors import ConfigError, CtrainError, DiskFull, NodeUnfit, NonFiniteTraining, ToolNotFound
from ctrain.protocol import one_line

EXITS_ENV = protocol.EXITS_ENV  # where the library wants each rank's record
MESSAGE_CHARS = protocol.MESSAGE_CHARS  # the most of a rank's error line its record keeps

#: cause -> whether a requeue can change the outcome (docs/training.md, "Exit codes", lists them).
CAUSES: dict[str, bool] = {
    "done": False,
    "preempted": True,  # stopped at a signal after a checkpoint: the batch script requeues on its own rules
    "nonfinite": False,  # NaN or infinite loss: the same data and settings diverge again
    "config": False,  # a recipe or override the schema refuses
    "environment": False,  # the image lacks a tool or package the recipe needs
    "error": False,  # any other error ctrain raised with a message for the user
    "out-of-memory": False,  # the same batch at the same size does not fit on a retry either
    "disk-full": False,  # a requeue writes to the same full file system
    "exception": False,  # an exception raised in the training code (not inside a collective)
    "peer": True,  # a collective failed: another rank or node failed first, or the network did
    "io": True,  # a file-system or network error other than a full disk: often transient
    "interrupted": True,  # SIGINT
    "unfit": True,  # a node failed the rank checks: the batch script requeues without it (the run's unfit file)
}

# Messages of errors a collective raises when the other side went away (gloo, NCCL, the store).
_PEER_WORDS = ("connection reset by peer", "connection closed by peer", "gloo", "nccl", "processgroup",
               "timed out", "broken pipe", "tcpstore")  # fmt: skip


@dataclass(frozen=True)
class Exit:
    """One rank's end: its exit code, the cause's name (a key of :data:`CAUSES`) and its error line."""

    code: int
    cause: str
    message: str = ""

    @property
    def retry(self) -> bool:
        return CAUSES[self.cause]

    def line(self, host: str) -> str:
        """The record's one line."""
        return protocol.ExitRecord(self.code, self.cause, self.retry, host, self.message).line()


def _in_collective(exc: BaseException) -> bool:
    """Whether EXC came out of torch.distributed, or reads like a lost peer's."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if frames and "/torch/distributed/" in frames[-1].filename.replace(os.sep, "/"):
        return True
    kinds = type(exc).__mro__
    if any(k.__module__.startswith("torch") and (k.__module__.startswith("torch.distributed")
                                                  or k.__name__.startswith("Dist")) for k in kinds):  # fmt: skip
        return True
    text = str(exc).lower()
    return any(word in text for word in _PEER_WORDS)


def classify(exc: BaseException | None, code: int) -> Exit:
    """The record of a rank that returned CODE (EXC None) or raised EXC."""
    if exc is None:
        return Exit(code, "done" if code == 0 else "preempted" if code == protocol.EXIT_REQUEUE else "error")
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        return Exit(code, "done" if code == 0 else "error", one_line("" if exc.code is None else str(exc.code)))
    name = type(exc).__name__
    message = one_line(f"{name}: {exc}" if not isinstance(exc, CtrainError) else str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return Exit(protocol.EXIT_INTERRUPTED, "interrupted", message)
    if isinstance(exc, CtrainError):
        cause = ("nonfinite" if isinstance(exc, NonFiniteTraining) else "config" if isinstance(exc, ConfigError)
                 else "environment" if isinstance(exc, ToolNotFound) else "unfit" if isinstance(exc, NodeUnfit)
                 else "disk-full" if isinstance(exc, DiskFull) else "error")  # fmt: skip
        return Exit(exc.exit_code, cause, message)
    if isinstance(exc, MemoryError) or name == "OutOfMemoryError":
        return Exit(1, "out-of-memory", message)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Exit(1, "disk-full", message)
    if _in_collective(exc):
        return Exit(1, "peer", message)
    if isinstance(exc, OSError):
        return Exit(1, "io", message)
    return Exit(1, "exception", message)


def write(record: Exit, directory: Path, rank: int, host: str | None = None) -> Path:
    """Write RECORD as rank RANK's file in DIRECTORY, whole or not at all (the reader may be on another node)."""
    host = host or socket.gethostname()
    return protocol.write_exit(directory, rank, protocol.ExitRecord(record.code, record.cause, record.retry, host,
                                                                    record.message))  # fmt: skip


def record(exc: BaseException | None, code: int = 0) -> Exit:
    """Classify this rank's end and, under the batch scripts (``$CTRAIN_EXITS`` set), write its record.

    Never raises: a record that cannot be written leaves the batch script to decide as for a killed rank.
    """
    from ctrain.train.logs import rank_from_env

    result = classify(exc, code)
    directory = protocol.exits_dir()
    if directory is not None:
        try:
            write(result, directory, rank_from_env())
        except OSError:
            pass
    return result
