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


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("recipe", required=False)
@click.argument("overrides", nargs=-1)
@click.option("--script", "-s", help="Script in sbatch/ (apptainer, apptainer_multinode, pyxis, pyxis_multinode) "
              "or a path (default: slurm.script, else RUNTIME for 1 node, RUNTIME_multinode for more).")  # fmt: skip
@click.option("--runtime", type=click.Choice(["apptainer", "pyxis"]), help="Container runtime (default: slurm.runtime).")
@click.option("--nodes", "-N", type=int, help="Number of nodes.")
@click.option("--time", "-t", "time_limit", help="Time limit, e.g. 04:00:00 or 2-00:00:00.")
@click.option("--partition", "-p", help="Partition (queue).")
@click.option("--account", "-A", help="Account to charge.")
@click.option("--gpus-per-node", type=int, help="GPUs per node; one training process each.")
@click.option("--ntasks-per-node", type=int, help="Processes per node on nodes without GPUs.")
@click.option("--image", help="Image: a .sif/.sqsh path, or a registry reference (pyxis).")
@click.option("--launcher", type=click.Choice(["torchrun", "accelerate", "deepspeed"]), help="Launcher (default: torchrun).")
@click.option("--job-name", "-J", help="Job name (names the log: logs/NAME-JOBID.out).")
@click.option("--dry-run", is_flag=True, help="Print the sbatch command and the exact script; queue nothing.")
@click.option("--wait", "wait_", is_flag=True, help="Follow the job's log until it ends; exit 1 unless it completed.")
@click.pass_context
def submit(ctx: click.Context, recipe: str | None, overrides: tuple[str, ...], script: str | None, runtime: str | None,
           nodes: int | None, time_limit: str | None, partition: str | None, account: str | None,
           gpus_per_node: int | None, ntasks_per_node: int | None, image: str | None, launcher: str | None,
           job_name: str | None, dry_run: bool, wait_: bool) -> None:  # fmt: skip
    """Train RECIPE on the cluster: render an sbatch/ script with ctrain.yaml's `slurm:` settings,
    check it, and queue it.

    \b
    Checked before anything is queued: the image exists and suits the runtime, the recipe (with
    KEY=VALUE OVERRIDES) validates, the partition has the GPUs asked for.
      ctrain submit --nodes 2 recipes/demo-addition.yaml training.max_steps=200
      ctrain submit --dry-run --nodes 16 --gpus-per-node 8 RECIPE     show exactly what would run
    """
    from ctrain import slurm
    from ctrain import submit as jobs
    from ctrain.ui import info

    job = jobs.prepare(project(ctx), recipe=recipe, overrides=overrides, script=script, runtime=runtime, nodes=nodes,
                       time=time_limit, partition=partition, account=account, gpus_per_node=gpus_per_node,
                       ntasks_per_node=ntasks_per_node, image=image, launcher=launcher, job_name=job_name)  # fmt: skip
    if dry_run:
        click.echo(job.describe(), nl=False)
    for warning in jobs.check(job):
        info(f"warning: {warning}")
    if dry_run:
        return
    job_id, copy = jobs.submit(job)
    click.echo(job_id)
    log = job.log_dir / f"{job.options.get('job-name') or 'slurm'}-{job_id}.out"
    info(f"submitted job {job_id}: log {log}, script {copy}\n  follow: ctrain logs -f {job_id}")
    if wait_:
        final = slurm.follow(job_id, emit=click.echo, search=[job.log_dir])
        state = final.state if final else "UNKNOWN"
        info(f"job {job_id}: {state}")
        if state != "COMPLETED":
            sys.exit(1)


@main.command()
@click.argument("job_ids", nargs=-1)
def status(job_ids: tuple[str, ...]) -> None:
    """Show jobs: the given JOB_IDS (queued, running or finished), else your queued and running jobs."""
    from ctrain import slurm

    click.echo(slurm.status_table(slurm.status(job_ids)))


@main.command()
@click.argument("job_id")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the log grows, until the job ends.")
def logs(job_id: str, follow: bool) -> None:
    """Print a job's log (Slurm's StdOut, else logs/*-JOB_ID.out)."""
    from ctrain import slurm

    if follow:
        slurm.follow(job_id, emit=click.echo)
        return
    click.echo(slurm.log_path(job_id).read_text(errors="replace"), nl=False)


@main.command()
@click.argument("job_id")
@click.option("--signal", "-s", "signal_name", help="Send this signal to the job's steps instead (e.g. USR1).")
def cancel(job_id: str, signal_name: str | None) -> None:
    """Cancel a job (scancel), or send its steps a signal."""
    from ctrain import slurm

    slurm.cancel(job_id, signal=signal_name)
    click.echo(f"job {job_id}: " + (f"sent SIG{signal_name.upper().removeprefix('SIG')}" if signal_name else "cancelled"))


# --- cluster ---------------------------------------------------------------------------------------

# --- bench -----------------------------------------------------------------------------------------
