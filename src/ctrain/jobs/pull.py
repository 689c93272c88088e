"""Bring a job home (``ctrain pull JOB --cluster NAME``): what the job left on the cluster, copied into
the laptop's project where the same commands read it (``ctrain results``, ``ctrain report``, TensorBoard).

Only the job's own files are read there, named from the project's history on the cluster: its state
files and its run's (``.ctrain/JOB.*``, each task's ``.ctrain/JOB_TASK.run`` and its run's), the logs of
every job of its runs (``logs/*-ID.out``), and in each output directory ctrain's files by name (metrics,
evaluation, the recipe as run, TensorBoard's ``runs/``; the final model or adapters with ``models``),
never checkpoints. Over rsync on the profile's SSH connection: a second pull brings only what changed,
and a file cut off mid-way is finished."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ctrain import protocol
from ctrain.errors import ConfigError, CtrainError
from ctrain.files import read_regular
from ctrain.jobs import history

PULLED_DIR = "pulled"  # where an output directory from outside the cluster's project goes: pulled/JOB/NAME


@dataclass
class Pulled:
    files: int = 0
    outputs: int = 0


def local_output(remote_root: str, output: Path, local_root: Path, job: str) -> Path:
    """Where an output directory of the cluster goes here: at the same place in the project, or, from
    outside the cluster's project (slurm.outputs elsewhere), under pulled/JOB/."""
    path, root = PurePosixPath(str(output)), PurePosixPath(remote_root)
    if path.is_relative_to(root) and ".." not in path.parts:
        return local_root / path.relative_to(root)
    return local_root / PULLED_DIR / job / (path.name or "output")


def output_patterns(models: bool) -> list[str]:
    """What of an output directory is brought (rsync patterns): ctrain's own files by name, TensorBoard's
    events, and with MODELS the final model or adapters; never checkpoints."""
    from ctrain.train import artifacts as a

    names = (a.METRICS_FILE, a.EVAL_FILE, a.RECIPE_COPY, a.PREEMPTED_FILE, a.WANDB_RUN_FILE)
    return [*(f"/{name}" for name in names), f"/{a.TENSORBOARD_DIR}/***", *([f"/{a.FINAL_DIR}/***"] if models else [])]


def _jobs_of(state: Path, run: str) -> list[str]:
    """The jobs of RUN, from its jobs file as pulled (bounded; only job ids)."""
    try:
        text = read_regular(state / protocol.jobs_file(run), 64 * 1024).decode(errors="replace")
    except OSError:
        return [run]
    return list(dict.fromkeys([run, *(line.strip() for line in text.splitlines() if line.strip().isdigit())]))


def pull(ssh: object, job: str, local_root: Path, *, models: bool, emit: Callable[[str], None]) -> Pulled:
    """Copy job JOB's files from the cluster's project (``ssh``: a :class:`ctrain.remote.Ssh`) into LOCAL_ROOT
    and add the job to this project's history, so that results and report read it here."""
    from ctrain import remote
    from ctrain.jobs import chain

    assert isinstance(ssh, remote.Ssh)
    there = remote.project_dir(ssh.cluster).rstrip("/")
    entries, _ = history.read(Path(there), ssh)
    entry = next((e for e in reversed(entries) if e.job == job), None)
    if entry is None:
        raise ConfigError(f"job {job}: not in the history of {ssh.cluster.name}'s project ({there}/"
                          f"{protocol.STATE_DIR}/{protocol.HISTORY_FILE}): give the id ctrain submit printed; "
                          f"ctrain jobs --cluster {ssh.cluster.name} lists them")  # fmt: skip
    done = Pulled()
    state = local_root / protocol.STATE_DIR
    done.files += len(remote.fetch_from(ssh, f"{there}/{protocol.STATE_DIR}", state,
                                        [f"/{job}.*", f"/{job}_*.run"]))  # fmt: skip
    runs = [chain.run_of(state, f"{job}_{t.index}") for t in entry.tasks] if entry.tasks else [job]
    others = [run for run in dict.fromkeys(runs) if run != job]
    if others:
        done.files += len(remote.fetch_from(ssh, f"{there}/{protocol.STATE_DIR}", state,
                                            [f"/{run}.*" for run in others]))  # fmt: skip
    ids = list(dict.fromkeys(j for run in runs for j in _jobs_of(state, run)))
    logs = [pattern for j in ids for pattern in (f"/*-{j}.out", f"/*-{j}.sbatch")]
    done.files += len(remote.fetch_from(ssh, f"{there}/logs", local_root / "logs", logs))
    keep = output_patterns(models)
    outputs = [(None, entry.output)] if not entry.tasks else [(t, t.output) for t in entry.tasks]
    here: dict[int | None, Path] = {}
    for task, output in outputs:
        if output is None:
            continue
        target = local_output(there, output, local_root, job)
        try:
            got = remote.fetch_from(ssh, str(output), target, keep)
        except CtrainError as exc:
            emit(f"warning: {output}: not copied ({exc})")
            continue
        done.files += len(got)
        done.outputs += 1
        here[task.index if task else None] = target
    if not any(e.job == job for e in history.read(local_root)[0]):
        sweep = [{"task": t.index, "name": t.name, "values": t.values,
                  "output": str(here[t.index]) if t.index in here else None} for t in entry.tasks] or None  # fmt: skip
        history.record(local_root, job, entry.name, list(entry.arguments), here.get(None), sweep=sweep,
                       submitted=entry.submitted)  # fmt: skip
    return done
