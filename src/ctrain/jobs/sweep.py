"""Sweeps as one Slurm job array (``ctrain submit --sweep KEY=V1,V2 --max-parallel N``): a task per set
of values, from a grid of ``--sweep`` flags or a file of one set per line.

Each task's values reach the job as data, never as shell text: ``ctrain submit`` writes the sweep's
table (:func:`table_text`, one line per task, tab-separated ``arg:WORD`` and ``env:NAME=VALUE``
fields) to ``.ctrain/sweeps/DIGEST.tsv``, and the library's ``ctrain_sweep_task`` reads the line of
its ``SLURM_ARRAY_TASK_ID``. A recipe's task gets its values as overrides and its own output
directory, named by its values; a command of the user's own gets them as ``CTRAIN_SWEEP_KEY``
variables and as ``{key}`` in its words. Every task is its own run: its own timeline, requeues and
continuation (a one-task array of the same index)."""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

from ctrain import protocol
from ctrain.errors import ConfigError
from ctrain.files import atomic_write_text, control_problem, read_regular, shorten

MAX_TASKS = 1000  # Slurm's default MaxArraySize is 1001 (indices 0-1000)
MAX_FILE_BYTES = 2**20  # a sweep file, and the table the job reads (the library holds the same bound)
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass(frozen=True)
class Task:
    """One task of the array: its index, its values (KEY -> VALUE as given) and its name."""

    index: int
    values: dict[str, str]
    name: str
    words: list[str] = field(default_factory=list)  # overrides added (a recipe), or the command (own)
    output: str | None = None  # a recipe task's training.output_dir, as the job gets it

    @property
    def env(self) -> dict[str, str]:
        return {env_name(key): value for key, value in self.values.items()}


def env_name(key: str) -> str:
    """The variable a task of a command of the user's own gets KEY's value in (lr -> CTRAIN_SWEEP_LR)."""
    return "CTRAIN_SWEEP_" + re.sub(r"[^A-Z0-9]", "_", key.upper())


def _pair(item: str, where: str) -> tuple[str, str]:
    key, eq, value = item.partition("=")
    if not eq or not _KEY.fullmatch(key):
        raise ConfigError(f"{where} {shorten(item)!r} must look like KEY=VALUE (a recipe key such as "
                          "training.learning_rate, or a name of your own for a command)")  # fmt: skip
    problem = control_problem(value)
    if problem:
        raise ConfigError(f"{where} {shorten(item)!r}: its value {problem}; each value is one line")
    return key, value


def grid(specs: tuple[str, ...]) -> list[dict[str, str]]:
    """The sets of ``--sweep KEY=V1,V2`` flags: every combination, the first flag's key slowest."""
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        key, values = _pair(spec, "--sweep")
        choices = values.split(",")
        if any(not choice for choice in choices):
            raise ConfigError(f"--sweep {shorten(spec)!r} has an empty value: list them as KEY=V1,V2 (a value with a "
                              "comma goes in a --sweep-file)")  # fmt: skip
        if key in dict(axes):
            raise ConfigError(f"--sweep names {key} twice: give its values once, as {key}=V1,V2")
        axes.append((key, list(dict.fromkeys(choices))))
    return [dict(zip([k for k, _ in axes], combo)) for combo in itertools.product(*(v for _, v in axes))]


def from_file(path: Path) -> list[dict[str, str]]:
    """The sets of a sweep file: one a line, KEY=VALUE words separated by spaces; # comments, blank lines."""
    try:
        data = read_regular(path, MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--sweep-file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"--sweep-file {path} is over {MAX_FILE_BYTES // 2**20} MiB: a sweep is at most "
                          f"{MAX_TASKS} lines")  # fmt: skip
    sets = []
    for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if words:
            found = dict(_pair(word, f"--sweep-file {path}:{number}:") for word in words)
            if len(found) != len(words):
                raise ConfigError(f"--sweep-file {path}:{number}: a key is given twice")
            sets.append(found)
    return sets


def tasks(sets: list[dict[str, str]], *, command: list[str] | None, output_base: str | None) -> list[Task]:
    """The array's tasks for SETS: a recipe's (``command`` None) with its values as overrides and an output
    directory under ``output_base`` named by them; a command's with ``{key}`` replaced in its words."""
    if not sets:
        raise ConfigError("the sweep has no task: give --sweep KEY=V1,V2, or a --sweep-file with a line per task")
    if len(sets) > MAX_TASKS:
        raise ConfigError(f"the sweep has {len(sets)} tasks, over the {MAX_TASKS} a Slurm job array holds by "
                          "default (MaxArraySize): split it")  # fmt: skip
    names: dict[str, str] = {}
    for values in sets:
        for key in values:
            if names.setdefault(env_name(key), key) != key:
                raise ConfigError(f"the sweep's keys {names[env_name(key)]} and {key} are one variable "
                                  f"({env_name(key)}): rename one")  # fmt: skip
    made, seen = [], set()
    for index, values in enumerate(sets):
        name = "_".join(f"{key.rsplit('.', 1)[-1]}-{value}" for key, value in values.items())
        name = _UNSAFE.sub("_", name)[:100].strip("._") or "task"
        if name in seen:
            name = f"{name}_{index}"
        seen.add(name)
        if command is not None:
            words = [_substituted(word, values) for word in command]
            made.append(Task(index, values, name, words))
            continue
        words = [f"{key}={value}" for key, value in values.items()]
        output = None
        if "training.output_dir" not in values and output_base is not None:
            output = f"{output_base.rstrip('/')}/{name}"
            words.append(f"training.output_dir={output}")
        made.append(Task(index, values, name, words, output))
    return made


def _substituted(word: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        word = word.replace("{" + key + "}", value)
    return word


def table_text(made: list[Task]) -> str:
    """The table the job's tasks read (``ctrain_sweep_task``): a line per task, tab-separated fields,
    the task's name first, then ``arg:WORD`` and ``env:NAME=VALUE``."""
    lines = []
    for task in made:
        fields = [task.name, *(f"arg:{word}" for word in task.words), *(f"env:{k}={v}" for k, v in task.env.items())]
        lines.append("\t".join(fields))
    return "".join(line + "\n" for line in lines)


def table_path(text: str) -> str:
    """Where the table is kept, relative to the project: named by its content, so a sweep's table, once
    written, never changes under its queued or requeued tasks."""
    return f"{protocol.STATE_DIR}/{protocol.sweep_file(hashlib.sha256(text.encode()).hexdigest()[:16])}"


def write_table(project: Path, text: str) -> Path:
    """The table where its tasks read it; one already there with this content is kept (its name is its digest)."""
    path = project / table_path(text)
    try:
        same = read_regular(path, MAX_FILE_BYTES + 1) == text.encode()
    except OSError:
        same = False
    if not same:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    return path


def array_spec(count: int, max_parallel: int | None) -> str:
    """sbatch's --array value: every task's index, at most MAX_PARALLEL running at once."""
    spec = f"0-{count - 1}" if count > 1 else "0"
    return f"{spec}%{max_parallel}" if max_parallel else spec


def describe(made: list[Task]) -> str:
    """The dry run's task table."""
    lines = [f"sweep: {len(made)} task(s), one job array (SLURM_ARRAY_TASK_ID picks the line of its table):"]
    for task in made:
        what = " ".join(task.words)
        lines.append(f"  task {task.index}: {task.name}: {shorten(what, 200)}")
    return "\n".join(lines) + "\n"
