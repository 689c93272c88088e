"""``ctrain submit``: one of the scripts in ``sbatch/``, with the project's settings, rendered into a
self-contained job script, checked, and queued.

The rendered script is the chosen script with its ``#SBATCH`` lines updated from ctrain.yaml and
the command line, a settings block (``CTRAIN_*`` exports and the recipe arguments), and the
library it sources inlined, so what runs does not change when the checkout does (a requeued job
runs the same text). ``--dry-run`` prints exactly that text and the sbatch command; a submitted
job's copy is kept as ``logs/NAME-JOBID.sbatch`` beside its log.

Settings the scripts default themselves are resolved by the script library itself (bash), so
Python never restates a default. The job and its sizing are in :mod:`ctrain.jobs.job`, its
``#SBATCH`` header in :mod:`ctrain.jobs.options`, its rendering in :mod:`ctrain.jobs.render`, the
checks before it is queued in :mod:`ctrain.jobs.checks` (the image's in :mod:`ctrain.image.checks`);
this module prepares, writes and queues it, and keeps their names importable from here.
"""

from __future__ import annotations

import os
from pathlib import Path

from ctrain import slurm
from ctrain.config import ProjectConfig, SlurmConfig
from ctrain.errors import ConfigError, CtrainError
from ctrain.files import atomic_write_text, control_problem, shorten
from ctrain.image.checks import IMAGE_SUFFIXES, MissingImage, check_image, image_facts, image_is_file  # noqa: F401
from ctrain.jobs.checks import (_CONTAINER_TARGETS, check, check_gpus, check_job_recipe,  # noqa: F401
                                check_output_dir, check_signal, command_script)  # fmt: skip
from ctrain.jobs.job import (MIN_CPUS_PER_GPU, Job, cpu_warning, cpus_per_gpu, gpu_resources,  # noqa: F401
                             node_gpus, option_count)  # fmt: skip
from ctrain.jobs.library import (LIB, MAX_SCRIPT_BYTES, SOURCE_LINE, assemble, library_notes,  # noqa: F401
                                 library_version, read_script)  # fmt: skip
from ctrain.jobs.options import directive, render_header, sbatch_options  # noqa: F401
from ctrain.jobs.render import (RENDERED_MARK, check_mount_sources, choose_script, host_path,  # noqa: F401
                                library_path, render, resolve_settings, script_runtime, scripts_dir,
                                settings_env, split_script)  # fmt: skip
from ctrain.jobs.sweep import Task, array_spec, table_path, table_text
from ctrain.jobs.sweep import tasks as sweep_tasks
from ctrain.settings import override
from ctrain.slurmconfig import SETTINGS

_cpus_per_gpu = cpus_per_gpu  # its name before the split


def prepare(
    config: ProjectConfig, *, recipe: str | None = None, overrides: tuple[str, ...] = (),
    command: tuple[str, ...] | None = None, client: slurm.Slurm | None = None, fetch: tuple[str, ...] = (),
    sweep: list[dict[str, str]] | None = None, max_parallel: int | None = None, **changes: object,
) -> Job:  # fmt: skip
    """Render the job for ``config.slurm`` with command-line ``changes`` on top: ``slurm:`` keys (nodes=,
    time=, image=, ...; the flags of submit and preflight, typed by :mod:`ctrain.jobs.flags`), checked as in
    ctrain.yaml; None leaves a setting as configured. A GPU job that names no CPUs or memory gets them from
    what ``client``'s sinfo says the nodes have. ``command``: the user's own program instead of a recipe (the
    words after ``--``). ``sweep``: the sets of values of a sweep (:mod:`ctrain.jobs.sweep`), one job array
    with a task each, at most ``max_parallel`` running at once."""
    try:
        c = override(config.slurm, changes, where="slurm")
    except ConfigError as exc:
        raise _as_typed(exc, changes) from exc
    project = config.root
    template = choose_script(c, project, c.nodes)
    runtime = script_runtime(template)
    c, notes = _sized(c, template, client)
    lib = library_path(template, project)
    notes += library_notes(lib)
    env = settings_env(c, config, project, runtime)
    if command is not None:
        arguments = command_arguments(command, recipe, overrides)
    else:
        arguments = recipe_arguments(c, recipe, overrides)
    settings, recipe_overrides = resolve_settings(lib, runtime, arguments, env, project)
    pairs = sbatch_options(c)
    tasks = None
    if sweep is not None:
        tasks = _sweep_tasks(sweep, arguments, settings, recipe_overrides, project)
        env["CTRAIN_SWEEP"] = table_path(table_text(tasks))
        pairs.append(("array", array_spec(len(tasks), max_parallel)))
    elif max_parallel is not None:
        raise ConfigError("--max-parallel is for a sweep's tasks: give --sweep KEY=V1,V2 (or --sweep-file) too")
    text, options = render(template, assemble(lib), pairs, env, arguments)
    stated = _stated(settings["CTRAIN_IMAGE"], runtime, project)
    if stated.get("min_driver") and "CTRAIN_IMAGE_MIN_DRIVER" not in env:  # for the node checks on each node
        env["CTRAIN_IMAGE_MIN_DRIVER"] = settings["CTRAIN_IMAGE_MIN_DRIVER"] = str(stated["min_driver"])
        text, options = render(template, assemble(lib), pairs, env, arguments)
    check_mount_sources(settings)
    warning = cpu_warning(options)
    notes += [warning] if warning else []
    return Job(template, runtime, text, project, settings, arguments, options, notes, recipe_overrides,
               [*config.fetch, *fetch], image_stated=stated, sweep=tasks)  # fmt: skip


def _sweep_tasks(sets: list[dict[str, str]], arguments: list[str], settings: dict[str, str],
                 overrides: list[str], project: Path) -> list[Task]:  # fmt: skip
    """A sweep's tasks, a recipe's each with its output directory under the recipe's (as the job names it)."""
    command = arguments[1:] if arguments[:1] == ["--"] else None
    base = None
    if command is None:
        from ctrain.train.recipe import load_recipe

        try:  # a recipe that does not load is refused by the checks, with the first thing to fix first
            base = str(load_recipe(project / settings["CTRAIN_RECIPE"], overrides).output_dir)
        except (ConfigError, OSError):
            base = None
    return sweep_tasks(sets, command=command, output_base=base)


def _stated(image: str, runtime: str, project: Path) -> dict[str, object]:
    """What the image says it is ({}: nothing, or no image yet: the checks say so, a dry run goes on)."""
    try:
        return image_facts(image, runtime, project) or {}
    except CtrainError:
        return {}


def _as_typed(exc: ConfigError, changes: dict[str, object]) -> ConfigError:
    """An error about a setting the user gave as a flag names the flag typed, not the ctrain.yaml key."""
    name = (exc.key or "").removeprefix("slurm.")
    if not exc.key or changes.get(name) is None or name not in SETTINGS:
        return exc
    from ctrain.jobs.flags import flag_names

    return ConfigError(str(exc).replace(f"slurm.{name}", flag_names(name)[0], 1), key=exc.key)


def _sized(c: SlurmConfig, template: Path, client: slurm.Slurm | None) -> tuple[SlurmConfig, list[str]]:
    """The settings with the CPUs and memory a GPU job that names none gets (:func:`gpu_resources`), from the
    options as the script's header and the settings give them, and the notes that say so."""
    _, asked = render_header(split_script(read_script(template, "the sbatch script"))[0], sbatch_options(c))
    shapes = None
    if node_gpus(asked) and client is not None and client.runner.has("sinfo"):
        shapes = client.node_shapes(asked.get("partition"))
    derived, notes = gpu_resources(c, shapes, asked)
    return (override(c, derived, where="slurm") if derived else c), notes


def recipe_arguments(c: SlurmConfig, recipe: str | None, overrides: tuple[str, ...]) -> list[str]:
    """The script's arguments for a recipe: the recipe (else ``slurm.recipe``), then KEY=VALUE overrides."""
    recipe_arg = recipe or (str(c.recipe) if c.recipe else None)
    for item in [*([recipe] if recipe else []), *overrides]:
        problem = control_problem(item)
        if problem:
            raise ConfigError(
                f"the argument {shorten(item)!r} {problem}: a recipe path or key=value override is one line"
            )
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key=value (e.g. training.max_steps=100)")
    if recipe_arg and "=" in recipe_arg:
        raise ConfigError(f"the recipe comes first, then key=value overrides; got {recipe_arg!r} as the recipe")
    return [*([recipe_arg] if recipe_arg else []), *overrides]


def command_arguments(command: tuple[str, ...], recipe: str | None, overrides: tuple[str, ...]) -> list[str]:
    """The script's arguments for a command of the user's own: ``--`` and its words, each one line."""
    if recipe or overrides:
        given = " ".join([*([recipe] if recipe else []), *overrides])
        raise ConfigError(f"give a recipe or a command after --, not both (got {shorten(given)!r} before --)")
    if not command:
        raise ConfigError("nothing after --: give the command to run, e.g. ctrain submit -- train.py --lr 1e-4")
    for item in command:
        problem = control_problem(item)
        if problem:
            raise ConfigError(f"the command's word {shorten(item)!r} {problem}: each word is one line")
    return ["--", *command]


def check_project_found(config: ProjectConfig, recipe: str | None) -> None:
    """With no ctrain.yaml here or above, the working directory would become the project (mounted as
    /workspace, its logs/ and outputs/ made): refuse that where the recipe typed lies in a project
    below, and name it, instead of submitting from its parent."""
    if config.path is not None or not recipe or "=" in recipe:
        return
    from ctrain.config import CONFIG_NAME

    here = Path.cwd().resolve()
    typed = (here / recipe).resolve()
    for directory in typed.parents:
        if directory == here or here not in directory.parents:
            break
        if (directory / CONFIG_NAME).is_file():
            shown = directory.relative_to(here)
            raise ConfigError(f"{recipe} is in the project {shown}/ (its {CONFIG_NAME}), and there is no {CONFIG_NAME} "
                              f"here or above: run from the project (cd {shown}), or give ctrain --config "
                              f"{shown / CONFIG_NAME}")  # fmt: skip


def from_here(recipe: str | None, root: Path) -> str | None:
    """A recipe path as typed, relative to the working directory as for ``ctrain train``, made
    relative to the project directory ``root``, where the job runs (``recipes/x.yaml`` typed in the
    project's ``recipes/`` as ``x.yaml``). A path that names no file from here, or one typed outside
    the project (``ctrain --config PROJECT/ctrain.yaml submit``), stays relative to the project."""
    if recipe is None or "=" in recipe or Path(recipe).is_absolute():
        return recipe
    here = Path.cwd() / recipe
    try:
        inside = here.resolve().relative_to(root.resolve())
    except ValueError:
        return recipe
    return str(inside) if here.is_file() else recipe


def make_log_dir(job: Job) -> None:
    """The job's log directory, made and checked before anything is queued: Slurm does not create
    the --output directory, and a job that cannot write its log fails without a word."""
    from ctrain.files import creatable_dir_problem, make_dirs

    fix = "run from a project directory you can write, or point --output (#SBATCH) elsewhere"
    problem = creatable_dir_problem(job.log_dir)
    if problem:
        raise CtrainError(f"the job could not write its log: {problem}: {fix}")
    make_dirs(job.log_dir, fix)


def write_script(job: Job, path: Path) -> None:
    """The rendered script to ``path``, for ``sbatch FILE`` later; checked first, written whole. An
    existing file is replaced only when it is a script ctrain wrote: never a recipe typed in the
    wrong place, a device (/dev/null) or a FIFO, which the rename would turn into a plain file."""
    from ctrain.files import writable_dir_problem

    if path.is_dir():
        raise ConfigError(f"--write-script {path} is a directory: give a file name, e.g. {path}/job.sbatch")
    if os.path.lexists(path):
        if path.is_symlink() or not path.is_file():
            kind = "a symbolic link" if path.is_symlink() else "not a regular file (a device, pipe or socket)"
            raise ConfigError(f"--write-script {path} is {kind}: ctrain replaces only a script it wrote; give "
                              "a new file name")  # fmt: skip
        try:
            ours = RENDERED_MARK in read_script(path, "--write-script").splitlines()
        except ConfigError:
            ours = False
        if not ours:
            raise ConfigError(f"--write-script {path} exists and is not a script ctrain wrote: not replacing it; "
                              "give a new file name (or remove the file first)")  # fmt: skip
    problem = writable_dir_problem(path.parent.absolute())
    if problem:
        raise ConfigError(f"cannot write {path}: {problem}: give --write-script a path in a directory you can write")
    make_log_dir(job)
    write_sweep(job)
    atomic_write_text(path, job.text)


PREFLIGHT_COMMAND = ("-m", "ctrain.train.health")  # the rank checks alone, under the launcher


def preflight_job(config: ProjectConfig, *, quick: bool = False, client: slurm.Slurm | None = None,
                  **changes: object) -> Job:  # fmt: skip
    """A job that only checks its nodes (``ctrain preflight``): the node checks, then the rank checks as
    its command, at ``full`` length unless QUICK; a failure is reported, never requeued."""
    return prepare(config, command=PREFLIGHT_COMMAND, client=client, job_name="preflight",
                   preflight="quick" if quick else "full", max_requeues=0, **changes)  # fmt: skip


def submit(job: Job, client: slurm.Slurm | None = None) -> tuple[str, Path]:
    """Queue the job; returns its id and its log, beside which a copy of the script is kept (.sbatch)."""
    make_log_dir(job)
    write_sweep(job)
    client = client or slurm.Slurm()
    job_id = client.sbatch([], cwd=job.project, script=job.text)
    name = str(job.options.get("job-name") or job.template.stem)
    if job.sweep:  # each task's log is named by its own job id: the script is kept by the array's
        log = job.log_dir / f"{name}-{job_id}.out"
    else:
        log = client.log_path(job_id, search=[job.log_dir])
    atomic_write_text(log.with_suffix(".sbatch"), job.text)  # replaces a link there, never writes through it
    from ctrain.jobs import history

    history.record(job.project, job_id, name, list(job.arguments), job.output_dir, sweep=job.sweep_record())
    return job_id, log


def write_sweep(job: Job) -> None:
    """A sweep's table, where its tasks read it (CTRAIN_SWEEP), before the array is queued."""
    if job.sweep:
        from ctrain.jobs.sweep import write_table

        write_table(job.project, table_text(job.sweep))
