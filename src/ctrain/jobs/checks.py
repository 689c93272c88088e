"""Everything that can be known wrong about a job before it waits in the queue: the time-limit
warning against the limit, the image (:mod:`ctrain.image.checks`), the project files the job reads,
the recipe as the job will run it (with its overrides, on its number of processes, without torch),
its output directory, and the GPUs asked for against the partition's nodes.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ctrain import protocol, slurm
from ctrain.errors import ConfigError
from ctrain.image.checks import MissingImage, check_image, holds_ctrain, image_facts, image_is_file
from ctrain.image.facts import describe
from ctrain.jobs.job import Job, node_gpus
from ctrain.jobs.render import inside_project

if TYPE_CHECKING:
    from ctrain.train.hubrefs import HubRef
    from ctrain.train.recipe import Recipe


def check(job: Job, client: slurm.Slurm | None = None, dry_run: bool = False) -> list[str]:
    """Everything that can be known wrong before the job waits in the queue; returns warnings.

    A dry run shows the script before an image exists (what ``ctrain init`` sends a new user to):
    a missing image file is then a warning, not an error."""
    warnings: list[str] = []
    s = job.settings
    check_signal(job.options)
    try:
        check_image(s["CTRAIN_IMAGE"], job.runtime, job.project)
    except MissingImage as missing:
        if not dry_run:
            raise
        warnings.append(f"{missing} (a job needs it; this dry run does not)")
    else:
        warnings += check_image_has_ctrain(job)
    if s["CTRAIN_LAUNCHER"] == "deepspeed":
        project_file(job, s["CTRAIN_DEEPSPEED_CONFIG"], "the DeepSpeed config (CTRAIN_DEEPSPEED_CONFIG)")
    client = client or slurm.Slurm()
    # The cluster's answers first: a GPU count or partition that cannot be is the first thing to fix,
    # before what the recipe would make of it.
    check_partition(job, client)
    warnings += check_gpus(job, client)
    refs: list[HubRef] = []
    if job.command is None and job.sweep:
        warnings += check_sweep_recipe(job, refs)
    elif job.command is None:
        warnings += check_job_recipe(job, refs)
    else:
        script = command_script(job.command)
        if script is not None and not script.startswith(_CONTAINER_TARGETS):
            project_file(job, script, "the command's script")
    try:
        check_hub_cache(job, refs)
    except ConfigError as absent:
        if not dry_run:
            raise
        warnings.append(f"{absent} (a job needs them; this dry run does not)")
    if s.get("CTRAIN_ACCELERATE_CONFIG"):
        project_file(job, s["CTRAIN_ACCELERATE_CONFIG"], "the accelerate config (CTRAIN_ACCELERATE_CONFIG)")
    if s.get("CTRAIN_DATA") and not Path(s["CTRAIN_DATA"]).is_dir():
        raise ConfigError(f"the data directory {s['CTRAIN_DATA']} (CTRAIN_DATA, slurm.data) does not exist")
    return warnings


def check_image_has_ctrain(job: Job) -> list[str]:
    """The image's own account of itself goes to the job's notes (ctrain's, torch's, CUDA's versions and
    the driver CUDA needs). A job that runs ``python -m ctrain`` (a recipe, the preflight's rank
    checks) needs ctrain in its image: an image file without it is refused (it would fail on every node after the queue wait);
    a registry reference, which cannot be looked into from here, gets a warning."""
    image = job.settings["CTRAIN_IMAGE"]
    stated = job.image_stated if job.image_stated is not None else image_facts(image, job.runtime, job.project)
    if stated:
        job.notes.append(f"image: {describe(stated)}")
    command = job.command
    runs_ctrain = command is None or (len(command) > 1 and command[0] == "-m" and command[1].split(".")[0] == "ctrain")
    if not runs_ctrain:
        return []
    found = True if stated else holds_ctrain(image, job.runtime, job.project)
    if found is False:
        raise ConfigError(f"image {image} holds no ctrain, and the job runs `python -m ctrain` in it on every node: "
                          "use ctrain's image (ctrain build && ctrain convert), install ctrain in yours, or run a "
                          "script of your own (ctrain submit -- SCRIPT.py)")  # fmt: skip
    if found is None and not image_is_file(image, job.project):
        return [f"image {image} is a registry reference, so whether it holds ctrain is not checked here; the job runs "
                "`python -m ctrain` in it, which a stock image (such as nvcr.io/nvidia/pytorch) does not have: use "
                "ctrain's image (ctrain build && ctrain push), or run a script of your own (ctrain submit -- SCRIPT.py)"]
    return []


def check_hub_cache(job: Job, refs: list[HubRef]) -> None:
    """Every hub repository the job needs (``refs``, the recipe's, and the names the project and
    ``--fetch`` declare) is in the Hugging Face cache it mounts, where the job runs with the hub
    offline (CTRAIN_HF_OFFLINE, the default): its nodes cannot download one."""
    from ctrain.train.hubrefs import check_cached, parse

    if job.settings["CTRAIN_HF_OFFLINE"] != "1":
        return
    declared = [parse(name, setting="fetch") for name in job.needs]
    check_cached(Path(job.settings["CTRAIN_HF_CACHE"]), [*refs, *declared])


def check_partition(job: Job, client: slurm.Slurm) -> None:
    """The partition exists and allows the time asked for; the job's notes say which time limit it
    runs under (:func:`time_limit`)."""
    found = client.partitions() if client.runner.has("scontrol") else None
    note, job.limit_seconds = time_limit(job.options.get("time"), job.options.get("partition"), found or None)
    job.notes.append(note)


def time_limit(asked: str | None, name: str | None, partitions: list[slurm.Partition] | None
               ) -> tuple[str, int | None]:  # fmt: skip
    """Which time limit the job runs under and where it comes from (the note a dry run and a submit
    print), and its seconds (None: none, or not known here): the one asked for, else the partition's
    DefaultTime, else its MaxTime, as Slurm applies them; no limit is invented. A partition that does
    not exist, or a limit above its MaxTime, is an error that names what exists."""
    if partitions is None:
        return (f"time limit {asked} (slurm.time)" if asked else
                "time limit: the partition's default, as Slurm applies it (no Slurm here to read it from)",
                slurm.time_seconds(asked) if asked else None)  # fmt: skip
    chosen = [p for p in partitions if p.name == name] if name else [p for p in partitions if p.default]
    if name and not chosen:
        names = [p.name + (" (default)" if p.default else "") for p in partitions]
        close = difflib.get_close_matches(name, [p.name for p in partitions], n=1)
        raise ConfigError(f"partition '{name}' does not exist here" + (f" (did you mean '{close[0]}'?)" if close else "")
                          + f"; the partitions: {', '.join(names) or 'none'} (slurm.partition, --partition)")  # fmt: skip
    if not chosen:
        return (f"time limit {asked} (slurm.time)" if asked else "time limit: Slurm's default (no default partition)",
                slurm.time_seconds(asked) if asked else None)  # fmt: skip
    part = chosen[0]
    applied = asked or (part.default_time if part.default_time.upper() != "NONE" else part.max_time)
    return _partition_note(asked, part), slurm.time_seconds(applied)


def _partition_note(asked: str | None, part: slurm.Partition) -> str:
    """The note of :func:`time_limit` for partition PART; an error where ASKED is above its MaxTime."""
    ceiling = slurm.time_seconds(part.max_time)  # None: UNLIMITED
    if asked:
        wanted = slurm.time_seconds(asked)
        if ceiling is not None and (wanted is None or wanted > ceiling):
            raise ConfigError(f"time limit {asked} (slurm.time, --time) is longer than partition {part.name}'s "
                              f"MaxTime {part.max_time}: ask for at most {part.max_time}")  # fmt: skip
        return f"time limit {asked} (slurm.time), within partition {part.name}'s MaxTime {part.max_time}"
    if part.default_time.upper() != "NONE":
        return (f"time limit {part.default_time}: partition {part.name}'s DefaultTime (slurm.time or --time "
                f"asks for another, up to its MaxTime {part.max_time})")  # fmt: skip
    if ceiling is not None:
        return f"time limit {part.max_time}: partition {part.name}'s MaxTime (it sets no DefaultTime)"
    return f"time limit: none (partition {part.name} sets no DefaultTime and its MaxTime is {part.max_time})"


def check_signal(options: dict[str, str | None]) -> None:
    """The time-limit warning must come after the job starts, or every run would stop at once."""
    limit = slurm.time_seconds(options["time"]) if options.get("time") else None
    lead = (options.get("signal") or "").rpartition("@")[2]
    if limit is not None and lead.isdigit() and int(lead) >= limit:
        raise ConfigError(
            f"the time-limit warning comes {lead}s before the end (--signal={options['signal']}), but the time "
            f"limit is {options['time']} ({limit}s): raise the time limit or lower slurm.signal_lead"
        )


# Where the container sees the project and the mounts (containers/Dockerfile): paths there
# cannot be checked from the login node.
_CONTAINER_TARGETS = ("/workspace", "/data", "/hf_home", "/outputs")


def check_job_recipe(job: Job, refs: list[HubRef] | None = None) -> list[str]:
    """The recipe exists inside the project and validates with the overrides, as the job will run it
    (from the project directory, on nodes x processes per node), without torch; returns warnings, adds
    the hub repositories it names to ``refs``, and to the job's notes which DeepSpeed config the
    deepspeed launcher's ranks get."""
    from ctrain.train.hubrefs import recipe_refs
    from ctrain.train.preflight import preflight as check_paths
    from ctrain.train.recipe import load_recipe

    path = project_file(job, job.settings["CTRAIN_RECIPE"], "the recipe")
    overrides = list(job.overrides)  # as the library took them from the arguments (ctrain_arguments)
    added = protocol.launcher_overrides(job.settings["CTRAIN_LAUNCHER"], job.settings["CTRAIN_DEEPSPEED_CONFIG"],
                                        own_command=False)  # fmt: skip
    recipe = load_recipe(path, overrides + added)
    if added:  # the job's notes (not a warning): which config the ranks get
        job.notes.append(_deepspeed_note(recipe.training.deepspeed, load_recipe(path, overrides).training.deepspeed,
                                         job.settings["CTRAIN_DEEPSPEED_CONFIG"]))  # fmt: skip
    with _cwd(job.project):
        if refs is not None:  # the hub names it needs, for check_hub_cache
            refs += recipe_refs(recipe)
        try:
            notes = check_paths(recipe, world_size=job.world_size)
        except ConfigError as exc:
            if not any(target in str(exc) for target in _CONTAINER_TARGETS):
                raise
            notes = [f"not checked from here (a path inside the container): {exc}"]
        check_output_dir(job, recipe)
        if "$" not in (recipe.training.output_dir or "") and (found := _on_host(recipe.output_dir, job)) is not None:
            job.output_dir = found.absolute()  # for the project's history (ctrain results)
            notes += requeues_needed(job, recipe.training.max_steps)
    return notes


def check_sweep_recipe(job: Job, refs: list[HubRef]) -> list[str]:
    """Every task of a sweep checked as its job runs it (the recipe with the task's overrides): a value the
    recipe refuses is named with its task before the array is queued. The warnings are the first task's."""
    from dataclasses import replace

    warnings: list[str] = []
    for task in job.sweep or []:
        each = replace(job, overrides=[*job.overrides, *task.words], notes=[], output_dir=None, sweep=None)
        try:
            said = check_job_recipe(each, refs)
        except ConfigError as exc:
            raise ConfigError(f"sweep task {task.index} ({task.name}): {exc}", key=exc.key) from None
        if task.index == 0:
            warnings += said
            job.notes += each.notes
        if each.output_dir is not None:
            job.sweep_outputs[task.index] = each.output_dir
    return warnings


def requeues_needed(job: Job, max_steps: int | None) -> list[str]:
    """Where the run's output directory holds an earlier run's pace (metrics.jsonl) and the rest of the run
    is longer than the time limit: a note of how many requeues that takes, or a warning where that is more
    than CTRAIN_MAX_REQUEUES (the run would stop short). Nothing is estimated for a run never trained."""
    from ctrain.jobs.results import pace

    if job.limit_seconds is None or not max_steps or job.output_dir is None:
        return []
    found = pace(job.output_dir)
    if found is None or found[0] >= max_steps:
        return []
    step, seconds_per_step = found
    rest = (max_steps - step) * seconds_per_step
    if rest <= job.limit_seconds:
        return []
    from ctrain.train.goodput import shown_duration

    needed = math.ceil(rest / job.limit_seconds) - 1
    allowed = int(job.settings["CTRAIN_MAX_REQUEUES"])  # resolved by the library, its default included
    said = (f"the run has about {shown_duration(rest)} to go ({max_steps - step} steps at {seconds_per_step:.3g} s a "
            f"step, as its last run in {job.output_dir} trained) and its time limit is "
            f"{shown_duration(job.limit_seconds)}: it needs at least {needed} requeue(s)")  # fmt: skip
    if needed <= allowed:
        job.notes.append(f"{said}, within slurm.max_requeues ({allowed})")
        return []
    return [f"{said}, more than slurm.max_requeues ({allowed}) allows, so it would stop short: ask for a longer "
            "--time (up to the partition's MaxTime), or raise slurm.max_requeues"]


def _deepspeed_note(gets: str | None, own: str | None, default: str) -> str:
    """Which DeepSpeed config the deepspeed launcher's ranks get, and from where."""
    if own:
        return (f"DeepSpeed config the ranks get: {gets} (the recipe's or an override's; the launcher's "
                f"{default} applies only where none is named)")  # fmt: skip
    return f"DeepSpeed config the ranks get: {gets} (the launcher's, CTRAIN_DEEPSPEED_CONFIG: the recipe names none)"


def _on_host(path: Path, job: Job) -> Path | None:
    """Where the job's ``path`` (as the container sees it) is on this machine: a relative path as it is (the job's
    working directory is the project's, and so is ours: :func:`_cwd`), the project for /workspace, CTRAIN_OUTPUTS
    for /outputs; None for the other mounts (/data, /hf_home), not checked here."""
    if not path.is_absolute():
        return path
    for target, host in (("/workspace", str(job.project)), ("/outputs", job.settings.get("CTRAIN_OUTPUTS"))):
        if path.is_relative_to(target):
            return Path(host) / path.relative_to(target) if host else None
    return None if any(path.is_relative_to(target) for target in _CONTAINER_TARGETS) else path


def check_output_dir(job: Job, recipe: Recipe) -> None:
    """Refuse at submit what the job would refuse as its training.output_dir once it starts: a file there (/dev/null),
    or a directory that holds files no ctrain run wrote (/, the project's recipes/): :func:`rundir.check_owned`, with
    the job's own message. A path with variables is the job's environment's to say, and is not checked."""
    from ctrain.files import check_directory
    from ctrain.train.artifacts import PREPARED_DIR
    from ctrain.train.recipe import expand_path
    from ctrain.train.rundir import check_owned

    value, prepared_value = recipe.training.output_dir, recipe.data.prepared_dir
    if not value or "$" in value or "$" in (prepared_value or ""):
        return
    output_dir = _on_host(recipe.output_dir, job)
    if output_dir is None:
        return
    prepared = _on_host(expand_path(prepared_value), job) if prepared_value else None
    if os.path.lexists(output_dir) and not output_dir.is_dir():
        check_directory(output_dir, "training.output_dir", "set training.output_dir to a directory you can write")
    with contextlib.suppress(OSError):  # a directory this user cannot list: the job's own checks say so
        check_owned(output_dir, prepared or output_dir / PREPARED_DIR)


@contextlib.contextmanager
def _cwd(directory: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def project_file(job: Job, name: str, what: str) -> Path:
    path = Path(name) if Path(name).is_absolute() else job.project / name
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".py", ".json"))[:5]
        raise ConfigError(f"{what} {name} is a directory: name a file in it"
                          + (f" (such as {name.rstrip('/')}/{inside[0]})" if inside else ""))  # fmt: skip
    if not path.is_file():
        siblings = sorted(p.name for p in path.parent.iterdir() if p.suffix == path.suffix)[:1000] \
            if path.parent.is_dir() else []  # fmt: skip
        close = difflib.get_close_matches(path.name, siblings, n=1)
        guess = f"did you mean {str(Path(name).parent / close[0]).removeprefix('./')}? " if close else ""
        raise ConfigError(f"{what} {name} does not exist ({guess}paths are relative to the project directory "
                          f"{job.project})")  # fmt: skip
    inside_project(path, job.project, what)
    return path


def check_gpus(job: Job, client: slurm.Slurm) -> list[str]:
    """Requested GPUs per node against what the partition's nodes have (sinfo)."""
    wanted = node_gpus(job.options)
    partition = job.options.get("partition")
    if not client.runner.has("sinfo"):
        return []
    have = client.partition_gpus(partition)
    where = f"partition '{partition}'" if partition else "this cluster"
    if wanted is not None:
        if have is not None and wanted > have:
            raise ConfigError(
                f"{wanted} GPUs per node requested, but the nodes of {where} have at most {have}"
                + ("; choose a GPU partition (slurm.partition, --partition)" if have == 0 else "")
            )
        return []
    if have:
        advice = "set slurm.gpus_per_node or --gpus-per-node"
        return [f"no GPUs requested although {where} has nodes with {have}: training runs on CPU ({advice})"]
    return []


def command_script(command: list[str]) -> str | None:
    """The Python file a command runs (``train.py ...``, ``python -u train.py ...``), None for ``-m``
    and other programs: it must be in the project, which is the job's working directory."""
    words = command[1:] if Path(command[0]).name.startswith("python") else command
    for word in words:
        if word == "-m" or not word.startswith("-"):
            return word if word.endswith(".py") else None
    return None
