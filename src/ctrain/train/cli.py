"""``ctrain prepare``, ``ctrain train`` and ``ctrain eval``: the commands that run inside the image.

Thin over :mod:`ctrain.train`; torch and the training stack are imported inside each command, so a
login node runs ``ctrain train --check`` (and ``ctrain --help``) without them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


def _recipe(path: Path, overrides: tuple[str, ...]) -> object:
    from ctrain.train.recipe import load_recipe

    return load_recipe(path, list(overrides))


@click.command()
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
    from ctrain.train.preflight import preflight

    if check:
        loaded = _recipe(recipe, overrides)
        for note in preflight(loaded, world_size=world_size):  # type: ignore[arg-type]
            click.echo(f"note: {note}")
        click.echo(f"recipe {recipe} is valid")
        return
    from ctrain.train import exits

    try:
        loaded = _recipe(recipe, overrides)
        from ctrain.train import stack

        stack.require("train")
        stack.hide(stack.unused(loaded))  # type: ignore[arg-type]
        from ctrain.train.trainer import run

        code = run(loaded)  # type: ignore[arg-type]
    except BaseException as exc:
        from ctrain.train.logs import exit_at_shutdown, keep_until_exit

        ended = exits.record(exc)  # for the batch script, which decides from it
        keep_until_exit(exc)  # its frames hold the trainer: see keep_until_exit
        exit_at_shutdown(ended.code)  # after the error is reported as before
        raise
    exits.record(None, code)
    from ctrain.train.logs import exit_process

    exit_process(code)


@click.command()
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
    from ctrain.train.preflight import preflight

    loaded = _recipe(recipe, overrides)
    notes = preflight(loaded)  # type: ignore[arg-type]
    from ctrain.train import logs, stack

    stack.require("prepare")
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


@click.command(name="eval")
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
    from ctrain.train import stack

    loaded = _recipe(recipe, overrides)
    stack.require("eval")
    from ctrain.train import logs
    from ctrain.train.evaluate import check, evaluate, summary
    from ctrain.train.trainer import openmp_defaults

    check(loaded, model_dir)  # type: ignore[arg-type]
    openmp_defaults()
    logs.setup(prefix=False)
    logs.quiet_libraries()
    result = evaluate(loaded, model_dir, max_examples)  # type: ignore[arg-type]
    for example in result["examples"]:
        click.echo(f"  {example['prompt']!r} -> {example['answer']!r} (expected {example['expected']!r})")
    click.echo(summary(result))
    if min_accuracy is not None and result["accuracy"] < min_accuracy:
        click.echo(f"error: accuracy {result['accuracy']:.3f} is below --min-accuracy {min_accuracy}", err=True)
        sys.exit(1)


