"""The ``ctrain`` command line: the root group, ``init``, ``doctor`` and the training commands; each
other area's commands live in its own ``cli.py`` (``ctrain.image.cli``, ``ctrain.jobs.cli``, ...) and
are gathered here. Heavy imports stay inside the commands, so ``ctrain --help`` is quick.

Each command parses its options and calls one library function; errors a user can fix are
``CtrainError`` and are printed as one clear message (no traceback) with a non-zero exit.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import click

from ctrain import __version__
from ctrain.bench import cli as bench_cli
from ctrain.clicore import project
from ctrain.cluster import cli as cluster_cli
from ctrain.errors import CtrainError
from ctrain.image import cli as image_cli
from ctrain.jobs import cli as jobs_cli
from ctrain.redact import redact
from ctrain.testbed import cli as testbed_cli

__all__ = ["main", "project"]

# What the system says when a place cannot be written: the user's to fix (another directory, space,
# a shorter name), not a bug; any other OSError stays a traceback, for the bug it is.
_USER_ERRNOS = {
    errno.EROFS: "choose a directory on a writable file system",
    errno.EACCES: "choose a directory you can write, or fix its owner or permissions",
    errno.EPERM: "choose a directory you can write, or fix its owner or permissions",
    errno.ENOSPC: "free some space, or choose a directory on another file system",
    errno.EDQUOT: "free some space within your quota, or choose a directory on another file system",
    errno.ENAMETOOLONG: "choose a shorter name",
}


def _os_error(exc: OSError) -> str:
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{paths + ': ' if paths else ''}{os.strerror(exc.errno or 0).lower()} ({code}): {_USER_ERRNOS[exc.errno]}"


def _error(message: str) -> None:
    """The one ``error:`` line, credentials masked; under ``ctrain train``'s rank prefix it still starts the line."""
    message = redact(message)
    stream = sys.stderr
    if hasattr(stream, "write_marked"):
        stream.write_marked("error: ", message)
    else:
        click.echo(f"error: {message}", err=True)


class _Group(click.Group):
    """Turns :class:`CtrainError`, bad option values (a missing ``--file``, an unknown ``--to``, with a
    pointer to --help) and the file system's refusals into one ``error: ...`` line (credentials
    masked) and a non-zero exit."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except CtrainError as exc:
            _error(str(exc))
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            hint = ""
            if isinstance(exc, click.UsageError):
                hint = f" (see {exc.ctx.command_path if exc.ctx else 'ctrain'} --help)"
            _error(exc.format_message() + hint)
            sys.exit(exc.exit_code)
        except OSError as exc:
            if exc.errno not in _USER_ERRNOS:
                raise
            _error(_os_error(exc))
            sys.exit(1)


@click.group(
    name="ctrain", cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, prog_name="ctrain")
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Project config (default: $CTRAIN_CONFIG, else ctrain.yaml here or in a parent directory).",
)
def main(config: Path | None) -> None:
    """ctrain: take a Hugging Face training run from a laptop to a Slurm cluster, in a container.

    \b
    Typical flow:
      ctrain init my-project && cd my-project a new project: ctrain.yaml, recipes/, sbatch/, containers/
      ctrain doctor --for build --for sif     what this machine can do
      ctrain build && ctrain push             training image -> SIF/sqsh -> registry or cluster
      ctrain submit --nodes 2 RECIPE.yaml     multi-node training through sbatch
      ctrain testbed up                       a real Slurm cluster on this machine, for trying it all
    """


@main.command()
@click.argument("directory", type=click.Path(path_type=Path), default=".")
@click.option("--force", is_flag=True, help="Refresh ctrain's own files (sbatch/, containers/); your ctrain.yaml "
              "and recipes only where they are unchanged copies.")  # fmt: skip
@click.option("--upgrade", is_flag=True, help="Write nothing: list the project's files that differ from this "
              "ctrain's; exit 1 if any of ctrain's own files (sbatch/, containers/) differ or are missing.")  # fmt: skip
def init(directory: Path, force: bool, upgrade: bool) -> None:
    """Write a new ctrain project into DIRECTORY (default: here).

    \b
    It gets ctrain.yaml (the choices to make: runtime, image, partition), recipes/ (the starter
    SFT recipe demo-addition.yaml and examples), sbatch/ and containers/ (ctrain's scripts and
    image definitions, yours to read and run) and a .gitignore for images, outputs and logs.
    An existing file stops it before anything is written.
    """
    from ctrain import project as projects
    from ctrain.ui import info, table

    if force and upgrade:
        raise click.UsageError("--force and --upgrade exclude each other: --upgrade only reports")
    if upgrade:
        differences = [d for d in projects.compare(directory) if d.status != "same"]
        rows = [(str(d.path), "ctrain's" if d.owned else "yours", d.status) for d in differences]
        if rows:
            click.echo(table(("file", "owner", "status"), rows))
        stale = [d for d in differences if d.owned]
        written_by = projects.written_by(directory)
        info(f"{len(stale)} of ctrain's files differ from ctrain {__version__}"
             + (f" (the project was written by ctrain {written_by})" if written_by else "")
             + ("; `ctrain init --force` refreshes them (yours stay as they are)" if stale else ""))  # fmt: skip
        if stale:
            sys.exit(1)
        return
    written = projects.init(directory, force=force, emit=info)
    info(f"wrote {len(written)} file(s) to {directory}" + ("" if force else
         f"\n  next: edit {directory / 'ctrain.yaml'} (runtime, image, partition), then ctrain submit --dry-run"))  # fmt: skip


@main.command()
@click.option(
    "--for",
    "workflows",
    multiple=True,
    metavar="WORKFLOW",
    help="Fail (exit 1) unless this workflow is ready; repeatable. "
    "One of: build, sif, sqsh, push, slurm, apptainer-jobs, gpu, train, cluster.",
)
def doctor(workflows: tuple[str, ...]) -> None:
    """Show which tools are present for each workflow, and what is missing.

    Checks container tools, Slurm (and whether its controller answers), GPUs, the Python
    training stack and the ParallelCluster CLI.
    """
    from ctrain.doctor import report

    text, ready = report(list(workflows))
    click.echo(text, nl=False)
    if not ready:
        sys.exit(1)



# --- training: prepare / train / eval ------------------------------------------------------------


def _recipe(path: Path, overrides: tuple[str, ...]) -> object:
    from ctrain.train.recipe import load_recipe

    return load_recipe(path, list(overrides))


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@click.option(
    "--check", is_flag=True, help="Only check the recipe (schema, paths, data columns, sizes); needs no torch."
)
@click.option("--world-size", type=int, help="With --check: also check the batch divides among this many processes.")
def train(recipe: Path, overrides: tuple[str, ...], check: bool, world_size: int | None) -> None:
    """Train RECIPE (a YAML file), with KEY=VALUE OVERRIDES on top (e.g. training.max_steps=100).

    \b
    The same command runs as one process, under torchrun, accelerate launch or DeepSpeed:
      ctrain train recipes/demo-addition.yaml
      torchrun --nproc-per-node 4 -m ctrain train RECIPE.yaml
    Resumes from the newest complete checkpoint in the output directory that verifies (damaged
    ones are moved aside). Exit 75: stopped on a preemption signal after saving a checkpoint
    (requeue to resume). Exit 65: stopped at a NaN or infinite loss before saving it (do not
    requeue). See docs/training.md.
    """
    from ctrain.train.recipe import check_recipe

    loaded = _recipe(recipe, overrides)
    if check:
        for note in check_recipe(loaded, world_size=world_size):  # type: ignore[arg-type]
            click.echo(f"note: {note}")
        click.echo(f"recipe {recipe} is valid")
        return
    from ctrain.train.callbacks import exit_process
    from ctrain.train.trainer import run

    exit_process(run(loaded))  # type: ignore[arg-type]


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@click.option("--output", "-o", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write it (default: data.prepared_dir, else OUTPUT_DIR/prepared).")  # fmt: skip
@click.option("--force", is_flag=True, help="Replace prepared data made from other settings.")
def prepare(recipe: Path, overrides: tuple[str, ...], output: Path | None, force: bool) -> None:
    """Tokenize (and pack) RECIPE's data once, into a data set on disk that `ctrain train` loads.

    Uses every CPU of this machine (data.num_proc). Run it before multi-node jobs, on storage all
    nodes share: training then never tokenizes. `ctrain train` refuses prepared data that no
    longer matches the recipe (tokenizer, max_length, packing, source files).
    """
    from ctrain.train.recipe import check_recipe

    loaded = _recipe(recipe, overrides)
    notes = check_recipe(loaded)  # type: ignore[arg-type]
    from ctrain.train import logs
    from ctrain.train.data import check_cache, check_target
    from ctrain.train.data import prepare as run_prepare

    target = output or loaded.prepared_dir  # type: ignore[attr-defined]
    check_target(target)
    check_cache(loaded)  # type: ignore[arg-type]
    logs.setup(prefix=False)
    logs.quiet_libraries()
    for note in notes:
        click.echo(f"note: {note}", err=True)
    info = run_prepare(loaded, target, force=force)  # type: ignore[arg-type]
    for split, stats in info["stats"].items():
        click.echo(f"{split}: {stats['rows']} rows, {stats['tokens']} tokens ({stats['loss_tokens']} with loss)")
    click.echo(f"prepared: {target}")


@main.command(name="eval")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model directory (default: the recipe's OUTPUT_DIR/final).")  # fmt: skip
@click.option("--max-examples", type=click.IntRange(min=1), help="Ask only the first N held-out examples.")
@click.option("--min-accuracy", type=click.FloatRange(0, 1), help="Exit 1 when the accuracy is below this "
              "(for scripts and CI).")  # fmt: skip
def eval_(recipe: Path, overrides: tuple[str, ...], model_dir: Path | None, max_examples: int | None,
          min_accuracy: float | None) -> None:  # fmt: skip
    """Exact-match accuracy of the trained model on RECIPE's held-out examples (generation).

    \b
    For the demo: ctrain eval recipes/demo-addition.yaml --min-accuracy 0.9
    Writes OUTPUT_DIR/eval.json. Refuses a model directory that ctrain did not finish saving (no
    ctrain-complete.json) or whose files changed since (checksums).
    """
    from ctrain.train import logs
    from ctrain.train.evaluate import check, evaluate
    from ctrain.train.trainer import openmp_defaults

    loaded = _recipe(recipe, overrides)
    check(loaded, model_dir)  # type: ignore[arg-type]
    openmp_defaults()
    logs.setup(prefix=False)
    logs.quiet_libraries()
    result = evaluate(loaded, model_dir, max_examples)  # type: ignore[arg-type]
    for example in result["examples"]:
        click.echo(f"  {example['prompt']!r} -> {example['answer']!r} (expected {example['expected']!r})")
    click.echo(f"accuracy: {result['accuracy']:.3f} ({result['correct']}/{result['total']} exact) {result['model']}")
    if min_accuracy is not None and result["accuracy"] < min_accuracy:
        click.echo(f"error: accuracy {result['accuracy']:.3f} is below --min-accuracy {min_accuracy}", err=True)
        sys.exit(1)


# The other areas' commands live next to their code; ctrain.train's stay here for now.
main.add_command(image_cli.build)
main.add_command(image_cli.wheelhouse_cmd)
main.add_command(image_cli.convert)
main.add_command(image_cli.push)
main.add_command(jobs_cli.submit)
main.add_command(jobs_cli.status)
main.add_command(jobs_cli.logs)
main.add_command(jobs_cli.cancel)
main.add_command(testbed_cli.testbed)
main.add_command(cluster_cli.cluster)
main.add_command(bench_cli.bench)
