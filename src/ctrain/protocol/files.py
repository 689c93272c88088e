"""The job's files: their names and the table of their writers and readers (ctrain.protocol)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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


def timeline_file(run: str) -> str:
    """The run's timeline (RUN: its first job's id), beside the run's directory (in STATE_DIR)."""
    return f"{run}.timeline"


def report_file(run: str) -> str:
    """``ctrain report``'s account as JSON, beside the timeline."""
    return f"{run}.goodput.json"


def retried_file(run: str) -> str:
    """The run's one retry after a failed or hung rank, used: beside the run's directory."""
    return f"{run}.retried"


def holder_file(run: str) -> str:
    """Which job holds the run (``JOBID``, or ``after JOBID`` while JOBID hands it to its continuation)."""
    return f"{run}.holder"


def jobs_file(run: str) -> str:
    """The run's jobs, its first one and each continuation, one id a line, in order."""
    return f"{run}.jobs"


def run_file(job: str) -> str:
    """The run a continuation JOB belongs to (``RUN``); the run's first job has none."""
    return f"{job}.run"


def sweep_file(digest: str) -> str:
    """A sweep's table of tasks (``ctrain.jobs.sweep``), named by its content's digest."""
    return f"sweeps/{digest}.tsv"


HISTORY_FILE = "history.jsonl"  # in STATE_DIR: every job `ctrain submit` queued from the project


def continuation_file(job: str) -> str:
    """JOB's own batch script, read back from Slurm to be submitted as its continuation."""
    return f"{job}.continuation"


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
    JobFile(f"../{retried_file('RUN')}", "empty", "`ctrain_retry_once`", "`ctrain_retry_once` of the requeued run",
            "kept across requeues and continuations; removed when the run ends"),
    JobFile(f"../{timeline_file('RUN')}", "`EPOCH RESTART EVENT ARG...`, appended (`Mark`, `EVENTS`)",
            "`ctrain_mark` (the batch script, or a sentinel deciding in its place) and rank 0 "
            "(`ctrain.train.goodput.mark`)", "`ctrain report JOB`; rank 0 at the end of a finished run",
            "every run's edges and the trainer's progress, across its jobs; kept after the run"),
    JobFile(f"../{report_file('RUN')}", "JSON", "`ctrain report JOB`", "you", "when the report runs"),
    JobFile(f"../{holder_file('RUN')}", "`JOBID`, or `after JOBID` (a hand-over)", "`ctrain_hold` (the run's first "
            "job creates it; a continuation takes it), `ctrain_continue` (hands it over)",
            "`ctrain_hold` as each job of the run starts: a job it does not name does not run", "at each job's start"),
    JobFile(f"../{jobs_file('RUN')}", "`JOBID` a line, appended", "`ctrain_hold` (the first job), `ctrain_continue`",
            "`ctrain status`, `logs`, `cancel`, `report` (`ctrain.jobs.chain`)", "at the run's start; per continuation"),
    JobFile(f"../{run_file('JOBID')}", "`RUN`", "`ctrain_continue`, for the continuation it submitted; "
            "`ctrain_hold`, as `ARRAYJOBID_TASK.run`, for a sweep's task as it starts its run",
            "`ctrain report JOB` of a continuation (`ctrain.jobs.chain`); `ctrain results` of a sweep's tasks",
            "per continuation; per sweep task"),
    JobFile(f"../{sweep_file('DIGEST')}", "a line per task: its name, then `arg:WORD` and `env:NAME=VALUE`, "
            "tab-separated", "`ctrain submit --sweep` (`ctrain.jobs.sweep.write_table`), once: named by its content",
            "`ctrain_sweep_task` in each task (the line of its `SLURM_ARRAY_TASK_ID`)", "at submission; kept"),
    JobFile(f"../{HISTORY_FILE}", "a JSON object a line: `job`, `name`, `submitted`, `arguments`",
            "`ctrain submit` (`ctrain.jobs.history.record`)", "`ctrain jobs`", "per job submitted"),
    JobFile(f"../{continuation_file('JOBID')}", "the job's batch script", "`ctrain_continue` "
            "(`scontrol write batch_script`)", "`sbatch`, submitting the continuation", "removed once submitted"),
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
