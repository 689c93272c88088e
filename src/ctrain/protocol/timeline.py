"""The job's timeline, the status lines of its log and the image cache's entry files (ctrain.protocol)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ctrain.protocol.env import RESTART_PATTERN

# --- the job's timeline ------------------------------------------------------------------------------

# Event -> its arguments. The library's events (ctrain_mark's calls; a test holds these names to them).
BATCH_EVENTS: dict[str, tuple[str, ...]] = {
    "start": ("submitted", "nodes", "gpus_per_node"),
    "preflight": ("seconds", "unfit"),  # the node checks: how long, how many unfit lines
    "launched": (),
    "exited": ("rc",),
    "decided": ("outcome", "cause"),
}
# What rank 0 of the trainer marks (ctrain.train.goodput.mark).
TRAINER_EVENTS: dict[str, tuple[str, ...]] = {
    "process": (),
    "checked": ("seconds",),  # the rank checks: how long
    "data": (),
    "train": ("step",),
    "step": ("step", "tokens_per_second", "mfu"),
    "save": ("step", "seconds"),
    "eval": ("seconds",),
    "end": ("step",),
}
EVENTS = {**BATCH_EVENTS, **TRAINER_EVENTS}
# The causes a `decided` mark names (ctrain_decide's), besides `rank-CAUSE` (a rank's own record, its
# CAUSE the record's).
DECISION_CAUSES = ("TERM", "USR1", "node-lost", "rank-failed", "hang", "step-failed", "preflight", "none")
RANK_CAUSE_PREFIX = "rank-"

# The largest number a timeline's event may carry (an epoch, a step, a rate, seconds): far above any
# real one, and small enough that sums and products of a whole timeline of them stay finite.
MAX_NUMBER = 1e15


def number(text: str) -> float | None:
    """A timeline's number, or None: not a number, NaN, infinite or beyond :data:`MAX_NUMBER`."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if abs(value) <= MAX_NUMBER else None  # NaN and inf too: a line nobody wrote by hand


@dataclass(frozen=True)
class Mark:
    """One line of the timeline: EVENT (a key of :data:`EVENTS`) of run RESTART at WHEN (seconds since
    the epoch), with its arguments as words."""

    when: float
    restart: int
    event: str
    args: tuple[str, ...] = ()

    def line(self) -> str:
        words = " ".join(self.args)
        return f"{self.when:.3f} {self.restart} {self.event}{' ' + words if words else ''}\n"

    @classmethod
    def parse(cls, line: str) -> Mark | None:
        """The mark on LINE; None for a line no ctrain wrote (it is skipped, and counted)."""
        words = line.split()
        when = number(words[0]) if words else None
        if len(words) < 3 or when is None or not RESTART_PATTERN.fullmatch(words[1]) or words[2] not in EVENTS:
            return None
        return cls(when, int(words[1]), words[2], tuple(words[3:]))


def append_mark(path: Path, mark: Mark) -> None:
    """Append MARK to the timeline at PATH (one write of one line: marks from several writers interleave whole)."""
    with open(path, "a") as handle:
        handle.write(mark.line())


# --- the status lines the library prints into the job's log ------------------------------------------

LOG_PREFIX = "ctrain: "  # every line the library prints itself
FAILURE = "failure: "  # what went wrong, one line per decision (`ctrain: failure: ...`)
REQUEUEING = "requeueing"  # what was done about it: `ctrain: requeueing ...`, `ctrain: not requeueing: ...`
ERROR = "error: "  # the library's own error, before anything ran (ctrain_die, exit 2)
# The failure lines, and an older library's hang line (`the step was ended because ...`). Only
# lines that start so, so a training log full of other text cannot be mistaken for them (a rank's
# lines carry srun's `N: ` label).
FAILURE_LINE = re.compile(r"^ctrain: (failure: .*|the step was ended because .*)$", re.MULTILINE)
DECISION_LINE = re.compile(r"^ctrain: ((?:not )?requeueing.*)$", re.MULTILINE)
# A lost node's run continued as a new job (sbatch/lib/chain.sh, ctrain_continue): JOB, and the RUN it
# goes on; ``ctrain status``, ``logs`` and ``cancel`` follow a run from job to job through it.
CONTINUED_LINE = re.compile(r"^ctrain: requeueing as job ([0-9]{1,12}) \(restart [0-9]+ of run ([0-9]{1,12})\)",
                            re.MULTILINE)  # fmt: skip


def continued_as(text: str) -> str | None:
    """The job that continues the run of the job whose log is TEXT (its last continuation line), else None."""
    found = list(CONTINUED_LINE.finditer(text))
    return found[-1].group(1) if found else None


def status_events(text: str) -> list[str]:
    """The job's last failure and the last requeue decision after it, as the batch script logged them
    (without ``ctrain: ``)."""
    failures = list(FAILURE_LINE.finditer(text))
    start = failures[-1].end() if failures else 0
    decisions = list(DECISION_LINE.finditer(text, start))
    return [m.group(1) for m in ([failures[-1]] if failures else []) + ([decisions[-1]] if decisions else [])]


# --- the node-local image cache (CTRAIN_IMAGE_CACHE) -------------------------------------------------

# The library's image program (sbatch/lib/programs/image-prepare.sh) unpacks an image into an entry,
# CACHE/KEY/; `ctrain cache` (ctrain.image.cache) lists and clears them, with the same locks.
IMAGE_CACHE_LOCK = "lock"  # the cache's: one job at a time unpacks or evicts on a node
IMAGE_ENTRY_ROOTFS = "rootfs"  # the unpacked image (a directory)
IMAGE_ENTRY_COMPLETE = "complete"  # written last; a running task holds a shared lock on it
IMAGE_ENTRY_USED = "used"  # touched at each job's start
IMAGE_ENTRY_IMAGE = "image"  # the file the entry came from
IMAGE_ENTRY_SIZE = "size-kib"  # the unpacked size
IMAGE_ENTRY_UNPACK_LOG = "unpack.log"  # while it unpacks
# The files an entry holds besides rootfs/, and nothing else: a directory holding more is not an entry.
IMAGE_ENTRY_FILES = frozenset({IMAGE_ENTRY_COMPLETE, IMAGE_ENTRY_USED, IMAGE_ENTRY_IMAGE, IMAGE_ENTRY_SIZE,
                               IMAGE_ENTRY_UNPACK_LOG})  # fmt: skip
IMAGE_KEY = re.compile(r"[0-9a-f]{16}")  # an entry's name, as ctrain_image_key makes it: 16 hex digits of a sha256
