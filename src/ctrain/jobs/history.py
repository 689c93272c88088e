"""A project's jobs, past ones too (``ctrain jobs``): what ``ctrain submit`` recorded of each in the
project's ``.ctrain/history.jsonl``, with what Slurm still knows (the controller, and accounting where
the cluster keeps it), the run's timeline (wall time, restarts, continuations) and the log's last loss."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctrain import protocol, slurm
from ctrain.errors import CtrainError
from ctrain.files import json_depth_problem, read_regular

HISTORY_LIMIT = 4 * 2**20  # the end of the history file that is read: some 20,000 jobs
_LOSS = re.compile(r"step (\d+)/(\d+), loss ([0-9.]+(?:e[-+]?\d+)?|nan|inf)")


@dataclass(frozen=True)
class Entry:
    """One job as ``ctrain submit`` recorded it."""

    job: str
    name: str
    submitted: float
    what: str  # the recipe and its overrides, or `-- COMMAND`
    output: Path | None = None  # the recipe's output directory, as submit found it
    tasks: tuple[SweepTask, ...] = ()  # a sweep's tasks (one job array); none for one job
    arguments: tuple[str, ...] = ()  # as submitted


@dataclass(frozen=True)
class SweepTask:
    """One task of a sweep as ``ctrain submit`` recorded it."""

    index: int
    name: str
    values: dict[str, str]
    output: Path | None

    def what(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values.items())[:200]


def _tasks(raw: object) -> tuple[SweepTask, ...]:
    """A record's sweep tasks; an entry that is not ctrain's is left out."""
    found = []
    for item in raw if isinstance(raw, list) else []:
        if not isinstance(item, dict) or not isinstance(item.get("task"), int) or not isinstance(item.get("values"), dict):
            continue
        output = item.get("output")
        found.append(SweepTask(item["task"], str(item.get("name", ""))[:100],
                               {str(k)[:64]: str(v)[:200] for k, v in list(item["values"].items())[:32]},
                               Path(output) if isinstance(output, str) and output.startswith("/") else None))  # fmt: skip
    return tuple(found[:1000])


def record(project: Path, job_id: str, name: str, arguments: list[str], output: Path | None = None,
           sweep: list[dict[str, object]] | None = None, submitted: float | None = None) -> None:  # fmt: skip
    """Append the job to the project's history (one JSON line, written whole; a sweep's tasks with it);
    a history that cannot be written costs the listing, never the submission."""
    item: dict[str, object] = {"job": job_id, "name": name,
                               "submitted": round(time.time() if submitted is None else submitted, 3),
                               "arguments": arguments, "output": str(output) if output else None}  # fmt: skip
    if sweep:
        item["sweep"] = sweep
    line = json.dumps(item)
    path = project / protocol.STATE_DIR / protocol.HISTORY_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            handle.write(line + "\n")
    except OSError:
        pass


def parse(data: bytes) -> tuple[list[Entry], int]:
    """The entries of a history file's text (its end: a first, cut line is skipped), and how many lines
    were not ctrain's records."""
    entries, skipped = [], 0
    for raw in data.decode(errors="replace").splitlines():
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError:
            skipped += 1
            continue
        if (not isinstance(item, dict) or json_depth_problem(item, 5) or not slurm.is_job_id(str(item.get("job")),
                                                                                              step=False)
                or not isinstance(item.get("arguments", []), list)):  # fmt: skip
            skipped += 1
            continue
        arguments = [str(a) for a in item.get("arguments", [])]
        what = " ".join(arguments) if arguments else "(the script's defaults)"
        submitted, output = item.get("submitted"), item.get("output")
        entries.append(Entry(str(item["job"]), str(item.get("name", ""))[:64],
                             float(submitted) if isinstance(submitted, (int, float)) else 0.0, what[:200],
                             Path(output) if isinstance(output, str) and output.startswith("/") else None,
                             _tasks(item.get("sweep")), tuple(a[:4096] for a in arguments[:256])))  # fmt: skip
    return entries, skipped


def read(project: Path, runner: slurm.Runner | None = None) -> tuple[list[Entry], int]:
    """The project's history, oldest first (here, or through ``runner`` on a cluster's login node)."""
    path = project / protocol.STATE_DIR / protocol.HISTORY_FILE
    try:
        data = runner.read(path, -HISTORY_LIMIT) if runner else read_regular(path, HISTORY_LIMIT, -HISTORY_LIMIT)
    except (OSError, CtrainError):
        data = None
    if not data:
        return [], 0
    if len(data) >= HISTORY_LIMIT:
        data = data.partition(b"\n")[2]
    return parse(data)


def last_loss(text: str) -> str:
    """The last training loss the log shows (``step N/M, loss X``), else ``-``."""
    found = list(_LOSS.finditer(text))
    return f"{float(found[-1].group(3)):.4g}" if found else "-"


def _run(project: Path, job_id: str) -> tuple[str, str]:
    """The run's wall time and restarts, from its timeline here; ``-`` where there is none."""
    from ctrain.train import goodput

    path = project / protocol.STATE_DIR / protocol.timeline_file(job_id)
    if not path.is_file():
        return "-", "-"
    try:
        runs, _ = goodput.read(path)
        result = goodput.account(runs)
    except (OSError, CtrainError, ValueError):
        return "-", "-"
    if not runs:
        return "-", "-"
    return goodput.shown_duration(result["wall_seconds"]), str(max(r["restart"] for r in result["runs"]))


def rows(client: slurm.Slurm, project: Path, entries: Iterable[Entry], search: list[Path], *,
         here: bool) -> list[list[str]]:  # fmt: skip
    """One row per job, newest first: id (and its run's continuations), name, what it ran, state, when,
    wall time, restarts, last loss. ``here``: the project is on this machine (its timelines are read)."""
    from ctrain.jobs import chain

    newest = list(reversed(list(entries)))
    runs = [chain.jobs_from(client, entry.job, search) for entry in newest]
    states = client.status([jobs[-1] for jobs in runs]) if runs else []  # one query for every run's last job
    listed = []
    for entry, jobs, last in zip(newest, runs, states):
        try:
            loss = last_loss(client.read_log(jobs[-1], search=search))
        except CtrainError:
            loss = "-"
        wall, restarts = _run(project, entry.job) if here else ("-", "-")
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.submitted)) if entry.submitted else "-"
        ids = " -> ".join(jobs) if len(jobs) <= 3 else f"{jobs[0]} -> ... -> {jobs[-1]}"
        what = f"{entry.what} (sweep: {len(entry.tasks)} tasks)" if entry.tasks else entry.what
        listed.append([ids, entry.name, what, last.state, when, wall, restarts, loss])
    return listed


HEADERS = ["job", "name", "ran", "state", "submitted", "wall", "restarts", "last loss"]


def note(client: slurm.Slurm, states: Iterable[str]) -> str | None:
    """What the table cannot say: jobs Slurm has forgotten, where the cluster keeps no accounting."""
    if "UNKNOWN" not in states:
        return None
    if client.sacct(["1"]) is None:
        return ("UNKNOWN: Slurm has forgotten the job (MinJobAge) and this cluster keeps no accounting (sacct), "
                "so its state is gone; its wall time, restarts and loss are from the project's own files")
    return "UNKNOWN: neither the controller nor accounting (sacct) knows the job any more"


def as_json(table: list[list[str]]) -> list[dict[str, Any]]:
    return [dict(zip(HEADERS, row)) for row in table]
