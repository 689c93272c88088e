"""Slurm from Python: submit a batch script, read job and node states, follow a job's log, cancel.

One client, :class:`Slurm`, runs every Slurm command on a :class:`Runner` (this machine, the
testbed's job user, later a login node over SSH). Output is parsed narrowly: ``sbatch --parsable``,
``squeue``/``sacct`` with fixed format strings, ``scontrol show job -o`` key=value records, ``sinfo``
GRES strings. Output of any other shape is a :class:`ParseError` carrying the raw text.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ctrain import proc, protocol
from ctrain.errors import CommandError, ConfigError, CtrainError, ParseError
from ctrain.files import NotRegularFile, read_regular

# States after which a job does not run again (unless requeued by hand).
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)

# ASCII digits only: str.isdigit and a str pattern's \d take other scripts' digits too, which Slurm does not.
_JOB_ID = re.compile(r"[0-9]+(?P<task>_[0-9]+)?(?P<step>\.[0-9A-Za-z_]+)?", re.ASCII)
# The signal names scancel knows, with or without SIG (Slurm's sig_name2num, src/common/proc_args.c): it
# refuses the system's others (RTMIN, WINCH, PIPE, ...), so ctrain refuses them before it says "sent".
SCANCEL_SIGNALS = ("HUP", "INT", "QUIT", "ABRT", "KILL", "ALRM", "TERM", "USR1", "USR2", "URG", "CONT", "STOP",
                   "TSTP", "TTIN", "TTOU", "XCPU")  # fmt: skip
# What Slurm's commands print when the controller cannot be reached or found.
_UNREACHABLE = ("Could not establish a configuration source", "Unable to process configuration file",
                "Unable to contact slurm controller",
                "Socket timed out", "Connection refused", "slurm_load_jobs error: Unable to contact")  # fmt: skip


def is_job_id(text: str, *, array: bool = True, step: bool = True) -> bool:
    """Whether ``text`` is a job id as Slurm prints it: ASCII digits, with ``_TASK`` of an array task
    (where ``array``) and ``.STEP`` of a step (where ``step``). The one test of a job id in ctrain."""
    match = _JOB_ID.fullmatch(text)
    return match is not None and (array or not match["task"]) and (step or not match["step"])


def check_job_id(job_id: str, *, step: bool = True) -> str:
    """A job id as Slurm prints it (123, 123_4 for arrays, 123.0 for a step where ``step``), or a ConfigError."""
    job_id = str(job_id).strip()
    if not is_job_id(job_id, step=step):
        raise ConfigError(f"{job_id[:40]!r} is not a Slurm job id (ASCII digits like 1234, or 1234_5 for an array "
                          "task)")  # fmt: skip
    return job_id


def check_signal(name: str) -> str:
    """A signal for ``scancel --signal``: a name scancel knows (USR1, SIGUSR1) or a number 1-64, else a
    ConfigError, before scancel refuses it (or a signal number the system has not)."""
    value = name.strip().upper()
    if value.isascii() and value.isdigit():
        known = 0 < int(value) < 65
    else:
        known = value.removeprefix("SIG") in SCANCEL_SIGNALS
    if not known:
        raise ConfigError(f"--signal {name[:40]!r} is not a signal scancel knows: give one of "
                          f"{', '.join(SCANCEL_SIGNALS)} (SIG before it or not), or a number 1-64")  # fmt: skip
    return value


def failure(args: Sequence[str], out: subprocess.CompletedProcess[str]) -> CtrainError:
    """The error for a Slurm command that failed: one line saying so when the controller cannot be
    reached (the usual cause, which Slurm says only in its last lines), else the command's output."""
    text = out.stderr + out.stdout
    if any(sign in text for sign in _UNREACHABLE):
        last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
        return CtrainError(
            f"{args[0]} cannot reach the Slurm controller ({last}): is slurmctld running and SLURM_CONF right here "
            "(scontrol ping)? From a laptop, use --cluster NAME"
        )
    return CommandError(args, out.returncode, out.stderr, out.stdout)


# --- sbatch ---------------------------------------------------------------------------------------

_PARSABLE = re.compile(r"(\d+)(?:;(\S+))?", re.ASCII)


def parse_sbatch_parsable(raw: str) -> str:
    """The job id from ``sbatch --parsable`` ("123" or "123;cluster"); other lines are warnings."""
    lines = [line.strip() for line in raw.splitlines() if line.strip()]
    if not lines:
        raise ParseError("sbatch --parsable output (no job id)", raw)
    match = _PARSABLE.fullmatch(lines[-1])
    if not match:
        raise ParseError("sbatch --parsable output (no job id)", raw)
    return match.group(1)


def sbatch_command(args: list[str]) -> list[str]:
    """The sbatch command line ctrain runs: the job id alone on stdout."""
    return ["sbatch", "--parsable", *args]


# --- job records ----------------------------------------------------------------------------------


# Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; or UNLIMITED/INFINITE.
_TIME = re.compile(r"(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)")


def time_seconds(value: str) -> int | None:
    """Seconds in a Slurm time limit; None for no limit (UNLIMITED, INFINITE, or 0, which Slurm reads
    as no limit); a ConfigError when malformed."""
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME.fullmatch(value.strip())
    if not match:
        raise ConfigError(
            f"time {value!r} is not a Slurm time limit: use MINUTES, HH:MM:SS, D-HH or D-HH:MM:SS (e.g. 04:00:00)"
        )
    d, dh, dm, ds, m, ms, mss = (int(g) if g else 0 for g in match.groups())
    if match.group(1) is not None:  # D-H[:M[:S]]
        seconds = ((d * 24 + dh) * 60 + dm) * 60 + ds
    elif match.group(7) is not None:  # H:M:S
        seconds = (m * 60 + ms) * 60 + mss
    else:
        seconds = m * 60 + ms  # M or M:S
    return seconds or None


@dataclass(frozen=True)
class Job:
    """One job as squeue, sacct or scontrol report it; empty strings where a source has no value."""

    id: str
    name: str
    state: str
    elapsed: str = ""
    time_limit: str = ""
    nodes: str = ""
    where: str = ""  # node list when running, the reason when pending
    exit_code: str = ""
    stdout: str = ""
    restarts: str = ""
    source: str = ""

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def _rows(raw: str, width: int, what: str) -> list[list[str]]:
    """Lines of '|'-separated fields, a job id first and the job name last (a name may hold '|')."""
    rows = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", width - 1)
        if len(parts) != width or not _JOB_ID.fullmatch(parts[0]):
            raise ParseError(what, raw)
        rows.append(parts)
    return rows


_SQUEUE_FIELDS = ("%i", "%T", "%M", "%l", "%D", "%R", "%j")
SQUEUE_FORMAT = "|".join(_SQUEUE_FIELDS)


def parse_squeue(raw: str) -> list[Job]:
    """``squeue --noheader --format=SQUEUE_FORMAT`` lines as jobs."""
    return [
        Job(job_id, name, state, elapsed, limit, nodes, where, source="squeue")
        for job_id, state, elapsed, limit, nodes, where, name in _rows(raw, len(_SQUEUE_FIELDS), "squeue output")
    ]


_SACCT_FIELDS = ("JobID", "State", "Elapsed", "Timelimit", "NNodes", "NodeList", "ExitCode", "Restarts", "JobName")
SACCT_FORMAT = ",".join(_SACCT_FIELDS)


def parse_sacct(raw: str) -> list[Job]:
    """``sacct -X -n -P --format=SACCT_FORMAT`` lines as jobs (the state's "by UID" suffix dropped)."""
    jobs = []
    for job_id, state, elapsed, limit, nodes, where, exit_code, restarts, name in _rows(
        raw, len(_SACCT_FIELDS), "sacct output"
    ):
        state = state.split()[0] if state.strip() else ""
        jobs.append(
            Job(job_id, name, state, elapsed, limit, nodes, where, exit_code, restarts=restarts, source="sacct")
        )
    return jobs


_RECORD_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_scontrol_record(raw: str) -> dict[str, str]:
    """One ``scontrol show ... -o`` line as {key: value}; values may hold spaces and '='."""
    line = raw.strip()
    keys = list(_RECORD_KEY.finditer(line))
    if not keys or keys[0].start(1) != 0:
        raise ParseError("scontrol output (expected Key=Value ...)", raw)
    record = {}
    for this, following in zip(keys, [*keys[1:], None]):
        end = following.start() if following else len(line)
        record[this.group(1)] = line[this.end() : end].strip()
    return record


def job_from_record(record: dict[str, str]) -> Job:
    """A :class:`Job` from a ``scontrol show job`` record."""
    try:
        state = record["JobState"]
        job_id = record["JobId"]
    except KeyError as exc:
        raise ParseError(
            f"scontrol show job output (no {exc.args[0]}=)", " ".join(f"{k}={v}" for k, v in record.items())
        ) from exc
    where = record.get("NodeList", "") if state not in ("PENDING", "REQUEUED") else record.get("Reason", "")
    return Job(
        job_id,
        record.get("JobName", ""),
        state,
        record.get("RunTime", ""),
        record.get("TimeLimit", ""),
        record.get("NumNodes", ""),
        "" if where == "(null)" else where,
        record.get("ExitCode", ""),
        record.get("StdOut", ""),
        record.get("Restarts", ""),
        source="scontrol",
    )


def status_table(jobs: list[Job]) -> str:
    """A readable table of jobs."""
    from ctrain.ui import table

    rows = [[j.id, j.name, j.state, j.elapsed, j.time_limit, j.nodes, j.where, j.exit_code] for j in jobs]
    return table(["job", "name", "state", "time", "limit", "nodes", "nodelist / reason", "exit"], rows)


# What the batch script decided about a job: what went wrong, then what it did about it (the
# protocol's status lines: only these, so a training log full of other text cannot be mistaken for them).
_FAILURE = protocol.FAILURE_LINE
_DECISION = protocol.DECISION_LINE
_LOG_TAIL = 256 * 1024
# The most one read of a log returns (Runner.read), and so what `ctrain logs` prints: its end.
READ_LIMIT = 8 * 2**20


def events(text: str) -> list[str]:
    """The job's last failure and the last requeue decision after it, as the batch script logged them."""
    return protocol.status_events(text)



_GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")


def parse_gres_gpus(gres: str) -> int:
    """GPUs in one ``sinfo %G`` GRES string ("gpu:8", "gpu:h100:8(S:0-1)", "(null)" -> 0)."""
    return sum(int(n) for n in _GRES_GPU.findall(gres.strip()))


@dataclass(frozen=True)
class NodeShape:
    """What one kind of node has, as ``sinfo`` lists it: CPUs, memory (MB) and GPUs."""

    cpus: int
    memory_mb: int
    gpus: int


_SHAPE_FORMAT = "%c|%m|%G"
_SHAPE_LINE = re.compile(r"^(\d+)\+?\|(\d+)\+?\|(.*)$")


def parse_node_shapes(raw: str) -> list[NodeShape]:
    """``sinfo --noheader --format='%c|%m|%G'`` as shapes ("128|1024000|gpu:h100:8(S:0-1)");
    sinfo marks a group of unequal nodes with "+" after the smallest value, which is taken."""
    lines = _matches(raw, _SHAPE_LINE, "sinfo's CPUS|MEMORY|GRES")
    return [NodeShape(int(m[1]), int(m[2]), parse_gres_gpus(m[3])) for m in lines]


def _matches(raw: str, pattern: re.Pattern[str], what: str) -> list[re.Match[str]]:
    """``pattern`` matched against each non-blank line of a tool's output; a ParseError for any other."""
    found = []
    for line in raw.splitlines():
        if line.strip():
            match = pattern.match(line.strip())
            if not match:
                raise ParseError(what, raw)
            found.append(match)
    return found


_SINFO_NODE = re.compile(r"^(\S+)\s+(\S+)$")


@dataclass(frozen=True)
class Partition:
    """One partition as ``scontrol show partition -o`` tells it: whether it is the default, and the
    time limit a job gets that names none (DefaultTime, else MaxTime) and may ask for at most."""

    name: str
    default: bool
    default_time: str  # "NONE" where the partition sets none
    max_time: str  # "UNLIMITED" where it sets none


def parse_partitions(raw: str) -> list[Partition]:
    """Every line of ``scontrol show partition -o`` as a :class:`Partition`."""
    found = []
    for line in raw.splitlines()[:10_000]:
        if not line.strip():
            continue
        record = parse_scontrol_record(line)
        if "PartitionName" not in record:
            raise ParseError("scontrol show partition output (no PartitionName=)", line)
        found.append(Partition(record["PartitionName"], record.get("Default") == "YES",
                               record.get("DefaultTime", "NONE"), record.get("MaxTime", "UNLIMITED")))  # fmt: skip
    return found


def parse_node_states(raw: str) -> dict[str, str]:
    """``sinfo -h -N -o '%N %T'`` as {node: state}; anything else is a ParseError."""
    return {match.group(1): match.group(2) for match in _matches(raw, _SINFO_NODE, "sinfo node states")}


# --- where the commands run -----------------------------------------------------------------------


class Runner(Protocol):
    """Where Slurm's commands run and its log files are read: this machine, this machine as another
    user (the testbed's job user), or a login node reached over SSH."""

    def run(
        self,
        args: Sequence[str],
        *,
        check: bool = True,
        input: str | None = None,
        cwd: Path | None = None,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]: ...

    def has(self, tool: str) -> bool: ...

    def read(self, path: Path, offset: int = 0) -> bytes | None:
        """The file's bytes from ``offset`` on, at most :data:`READ_LIMIT` of them (the last ``-offset``
        bytes when negative); None when it cannot be read (not there yet)."""
        ...

    def glob(self, directory: Path, pattern: str) -> list[Path]:
        """The files in ``directory`` whose names match ``pattern``, sorted."""
        ...


@dataclass(frozen=True)
class Local:
    """Commands on this machine, with ``env`` added to the environment (e.g. SLURM_CONF), from
    ``home`` unless told otherwise. A subclass that runs them another way changes :meth:`argv`
    (and :meth:`added_env`)."""

    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float | None = None
    home: Path | None = None

    def argv(self, args: Sequence[str | os.PathLike[str]]) -> list[str]:
        """The command line that runs ``args``."""
        return [os.fspath(a) for a in args]

    def added_env(self) -> dict[str, str] | None:
        """What :func:`ctrain.proc.run` adds to this process's environment for the command."""
        return dict(self.env) or None

    def run(
        self,
        args: Sequence[str],
        *,
        check: bool = True,
        input: str | None = None,
        cwd: Path | None = None,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return proc.run(self.argv(args), check=check, input=input, cwd=cwd or self.home,
                        timeout=timeout or self.timeout, env=self.added_env())  # fmt: skip

    def has(self, tool: str) -> bool:
        return proc.which(tool) is not None

    def glob(self, directory: Path, pattern: str) -> list[Path]:
        return sorted(Path(directory).glob(pattern))

    def read(self, path: Path, offset: int = 0) -> bytes | None:
        """Regular files only, opened without blocking and read with a bound: a log that is a link to
        /dev/zero would never end, a FIFO would block ``status`` and ``logs`` for good."""
        try:
            return read_regular(path, READ_LIMIT, offset)
        except NotRegularFile:
            raise CtrainError(
                f"{path} is not a regular file (a device, pipe or socket): not reading it as a log"
            ) from None
        except OSError:
            return None


# --- the client -----------------------------------------------------------------------------------


class Slurm:
    """The one Slurm client: every Slurm command ctrain runs goes through here, on its ``runner``.

    ``Slurm()`` talks to the cluster of this machine; the testbed gives one that runs as its job user
    against its own ``SLURM_CONF``.
    """

    def __init__(self, runner: Runner | None = None) -> None:
        self.runner: Runner = runner or Local()

    def run(self, args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm command this client has no method for (``scontrol update ...``), on its runner."""
        return self.runner.run(args, check=check)

    # --- submit and cancel ---

    def sbatch(self, args: Sequence[str], *, cwd: Path, script: str | None = None) -> str:
        """Run ``sbatch --parsable ARGS`` in ``cwd`` (the job's submit directory); return the job id.

        ``script`` is the batch script's text, given on standard input (then ``args`` holds options only).
        """
        out = self.runner.run(sbatch_command(list(args)), cwd=cwd, input=script)
        return parse_sbatch_parsable(out.stdout)

    def cancel(self, job_id: str, *, signal: str | None = None) -> None:
        """``scancel`` the job, or send ``signal`` to its batch script only (``scancel --batch``).

        The batch script is where Slurm's ``--signal=B:USR1@N`` time-limit warning goes too; ctrain's
        scripts pass USR1 on to the training processes (and to nothing else) and then requeue.
        """
        args = ["scancel", "--verbose", check_job_id(job_id)]
        if signal is not None:
            args[1:1] = ["--batch", f"--signal={check_signal(signal)}"]
        out = self.runner.run(args, check=False)
        if "Invalid job id" in out.stderr:  # said with --verbose only, and scancel exits 0
            raise CtrainError(f"job {job_id}: Slurm does not know it (never submitted here, or finished long ago)")
        if out.returncode != 0 or "error:" in out.stderr:
            raise failure(args, out)

    # --- job records ---

    def squeue(self, job_ids: Iterable[str] = (), *, mine: bool = False) -> list[Job]:
        """Pending and running jobs: the given ids, or (``mine``) the caller's, or everyone's."""
        args = ["squeue", "--noheader", f"--format={SQUEUE_FORMAT}"]
        ids = list(job_ids)
        if ids:
            args.append("--jobs=" + ",".join(ids))
        elif mine:
            args.append("--me")
        out = self.runner.run(args, check=False)
        if out.returncode != 0:
            # squeue fails for ids it no longer knows (finished and purged); they are simply not queued.
            if ids and "Invalid job id" in out.stderr:
                return []
            raise failure(args, out)
        return parse_squeue(out.stdout)

    def sacct(self, job_ids: Iterable[str]) -> list[Job] | None:
        """Finished jobs from the accounting database; None where the cluster keeps no accounting."""
        if not self.runner.has("sacct"):
            return None
        args = ["sacct", "-X", "--noheader", "--parsable2", f"--format={SACCT_FORMAT}", "--jobs=" + ",".join(job_ids)]
        out = self.runner.run(args, check=False)
        text = out.stdout + out.stderr
        if out.returncode != 0 or "accounting storage is disabled" in text:
            if "accounting" in text.lower() or "slurmdbd" in text.lower():
                return None
            raise failure(args, out)
        return parse_sacct(out.stdout)

    def show_job(self, job_id: str) -> dict[str, str] | None:
        """``scontrol show job -o ID`` as a record; None once Slurm has forgotten the job."""
        args = ["scontrol", "show", "job", "--oneliner", check_job_id(job_id)]
        out = self.runner.run(args, check=False)
        if out.returncode != 0 or not out.stdout.strip():
            if "Invalid job id" in out.stderr + out.stdout:
                return None
            raise failure(args, out)
        first = out.stdout.strip().splitlines()[0]  # array jobs: one line per task; the first is enough
        return parse_scontrol_record(first)

    def job(self, job_id: str) -> Job | None:
        """One job from wherever Slurm still knows it: the controller, else accounting."""
        record = self.show_job(job_id)
        if record is not None:
            return job_from_record(record)
        found = self.sacct([job_id]) or []
        return found[0] if found else None

    def status(self, job_ids: Iterable[str] = ()) -> list[Job]:
        """The given jobs (queued, running or finished), or all of the caller's queued and running jobs."""
        ids = [check_job_id(i) for i in job_ids]
        if not ids:
            return self.squeue(mine=True)
        queued = {j.id: j for j in self.squeue(ids)}
        jobs = []
        for job_id in ids:
            found = queued.get(job_id) or self.job(job_id)
            jobs.append(found or Job(job_id, "", "UNKNOWN", where="Slurm no longer knows this job"))
        return jobs

    def queued_ids(self) -> list[str]:
        """Every pending or running job's id (an administrator's view: all users)."""
        return self.runner.run(["squeue", "--noheader", "--format=%A"], check=False).stdout.split()

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        poll: float = 2.0,
        on_change: Callable[[Job], None] | None = None,
    ) -> Job:
        """Block until the job reaches a final state; return it. Raises on ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        while True:
            current = self.job(job_id)
            if current is None:
                raise CtrainError(f"job {job_id}: Slurm does not know it (finished too long ago, or never submitted)")
            if on_change and current.state != last:
                on_change(current)
            last = current.state
            if current.final:
                return current
            if deadline is not None and time.monotonic() > deadline:
                raise CtrainError(f"job {job_id} is still {current.state} after {timeout:.0f}s")
            time.sleep(poll)

    # --- logs ---

    def log_path(self, job_id: str, *, search: Iterable[Path] = (Path("logs"),)) -> Path:
        """The job's output file: Slurm's StdOut, else the ``logs/NAME-JOBID.out`` convention."""
        job_id = check_job_id(job_id)
        record = self.show_job(job_id)
        if record is not None and record.get("StdOut"):
            return Path(record["StdOut"])
        for directory in search:
            found = self.runner.glob(directory, f"*-{job_id}.out")
            if found:
                return found[0]
        where = ", ".join(str(d) for d in search)
        if not where:
            raise CtrainError(
                f"no log for job {job_id}: Slurm no longer knows it, and with no project directory to look in "
                "(project_dir in the cluster's profile) there is nowhere to find logs/*-JOBID.out"
            )
        raise CtrainError(
            f"no log for job {job_id}: Slurm no longer knows it and there is no *-{job_id}.out in {where}"
        )

    def read_log(self, job_id: str, *, search: Iterable[Path] = (Path("logs"),)) -> str:
        """The job's log as it is now: at most its last READ_LIMIT bytes (from a line's start), with a
        first line saying so; a log of a long run can hold gigabytes."""
        path = self.log_path(job_id, search=search)
        data = self.runner.read(path, -READ_LIMIT)
        if data is None:
            raise CtrainError(f"job {job_id}: its log {path} cannot be read (not written yet, or not visible here)")
        if len(data) < READ_LIMIT:
            return data.decode(errors="replace")
        data = data[-READ_LIMIT:]
        tail = data.partition(b"\n")[2] or data  # from a line's start
        note = f"[ctrain: the end of {path} only, its last {READ_LIMIT // 2**20} MiB; the log may hold more]\n"
        return note + tail.decode(errors="replace")

    def job_events(self, found: Job, *, search: Iterable[Path] = (Path("logs"),)) -> list[str]:
        """:func:`events` from the job's log (its end), where the log can be read; else none."""
        candidates = [Path(found.stdout)] if found.stdout else []
        for directory in search:
            candidates += self.runner.glob(directory, f"*-{found.id.split('.')[0]}.out")
        for path in candidates:
            try:
                data = self.runner.read(path, -_LOG_TAIL)
            except CtrainError:  # not a regular file: no events, the table says the rest
                continue
            if data is not None:
                return events(data.decode(errors="replace"))
        return []

    def follow(
        self,
        job_id: str,
        *,
        emit: Callable[[str], None],
        poll: float = 1.0,
        search: Iterable[Path] = (Path("logs"),),
    ) -> Job | None:
        """Print the job's log as it grows until the job ends (``tail -f`` that stops); return the final job.

        Waits for the file while the job is pending. A requeued job keeps appending to the same file
        (the scripts use --open-mode=append), so following continues across requeues.
        """
        path = self.log_path(job_id, search=search)
        position = 0
        pending = b""
        while True:
            current = self.job(job_id)
            chunk = self.runner.read(path, position)
            while chunk:  # a log longer than one read: on at once, in bounded pieces
                position += len(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    emit(line.decode(errors="replace"))
                if len(pending) > READ_LIMIT:  # a "line" of megabytes (binary, /dev/zero's copy): shown cut
                    emit(pending[:READ_LIMIT].decode(errors="replace"))
                    pending = b""
                chunk = self.runner.read(path, position) if len(chunk) >= READ_LIMIT else None
            if current is None or current.final:
                if pending:
                    emit(pending.decode(errors="replace"))
                return current
            time.sleep(poll)

    # --- nodes and partitions ---

    def node_states(self, *names: str) -> dict[str, str]:
        """{node: state} as ``sinfo`` prints it (``idle``, ``allocated``, ``down*``, ...): these nodes, or all."""
        args = ["sinfo", "--noheader", "--Node", "--format=%N %T"]
        if names:
            args.append("--nodes=" + ",".join(names))
        return parse_node_states(self.runner.run(args).stdout)

    def ping(self) -> tuple[bool, str]:
        """Whether the controller answers ``scontrol ping``, and what it said."""
        out = self.runner.run(["scontrol", "ping"], check=False)
        answer = (out.stdout + out.stderr).strip()
        return out.returncode == 0 and " is UP" in out.stdout, answer

    def node_shapes(self, partition: str | None) -> list[NodeShape] | None:
        """The kinds of node in ``partition`` (the default one if None); None if sinfo cannot answer."""
        args = ["sinfo", "--noheader", f"--format={_SHAPE_FORMAT}"]
        if partition:
            args.append(f"--partition={partition}")
        out = self.runner.run(args, check=False)
        return parse_node_shapes(out.stdout) if out.returncode == 0 else None

    def partitions(self) -> list[Partition] | None:
        """Every partition, with its time limits; None where scontrol cannot answer."""
        out = self.runner.run(["scontrol", "show", "partition", "-o"], check=False)
        return parse_partitions(out.stdout) if out.returncode == 0 else None

    def partition_gpus(self, partition: str | None) -> int | None:
        """The most GPUs any node of ``partition`` (of any partition if None) has; None if sinfo fails."""
        args = ["sinfo", "--noheader", "--format=%G"]
        if partition:
            args.append(f"--partition={partition}")
        out = self.runner.run(args, check=False)
        if out.returncode != 0:
            return None
        lines = [line for line in out.stdout.splitlines() if line.strip()]
        if not lines:
            if partition:
                raise ConfigError(f"partition '{partition}' does not exist here (sinfo lists none); see `sinfo -s`")
            return None
        return max(parse_gres_gpus(line) for line in lines)
