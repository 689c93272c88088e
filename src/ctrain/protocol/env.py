"""The environment the library exports to the tasks, and the exit codes (ctrain.protocol says the words)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# A run's number (SLURM_RESTART_COUNT) in a record: ASCII digits only (int() refuses "²", which
# str.isdigit takes), and few enough for int().
RESTART_PATTERN = re.compile(r"[0-9]{1,9}")

# --- the environment the library exports to the tasks (and so to every rank) ---------------------

RUN_DIR_ENV = "CTRAIN_RUN_DIR"  # the run's directory, relative to the project directory (the working directory)
RUN_DIR_OLD_ENV = "CTRAIN_PIDS"  # the same, as the library exports it to tasks and ranks
HEARTBEATS_ENV = "CTRAIN_HEARTBEATS"  # RUN_DIR/heartbeat
EXITS_ENV = "CTRAIN_EXITS"  # RUN_DIR/exit
TIMELINE_ENV = "CTRAIN_TIMELINE"  # .ctrain/RUN.timeline, kept across requeues and continuations
PREFLIGHT_ENV = "CTRAIN_PREFLIGHT"  # off | quick | full: the node checks and the rank checks
REQUEUE_EXIT_ENV = "CTRAIN_REQUEUE_EXIT"  # the exit code that asks for a requeue (EXIT_REQUEUE)
STORE_ENV = "CTRAIN_STORE"  # HOST:PORT of the rendezvous store the first node's task hosts
IMAGE_CACHE_ENV = "CTRAIN_IMAGE_CACHE"  # the node-local image cache (IMAGE_ENTRY_FILES)
RESTART_ENV = "SLURM_RESTART_COUNT"  # Slurm's: which run of the job this is (0 for the first)
RUN_RESTARTS_ENV = "CTRAIN_RUN_RESTARTS"  # the run's restarts before this job (its continuations'), set by ctrain_continue
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
    Variable(TIMELINE_ENV, "`.ctrain/RUN.timeline`", "the library", "`ctrain_mark`, rank 0 (`goodput.mark`)"),
    Variable(PREFLIGHT_ENV, "`off`, `quick` or `full`", "`ctrain submit` (slurm.preflight), else the library's default",
             "`ctrain_preflight` (the node checks), `ctrain.train.health` (the rank checks)"),
    Variable(REQUEUE_EXIT_ENV, "75 (`EXIT_REQUEUE`)", "the library's default", "`ctrain_decide`, `ctrain_failed_node`"),
    Variable(STORE_ENV, "`HOST:PORT` of the rendezvous store", "the library, for the first node's task",
             "the first node's task"),
    Variable(RESTART_ENV, "which run of the job this is", "Slurm", "`ctrain_mark`, `ctrain_transition`, `goodput.mark`"),
    Variable(RUN_RESTARTS_ENV, "the run's restarts before this job (a continuation's)", "`ctrain_continue`, for the "
             "continuation it submits", "`ctrain_restarts`, and so `ctrain_mark`; `goodput.mark` (`restart_count`)"),
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
    """Which start of the run this is, as the library counts it (``ctrain_restarts``): its continuations'
    restarts before this job (``CTRAIN_RUN_RESTARTS``) and Slurm's requeues of this job
    (``SLURM_RESTART_COUNT``); a value that is not a count is 0."""
    found = 0
    for name in (RUN_RESTARTS_ENV, RESTART_ENV):
        value = env.get(name, "0")
        found += int(value) if RESTART_PATTERN.fullmatch(value) else 0
    return found


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
