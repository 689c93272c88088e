"""Where a job's time went: the job's timeline and the account ``ctrain report JOB`` makes of it.

The timeline (``.ctrain/RUN.timeline`` in the project, RUN being the run's first job; kept across
requeues and continuations) has one line per event, ``EPOCH RESTART EVENT ARG...`` (:class:`ctrain.protocol.Mark`, which also names every event).
The batch script writes the run's edges (``ctrain_mark``: :data:`BATCH_EVENTS`); rank 0 writes what
the trainer does (:func:`mark`: :data:`TRAINER_EVENTS`). Nothing here imports torch: the report runs on a login node.

The account splits the job's wall time, from its submission to its last decision, into queue wait,
start-up (the image made ready, the container and Python started), preparation (data, model),
training, checkpoint saves, evaluation, work lost (training after the checkpoint the next run
resumed from, with the cause of the restart) and the end of each run; goodput is the training that
counted over the whole.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctrain import protocol
from ctrain.errors import ConfigError
from ctrain.files import read_bounded

# The events and their arguments (the protocol's; a test holds the library's to ctrain_mark's calls).
BATCH_EVENTS = protocol.BATCH_EVENTS
TRAINER_EVENTS = protocol.TRAINER_EVENTS
EVENTS = protocol.EVENTS
TIMELINE_ENV = protocol.TIMELINE_ENV
MAX_BYTES = 8 * 1024 * 1024  # a 1-million-step run logging every step stays well below
# The segments of a run, in the order they happen, with the letter the chart draws them in.
SEGMENTS = {"queue": "q", "start_up": "s", "prepare": "p", "training": "T", "saves": "c", "evals": "e",
            "lost": "x", "end": "d"}  # fmt: skip
# What each cause of a `decided` mark (protocol.DECISION_CAUSES) reads as in the report.
CAUSES = {
    "TERM": "Slurm's TERM (preemption, requeue or scancel)",
    "USR1": "the time-limit warning",
    "node-lost": "a node lost",
    "rank-failed": "a rank failed",
    "hang": "a rank stopped making progress",
    "step-failed": "the training step failed, nothing said why",
    "preflight": "a node failed the preflight",
    "none": "",
}


def mark(event: str, *args: object) -> None:
    """Append one event of this rank's run to the job's timeline (a no-op outside a ctrain job). A
    timeline that cannot be written costs the report, never the training."""
    path = protocol.timeline_path()
    if path is None:
        return
    assert event in TRAINER_EVENTS and len(args) <= len(TRAINER_EVENTS[event]), event
    try:
        protocol.append_mark(path, protocol.Mark(time.time(), protocol.restart_count(), event,
                                                 tuple(str(a) for a in args)))  # fmt: skip
    except OSError:
        pass


@dataclass
class Run:
    """One start of the job, as its timeline tells it (times in seconds since the epoch)."""

    restart: int
    events: dict[str, float] = field(default_factory=dict)  # first time of each edge event
    submitted: float | None = None
    nodes: int = 0
    gpus_per_node: int = 0
    resumed_step: int | None = None
    end_step: int | None = None  # the step the training loop ended at (its final model saved)
    steps: list[tuple[float, int]] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    mfus: list[float] = field(default_factory=list)
    saves: list[tuple[float, int, float]] = field(default_factory=list)
    evals: float = 0.0
    preflight: float = 0.0  # seconds of the preflight's node and rank checks (within start-up and preparation)
    outcome: str | None = None
    cause: str | None = None

    def times(self) -> list[float]:
        return [*self.events.values(), *(t for t, _ in self.steps), *(t for t, _, _ in self.saves)]

    def first(self) -> float:
        return min(self.times(), default=0.0)

    def last(self) -> float:
        return max(self.times(), default=0.0)

    def reached(self) -> int | None:
        """The last step this run is known to have trained."""
        steps = [s for _, s in self.steps] + [s for _, s, _ in self.saves]
        if self.end_step is not None:
            steps.append(self.end_step)
        return max(steps) if steps else self.resumed_step


# The largest number a timeline's event may carry, and how one is read (the protocol's).
MAX_NUMBER = protocol.MAX_NUMBER
_number = protocol.number


def read(path: Path) -> tuple[list[Run], int]:
    """The runs of a timeline file, and how many of its lines were not understood (skipped). Read
    bounded (regular files only): --timeline may name /dev/zero or a FIFO."""
    if not os.path.lexists(path):
        raise ConfigError(f"{path} does not exist: the job was not submitted from this project (its timeline is "
                          ".ctrain/RUN.timeline in the project it ran from: run ctrain report there, or give "
                          "--timeline), or its sbatch/ scripts are older than ctrain's (ctrain init --upgrade)")  # fmt: skip
    try:
        raw = read_bounded(path, MAX_BYTES, "the timeline")
    except ConfigError as exc:
        if "is larger than" not in str(exc):
            raise
        raise ConfigError(f"{path} is more than a timeline can be ({MAX_BYTES} bytes): not reading it") from None
    runs: dict[int, Run] = {}
    skipped = 0
    for line in raw.decode(errors="replace").splitlines():
        mark = protocol.Mark.parse(line)
        if mark is None:
            skipped += 1
            continue
        when, restart, event, args = mark.when, mark.restart, mark.event, list(mark.args)
        run = runs.setdefault(restart, Run(restart))
        numbers = [_number(a) for a in args]
        if event == "start":
            run.submitted = numbers[0] if numbers else None
            run.nodes = int(numbers[1] or 0) if len(numbers) > 1 else 0
            run.gpus_per_node = int(numbers[2] or 0) if len(numbers) > 2 else 0
        elif event == "train" and numbers and numbers[0] is not None:
            run.resumed_step = int(numbers[0])
        elif event == "step" and numbers and numbers[0] is not None:
            run.steps.append((when, int(numbers[0])))
            if len(numbers) > 1 and numbers[1] is not None:
                run.rates.append(numbers[1])
            if len(numbers) > 2 and numbers[2] is not None:
                run.mfus.append(numbers[2])
            continue
        elif event == "save" and len(numbers) == 2 and None not in numbers:
            run.saves.append((when, int(numbers[0]), float(numbers[1])))
            continue
        elif event == "eval" and numbers and numbers[0] is not None:
            run.evals += numbers[0]
            continue
        elif event in ("preflight", "checked") and numbers and numbers[0] is not None:
            run.preflight += numbers[0]
        elif event == "end" and numbers and numbers[0] is not None:
            run.end_step = int(numbers[0])
        elif event == "decided":
            run.outcome = args[0] if args else None
            run.cause = args[1] if len(args) > 1 else None
        run.events.setdefault(event, when)
    return [runs[r] for r in sorted(runs)], skipped


def account(runs: list[Run], *, now: float | None = None, gpu_hour_price: float | None = None) -> dict[str, Any]:
    """The job's time, run by run and in total (seconds), as a JSON-able dict."""
    if not runs:
        raise ConfigError("the timeline has no run in it")
    rows = []
    totals = {name: 0.0 for name in SEGMENTS}
    allocated = 0.0  # node-seconds (GPU-seconds where the nodes have GPUs) the runs held
    gpus = False
    for index, run in enumerate(runs):
        following = runs[index + 1] if index + 1 < len(runs) else None
        started = run.events.get("start", run.first())  # no batch script's marks: the run's first event
        ended = run.events.get("decided") or (now if now is not None and following is None else run.last())
        seg = dict.fromkeys(SEGMENTS, 0.0)
        if run.submitted is not None and "start" in run.events:
            seg["queue"] = max(0.0, run.events["start"] - run.submitted)
        process = run.events.get("process")
        seg["start_up"] = max(0.0, (process or ended) - started)
        loop = run.events.get("train")
        if process is not None:
            seg["prepare"] = max(0.0, (loop or ended) - process)
        # The training loop's end: the final model saved, else the step's end, else the last logged step.
        stopped = run.events.get("end") or run.events.get("exited") or (run.steps[-1][0] if run.steps else ended)
        if loop is not None:
            training = max(0.0, min(stopped, ended) - loop)
            seg["saves"] = min(training, sum(seconds for _, _, seconds in run.saves))
            seg["evals"] = min(training - seg["saves"], run.evals)
            seg["training"] = training - seg["saves"] - seg["evals"]
        lost_steps = 0
        if following is not None and loop is not None:
            resumed = following.resumed_step if following.resumed_step is not None else 0
            reached = run.reached() or 0
            lost_steps = max(0, reached - resumed)
            saved_at = [when for when, step, _ in run.saves if step == resumed]
            since = saved_at[0] if saved_at else loop
            # After the checkpoint the next run resumed from: work lost, or (nothing trained since)
            # the run stopping.
            tail = min(seg["training"], max(0.0, stopped - since))
            seg["lost" if lost_steps else "end"] += tail
            seg["training"] -= tail
        seg["end"] += max(0.0, ended - max(stopped, loop or started, process or started))
        for name in SEGMENTS:
            totals[name] += seg[name]
        units = run.nodes * (run.gpus_per_node or 1)
        gpus = gpus or run.gpus_per_node > 0
        allocated += max(0.0, ended - started) * units
        rows.append({
            "restart": run.restart, "outcome": run.outcome, "cause": run.cause, "nodes": run.nodes,
            "gpus_per_node": run.gpus_per_node, "resumed_step": run.resumed_step, "reached_step": run.reached(),
            "lost_steps": lost_steps, "seconds": {k: round(v, 1) for k, v in seg.items()},
            "preflight_seconds": round(run.preflight, 1),
            "tokens_per_second": round(sum(run.rates) / len(run.rates), 1) if run.rates else None,
            "mfu": round(sum(run.mfus) / len(run.mfus), 4) if run.mfus else None,
        })  # fmt: skip
    first = runs[0].submitted or runs[0].events.get("start", runs[0].first())
    last = runs[-1].events.get("decided") or (now if now is not None else runs[-1].last())
    wall = max(0.0, last - first)
    hours = allocated / 3600
    result: dict[str, Any] = {
        "runs": rows,
        "wall_seconds": round(wall, 1),
        "seconds": {k: round(v, 1) for k, v in totals.items()},
        "goodput": round(totals["training"] / wall, 4) if wall > 0 else None,
        "gpu_hours" if gpus else "node_hours": round(hours, 3),
    }
    if gpu_hour_price is not None and gpus:
        result["cost"] = round(hours * gpu_hour_price, 2)
    return result


def shown_duration(seconds: float) -> str:
    """SECONDS as the report shows them: ``42.0 s``, ``3m05s``, ``1h02m03s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def chart(row: dict[str, Any], scale: float, width: int = 48) -> str:
    """The run's segments as one bar of letters (:data:`SEGMENTS`), ``scale`` seconds per letter."""
    bar = ""
    for name, letter in SEGMENTS.items():
        bar += letter * min(width - len(bar), round(row["seconds"][name] / scale))
    return bar


def render(result: dict[str, Any], job: str) -> list[str]:
    """The account as the lines `ctrain report` prints (and rank 0 logs when a run finishes)."""
    wall = result["wall_seconds"]
    goodput = result["goodput"]
    lines = [f"goodput: job {job}: {len(result['runs'])} run(s), {shown_duration(wall)} from submission to the end; "
             f"training that counted {shown_duration(result['seconds']['training'])}"
             + (f" ({100 * goodput:.1f}%)" if goodput is not None else "")]  # fmt: skip
    parts = [f"{name.replace('_', '-')} {shown_duration(seconds)}" for name, seconds in result["seconds"].items() if seconds]
    lines.append("goodput: where it went: " + ", ".join(parts))
    scale = max(wall / 48, 1e-9)
    for row in result["runs"]:
        cause = CAUSES.get(row["cause"] or "none", row["cause"])
        if (row["cause"] or "").startswith("rank-") and row["cause"] != "rank-failed":
            cause = f"a rank's own error ({row['cause'].removeprefix('rank-')})"
        lost = f", lost {row['lost_steps']} step(s) ({shown_duration(row['seconds']['lost'])})" if row["lost_steps"] else ""
        rate = f", {row['tokens_per_second']:,.0f} tok/s" if row["tokens_per_second"] else ""
        mfu = f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] else ""
        steps = f"steps {row['resumed_step'] or 0}-{row['reached_step']}" if row["reached_step"] is not None else "no step"
        checks = f", preflight {shown_duration(row['preflight_seconds'])}" if row["preflight_seconds"] else ""
        outcome = row["outcome"] or "running"
        lines.append(f"goodput: run {row['restart']}: {chart(row, scale):<48} {steps}{lost}{rate}{mfu}{checks}; "
                     f"{outcome}{': ' + cause if cause else ''}")  # fmt: skip
    units = f"{result['gpu_hours']} GPU-hours" if "gpu_hours" in result else f"{result['node_hours']} node-hours"
    cost = f", cost {result['cost']}" if "cost" in result else ""
    legend = " ".join(f"{letter}={name.replace('_', '-')}" for name, letter in SEGMENTS.items())
    lines.append(f"goodput: {units}{cost}; chart: {legend}")
    return [shown(line) for line in lines]


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """A line for the terminal: control characters a timeline's words may carry (a terminal's escape
    sequences, a carriage return that hides what came before) written as \\xNN, not sent raw."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def report(path: Path, job: str, *, now: float | None = None, gpu_hour_price: float | None = None
           ) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """Read ``path`` and account for it: the JSON-able result and its lines."""
    runs, skipped = read(path)
    result = account(runs, now=now, gpu_hour_price=gpu_hour_price)
    if skipped:
        result["skipped_lines"] = skipped
    return result, render(result, job)


