"""The ``ctrain`` command line: thin click commands over the library modules.

Each command parses its options and calls one library function; errors a user can fix are
``CtrainError`` and are printed as one clear message (no traceback) with a non-zero exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ctrain import __version__
from ctrain.config import ProjectConfig, load_config
from ctrain.errors import CtrainError


class _Group(click.Group):
    """Turns :class:`CtrainError` into ``error: ...`` and the error's exit code."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except CtrainError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)


def project(ctx: click.Context) -> ProjectConfig:
    """The project config, loaded once per invocation (``--config`` or ``ctrain.yaml``)."""
    root = ctx.find_root()
    if "config" not in root.meta:
        root.meta["config"] = load_config(root.params.get("config"))
    return root.meta["config"]


@click.group(name="ctrain", cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
      ctrain doctor --for build --for sif     what this machine can do
      ctrain build && ctrain push             training image -> SIF/sqsh -> registry or cluster
      ctrain submit --nodes 2 RECIPE.yaml     multi-node training through sbatch
      ctrain testbed up                       a real Slurm cluster on this machine, for trying it all
    """


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


# --- testbed ------------------------------------------------------------------------------------

# --- image: build / convert / push -----------------------------------------------------------------

# --- training: prepare / train / eval ------------------------------------------------------------

# --- slurm: submit / status / logs / cancel ------------------------------------------------------

# --- cluster ---------------------------------------------------------------------------------------

# --- bench -----------------------------------------------------------------------------------------
