"""What the batch script and the ranks say to each other, named once.

The sbatch library (bash, ``sbatch/lib/``) supervises each job on the cluster's hosts; the ranks in
the container (``ctrain train``, or a script of your own that opted in: :mod:`ctrain.train.script`)
and the commands on the login node (``ctrain status``, ``ctrain report``) talk with it through
nothing but these: files in the project directory, which every node mounts (:data:`JOB_FILES`,
docs/architecture.md draws the table from it), the environment the library exports to the tasks
(:data:`VARIABLES`), exit codes (:data:`EXIT_CODES`) and the status lines the library prints into
the job's log (:func:`status_events`). Every Python writer and reader of them goes through this
module; ``tests/unit/test_protocol.py`` has Python write each record through it and the real bash
library read it and decide, and the reverse where bash writes.

Words:

- **the run's directory**: ``.ctrain/JOBID/`` in the project (:func:`run_dir_name`), one run's
  shared files, cleared when a run starts and once it is decided. Its variable is
  ``CTRAIN_RUN_DIR``; ``CTRAIN_PIDS`` is the same directory under its name since library version 1
  (when it held only the launchers' PIDs): the library exports both with the same value, and every
  reader here takes ``CTRAIN_RUN_DIR`` and falls back to ``CTRAIN_PIDS`` (a job started by an older
  library, or an older project's copy of it, exports only that).
- **the node checks**: what the library runs on each node's host before a run's training step
  (``ctrain_preflight``, its program ``sbatch/lib/programs/node-checks.sh``).
- **the rank checks**: what every rank of ``ctrain train`` runs once its process group is up
  (:mod:`ctrain.train.health`: the driver, GPU memory and rate, an all-reduce).
  The library's lines and ``CTRAIN_PREFLIGHT`` (``off | quick | full``, which sets both) call the
  two together "the preflight"; both write the ``unfit`` file, and a node named there is left out of
  the requeued job.
- **the checks before a run** (:mod:`ctrain.train.preflight`: ``ctrain submit`` and ``ctrain train
  --check`` checking what a recipe points at) are none of the protocol.

Standard library only, importing nothing of ctrain: the trainer, a user's own script and the login
node's commands all import it, and it sits in the foundation (docs/architecture.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# A run's number (SLURM_RESTART_COUNT) in a record: ASCII digits only (int() refuses "²", which
# str.isdigit takes), and few enough for int().
_RESTART = re.compile(r"[0-9]{1,9}")

# --- the environment the library exports to the tasks (and so to every rank) ---------------------

RUN_DIR_ENV = "CTRAIN_RUN_DIR"  # the run's directory, relative to the project directory (the working directory)
RUN_DIR_OLD_ENV = "CTRAIN_PIDS"  # the same, its name since version 1: still exported, read when the new one is not
HEARTBEATS_ENV = "CTRAIN_HEARTBEATS"  # RUN_DIR/heartbeat
EXITS_ENV = "CTRAIN_EXITS"  # RUN_DIR/exit
TIMELINE_ENV = "CTRAIN_TIMELINE"  # .ctrain/JOBID.timeline, kept across requeues
PREFLIGHT_ENV = "CTRAIN_PREFLIGHT"  # off | quick | full: the node checks and the rank checks
REQUEUE_EXIT_ENV = "CTRAIN_REQUEUE_EXIT"  # the exit code that asks for a requeue (EXIT_REQUEUE)
STORE_ENV = "CTRAIN_STORE"  # HOST:PORT of the rendezvous store the first node's task hosts
IMAGE_CACHE_ENV = "CTRAIN_IMAGE_CACHE"  # the node-local image cache (IMAGE_ENTRY_FILES)
RESTART_ENV = "SLURM_RESTART_COUNT"  # Slurm's: which run of the job this is (0 for the first)
NODE_NAME_ENV = "SLURMD_NODENAME"  # Slurm's: this node's name, as the job's node list spells it
JOB_ID_ENV = "SLURM_JOB_ID"

PREFLIGHT_LEVELS = ("off", "quick", "full")


@dataclass(frozen=True)
class Variable:
    """One variable both sides read: what it holds, who sets it, who reads it."""

    name: str
    holds: str
    set_by: str
    read_by: str


VARIABLES: tuple[Variable, ...] = (
    Variable(RUN_DIR_ENV, "the run's directory, `.ctrain/JOBID`", "the library (beside `CTRAIN_PIDS`)",
             "every Python reader first (`run_dir`)"),
    Variable(RUN_DIR_OLD_ENV, "the run's directory (its name since version 1)", "the library, exported to the tasks",
             "each node's task (`NODE.pid`, `step`, `node-N.done`); Python when `CTRAIN_RUN_DIR` is unset"),
    Variable(HEARTBEATS_ENV, "`RUN_DIR/heartbeat`", "the library", "each rank (`heartbeat/rank-R`)"),
    Variable(EXITS_ENV, "`RUN_DIR/exit`", "the library", "each rank (`exit/rank-R`)"),
    Variable(TIMELINE_ENV, "`.ctrain/JOBID.timeline`", "the library", "`ctrain_mark`, rank 0 (`goodput.mark`)"),
    Variable(PREFLIGHT_ENV, "`off`, `quick` or `full`", "`ctrain submit` (slurm.preflight), else the library's default",
             "`ctrain_preflight` (the node checks), `ctrain.train.health` (the rank checks)"),
    Variable(REQUEUE_EXIT_ENV, "75 (`EXIT_REQUEUE`)", "the library's default", "`ctrain_decide`, `ctrain_failed_node`"),
    Variable(STORE_ENV, "`HOST:PORT` of the rendezvous store", "the library, for the first node's task",
             "the first node's task"),
    Variable(RESTART_ENV, "which run of the job this is", "Slurm", "`ctrain_mark`, `ctrain_transition`, `goodput.mark`"),
    Variable(NODE_NAME_ENV, "this node's name in the job's node list", "Slurm",
             "the node checks, the rank checks (`health.host_name`)"),
)  # fmt: skip


def _path(env: Mapping[str, str], *names: str) -> Path | None:
    for name in names:
        value = env.get(name)
        if value:
            return Path(value)
    return None


def run_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """The run's directory under the library (``CTRAIN_RUN_DIR``, else ``CTRAIN_PIDS``); None outside a job."""
    return _path(env, RUN_DIR_ENV, RUN_DIR_OLD_ENV)


def heartbeats_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where each rank's heartbeat goes (``CTRAIN_HEARTBEATS``); None outside a job."""
    return _path(env, HEARTBEATS_ENV)


def exits_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where each rank's exit record goes (``CTRAIN_EXITS``); None outside a job."""
    return _path(env, EXITS_ENV)


def timeline_path(env: Mapping[str, str] = os.environ) -> Path | None:
    """The job's timeline (``CTRAIN_TIMELINE``); None outside a job."""
    return _path(env, TIMELINE_ENV)


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """Which run of the job this is (``SLURM_RESTART_COUNT``, 0 when unset or not a count)."""
    value = env.get(RESTART_ENV, "0")
    return int(value) if _RESTART.fullmatch(value) else 0


# --- exit codes --------------------------------------------------------------------------------------

EXIT_OK = 0
EXIT_ERROR = 1  # any other error (and torchrun's code for any failed worker)
EXIT_CONFIG = 2  # a recipe, setting or flag refused before any work (`error:`; the library's ctrain_die)
EXIT_TOOL = 3  # the image or machine lacks a tool or package (cause `environment`)
EXIT_NONFINITE = 65  # EX_DATAERR: a NaN or infinite loss, stopped before saving it
EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped at a signal after a complete checkpoint, "requeue me"
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_KILLED = 137  # 128 + SIGKILL: srun of a killed step; the code a sentinel decides with


@dataclass(frozen=True)
class ExitCode:
    code: int
    meaning: str
    requeue: str


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(EXIT_OK, "finished (the final model is complete), or already finished", "no"),
    ExitCode(EXIT_ERROR, "any other error", "once per job, as a failed rank, unless the rank's record says end"),
    ExitCode(EXIT_CONFIG, "a recipe or setting refused before any work", "no (cause `config`)"),
    ExitCode(EXIT_TOOL, "a tool or package the recipe needs is missing", "no (cause `environment`)"),
    ExitCode(EXIT_NONFINITE, "a NaN or infinite loss or gradient norm, stopped before saving it", "no (`nonfinite`)"),
    ExitCode(EXIT_REQUEUE, "stopped at a preemption signal after a complete checkpoint", "yes (`CTRAIN_REQUEUE_EXIT`)"),
    ExitCode(EXIT_INTERRUPTED, "SIGINT", "once per job (`interrupted`)"),
    ExitCode(EXIT_KILLED, "the step's srun or a rank SIGKILLed (also what a sentinel decides with)", "as the facts say"),
)  # fmt: skip


# --- the job's files ---------------------------------------------------------------------------------

STATE_DIR = ".ctrain"  # in the project directory: every job's run directory and the files beside it
HEARTBEAT_DIR = "heartbeat"  # in the run's directory (CTRAIN_HEARTBEATS)
EXIT_DIR = "exit"  # in the run's directory (CTRAIN_EXITS)
UNFIT_FILE = "unfit"
STATE_FILE = "state"
HUNG_FILE = "hung"
LOST_FILE = "lost"
STEP_FILE = "step"
BATCH_ALIVE_FILE = "batch-alive"
CLAIM_DIR = "claim"
NCCL_LOG_PREFIX = "nccl-preflight"  # NCCL_DEBUG_FILE's name, when the rank checks set it


def run_dir_name(job: str) -> str:
    """The run's directory of job JOB, relative to the project directory."""
    return f"{STATE_DIR}/{job}"


def rank_file(rank: int | str) -> str:
    """A rank's heartbeat or exit record, in HEARTBEAT_DIR or EXIT_DIR."""
    return f"rank-{rank}"


def node_done_file(node: int | str) -> str:
    """What node N's task writes once its launcher ended (N is SLURM_NODEID)."""
    return f"node-{node}.done"


def pid_file(host: str) -> str:
    """The launcher's PID on HOST (``uname -n``)."""
    return f"{host}.pid"


def timeline_file(job: str) -> str:
    """The job's timeline, beside the run's directory (in STATE_DIR)."""
    return f"{job}.timeline"


def report_file(job: str) -> str:
    """``ctrain report``'s account as JSON, beside the timeline."""
    return f"{job}.goodput.json"


def retried_file(job: str) -> str:
    """The job's one retry after a failed or hung rank, used: beside the run's directory."""
    return f"{job}.retried"


def node_check_file(job: str) -> str:
    """The token the node checks read back from the shared file system, beside the run's directory."""
    return f"{job}.preflight"


@dataclass(frozen=True)
class JobFile:
    """One file of a job: its name (relative to the run's directory; ``../`` beside it), its
    content, who writes and who reads it, and when."""

    name: str
    format: str
    writers: str
    readers: str
    when: str


JOB_FILES: tuple[JobFile, ...] = (
    JobFile(pid_file("NODE"), "`PID`", "each node's task (`CTRAIN_TASK`): its launcher's",
            "`ctrain_forward` (USR1 to the workers), `ctrain_hung` (ends a hung node's workers)", "at launch"),
    JobFile(STEP_FILE, "`STEP-ID`", "each node's task: the training step's id", "`ctrain_kill_step` (guard, sentinel)",
            "at launch"),
    JobFile(node_done_file("N"), "`CODE HOST` (`NodeDone`)", "each node's task, once its launcher ended",
            "`ctrain_guard`, `ctrain_failed_node`, the first node's store host", "at the launcher's end"),
    JobFile(f"{HEARTBEAT_DIR}/{rank_file('R')}", "`STEP HOST PID`, at its end `done HOST PID` (`HeartbeatLine`)",
            "each rank (`ctrain.train.script.HeartbeatFile`: the trainer's, a script's that opted in)",
            "`ctrain_watchdog` (its time stamp, and `done`), `ctrain_hung`, `ctrain_forward` (did a script opt in?)",
            "every step, eval batch, save"),
    JobFile(f"{EXIT_DIR}/{rank_file('R')}", "`CODE CAUSE RETRY HOST MESSAGE` (`ExitRecord`)",
            "each rank (`ctrain.train.exits`)", "`ctrain_rank_exit` (in `ctrain_decide`)", "once, as the rank ends"),
    JobFile(HUNG_FILE, "`RANK:IDLE ...`", "`ctrain_hung` (the watchdog): the ranks that stopped", "`ctrain_decide`",
            "when a rank stops"),
    JobFile(LOST_FILE, "`NODE ...`, a line per finder", "`ctrain_guard`, `ctrain_silent` (the watchdog), "
            "`ctrain_sentinel`: the nodes that do not answer", "`ctrain_decide`",
            "after a launcher failed; after `CTRAIN_NODE_CHECK` seconds without a step; when the batch host is lost"),
    JobFile(UNFIT_FILE, "`HOST CHECK MESSAGE` per failed check, appended (`UnfitLine`)",
            "the node checks (`ctrain_preflight`) and the rank checks (rank 0 of `ctrain train`: `ctrain.train.health`)",
            "`ctrain_decide` (`ctrain_unfit_nodes`: only the job's own node names count)",
            "before the step; after the rank checks"),
    JobFile(f"{NCCL_LOG_PREFIX}.HOST.PID", "NCCL's INFO lines",
            "NCCL in each rank, when the rank checks set `NCCL_DEBUG_FILE` (the job set no `NCCL_DEBUG`)",
            "the rank checks on rank 0 (`ctrain.train.health.nccl_transports`)", "once the first collective ran"),
    JobFile(STATE_FILE, "`RESTART STATE` (`RunState`; the run's life, below)", "`ctrain_transition` only",
            "`ctrain_state` (`ctrain_decide`, `ctrain_sentinel`)", "at each transition"),
    JobFile(BATCH_ALIVE_FILE, "`COUNT`", "`ctrain_alive` on the batch host", "`ctrain_sentinel` on the second "
            "(and last) node", "every 2 s until the decision"),
    JobFile(f"{CLAIM_DIR}/", "a directory", "the first `ctrain_sentinel` to decide (`mkdir`, atomic on shared "
            "file systems)", "the other sentinel, which then does nothing", "once, when the batch host is gone"),
    JobFile(f"../{node_check_file('JOBID')}", "`TOKEN`", "`ctrain_preflight`: a token each node must read back",
            "the node checks on every node", "before the step"),
    JobFile(f"../{retried_file('JOBID')}", "empty", "`ctrain_retry_once`", "`ctrain_retry_once` of the requeued run",
            "kept across requeues; removed when the job ends"),
    JobFile(f"../{timeline_file('JOBID')}", "`EPOCH RESTART EVENT ARG...`, appended (`Mark`, `EVENTS`)",
            "`ctrain_mark` (the batch script, or a sentinel deciding in its place) and rank 0 "
            "(`ctrain.train.goodput.mark`)", "`ctrain report JOB`; rank 0 at the end of a finished run",
            "every run's edges and the trainer's progress; kept after the job"),
    JobFile(f"../{report_file('JOBID')}", "JSON", "`ctrain report JOB`", "you", "when the report runs"),
)  # fmt: skip


def job_files_table() -> str:
    """:data:`JOB_FILES` as the Markdown table docs/architecture.md holds (a test keeps them equal)."""
    lines = ["| file | content | written by | read by | when |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{f.name}` | {f.format} | {f.writers} | {f.readers} | {f.when} |" for f in JOB_FILES]
    return "\n".join(lines) + "\n"


def write_whole(path: Path, text: str) -> None:
    """Write TEXT to PATH whole or not at all: a hidden file beside it, renamed (a reader on another
    node never sees half a line)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


# --- the records: one line each ----------------------------------------------------------------------

MESSAGE_CHARS = 300  # a record's message, as the batch script prints it


def one_line(text: str) -> str:
    """TEXT as one printable line of at most :data:`MESSAGE_CHARS` characters (the batch script prints it)."""
    words = " ".join(text.split())
    clean = "".join(c if c.isprintable() else "?" for c in words)
    return clean if len(clean) <= MESSAGE_CHARS else clean[: MESSAGE_CHARS - 3] + "..."


def word(text: str) -> str:
    """TEXT as one word of a record (a host, a check, a cause): spaces become ``_``; empty, ``-``."""
    return one_line(text).replace(" ", "_") or "-"


_INT = re.compile(r"-?[0-9]{1,18}")


def _int(text: str) -> int | None:
    return int(text) if _INT.fullmatch(text) else None


RETRY, END = "retry", "end"


@dataclass(frozen=True)
class ExitRecord:
    """``exit/rank-R``: why a rank ended. RETRY (``retry`` or ``end``) says whether a requeue can change
    the outcome; ``ctrain_rank_exit`` ends the job on the first record (by time) with a code other
    than 0 and ``end``, naming ``rank-CAUSE``. MESSAGE is only ever printed."""

    code: int
    cause: str
    retry: bool
    host: str
    message: str = ""

    def line(self) -> str:
        words = f"{self.code} {word(self.cause)} {RETRY if self.retry else END} {word(self.host)}"
        return f"{words} {one_line(self.message)}".rstrip() + "\n"

    @classmethod
    def parse(cls, line: str) -> ExitRecord | None:
        words = line.strip().split(" ", 4)
        if len(words) < 4 or _int(words[0]) is None or words[2] not in (RETRY, END):
            return None
        return cls(int(words[0]), words[1], words[2] == RETRY, words[3], words[4] if len(words) > 4 else "")


def write_exit(directory: Path, rank: int, record: ExitRecord) -> Path:
    """RECORD as rank RANK's file in DIRECTORY (CTRAIN_EXITS), written whole."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / rank_file(rank)
    write_whole(path, record.line())
    return path


DONE = "done"  # a heartbeat's first word once the rank's run is over


@dataclass(frozen=True)
class HeartbeatLine:
    """``heartbeat/rank-R``: the last step this rank finished (None: its run is over, ``done``), on
    HOST, by process PID. The watchdog goes by the file's time stamp, and stops expecting steps
    from a rank whose line says ``done``."""

    step: int | None
    host: str
    pid: int

    def line(self) -> str:
        return f"{DONE if self.step is None else self.step} {word(self.host)} {self.pid}\n"

    @classmethod
    def parse(cls, line: str) -> HeartbeatLine | None:
        words = line.split()
        if len(words) != 3 or _int(words[2]) is None or (words[0] != DONE and _int(words[0]) is None):
            return None
        return cls(None if words[0] == DONE else int(words[0]), words[1], int(words[2]))


@dataclass(frozen=True)
class UnfitLine:
    """A line of ``unfit``: HOST failed CHECK, MESSAGE says how. Only the job's own node names count
    (``ctrain_unfit_nodes``); a node named is left out of the requeued job."""

    host: str
    check: str
    message: str

    def line(self) -> str:
        return f"{word(self.host)} {word(self.check)} {one_line(self.message)}".rstrip() + "\n"

    @classmethod
    def parse(cls, line: str) -> UnfitLine | None:
        words = line.strip().split(" ", 2)
        if len(words) < 2:
            return None
        return cls(words[0], words[1], words[2] if len(words) > 2 else "")


def append_unfit(directory: Path, record: UnfitLine) -> Path:
    """Append RECORD to the run's unfit file in DIRECTORY (the node checks append to it too)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / UNFIT_FILE
    with open(path, "a") as handle:
        handle.write(record.line())
    return path


@dataclass(frozen=True)
class NodeDone:
    """``node-N.done``, written by each node's task (bash) once its launcher ended: its exit code and
    the node's ``uname -n``."""

    code: int
    host: str

    def line(self) -> str:
        return f"{self.code} {self.host}\n"

    @classmethod
    def parse(cls, line: str) -> NodeDone | None:
        words = line.split()
        if len(words) != 2 or _int(words[0]) is None:
            return None
        return cls(int(words[0]), words[1])


# A run's states (CTRAIN_LIFE in the library; docs/architecture.md, "A run's life"): a run is
# `starting` until its first transition, and the decided states have no way out.
STATES = ("starting", "running", "ending", "terminating", "deciding", "requeued", "left", "finished", "ended")
DECIDED = ("requeued", "left", "finished", "ended")


@dataclass(frozen=True)
class RunState:
    """``state``: run RESTART of the job is in STATE (``ctrain_transition`` is its only writer; a file
    of another run means this one is ``starting``)."""

    restart: int
    state: str

    def line(self) -> str:
        return f"{self.restart} {self.state}\n"

    @classmethod
    def parse(cls, line: str) -> RunState | None:
        words = line.split()
        if len(words) != 2 or not _RESTART.fullmatch(words[0]) or words[1] not in STATES:
            return None
        return cls(int(words[0]), words[1])


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
        if len(words) < 3 or when is None or not _RESTART.fullmatch(words[1]) or words[2] not in EVENTS:
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


if __name__ == "__main__":  # python -m ctrain.protocol: the table docs/architecture.md holds
    print(job_files_table(), end="")
