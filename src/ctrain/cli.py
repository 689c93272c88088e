"""The ``ctrain`` command line: thin click commands over the library modules.

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
from ctrain.config import ProjectConfig, load_config
from ctrain.errors import CtrainError
from ctrain.redact import redact

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


def project(ctx: click.Context) -> ProjectConfig:
    """The project config, loaded once per invocation (``--config`` or ``ctrain.yaml``)."""
    root = ctx.find_root()
    if "config" not in root.meta:
        root.meta["config"] = load_config(root.params.get("config"))
    return root.meta["config"]


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


# --- testbed ------------------------------------------------------------------------------------

_state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="CTRAIN_TESTBED_DIR",
    show_envvar=True,
    help="Where the testbed keeps config, state, logs and the shared dir (default: /var/lib/ctrain/testbed).",
)


@main.group()
def testbed() -> None:
    """A real multi-node Slurm + Apptainer cluster on this machine, for trying sbatch workflows.

    \b
    Each node has its own hostname and IP (network namespaces on a bridge) and shares this
    machine's filesystem; jobs run as the unprivileged user `ctrain`, as on a cluster.
      ctrain testbed up --nodes 2     start it (as root; installs Slurm, munge, Apptainer if missing)
      ctrain testbed exec -- srun -N2 hostname
      ctrain testbed down             stop it and remove everything it created
    """


@testbed.command("up")
@click.option("--nodes", "-N", type=int, default=2, show_default=True, help="Number of Slurm nodes.")
@_state_dir_option
def testbed_up(nodes: int, state_dir: Path | None) -> None:
    """Start munged, slurmctld and one slurmd per node (as root); wait until all nodes are idle.

    Running it again with the same --nodes is harmless; a half-started testbed is cleaned up first.
    """
    from ctrain.testbed import Testbed, usage

    tb = Testbed(state_dir)
    tb.up(nodes)
    click.echo(usage(tb), nl=False)


@testbed.command("down")
@_state_dir_option
@click.option("--purge", is_flag=True, help="Also remove the state directory (config, logs, munge key, shared dir) "
              "and the job user: the machine as before the first `up`.")
def testbed_down(state_dir: Path | None, purge: bool) -> None:
    """Stop the processes the testbed started and remove its namespaces, bridge and hosts lines.

    Returns once every process it stopped is gone. Works after a crash and when nothing is up.
    Config, logs and the shared dir are kept unless --purge is given.
    """
    from ctrain.testbed import Testbed

    tb = Testbed(state_dir)
    tb.down()
    if purge:
        tb.purge()


@testbed.command("status")
@_state_dir_option
@click.option("--shared-dir", "shared_dir_only", is_flag=True, help="Print only the shared dir's path (for scripts).")
def testbed_status(state_dir: Path | None, shared_dir_only: bool) -> None:
    """Show the controller and each node (name, IP, PID, Slurm state); exit 1 unless up and healthy."""
    from ctrain.testbed import Testbed
    from ctrain.ui import table

    tb = Testbed(state_dir)
    if shared_dir_only:
        click.echo(tb.shared_dir)
        return
    st = tb.status()
    if not st.up:
        click.echo(
            "testbed is down" + (f" ({'; '.join(st.problems)}; run `ctrain testbed down`)" if st.problems else "")
        )
        sys.exit(1)

    def pid(value: int | None, running: bool) -> str:
        return f"{value or '-'}" + ("" if running else " (not running)")

    rows = [["munge", "-", "-", pid(st.munged_pid, st.munged_running), "socket " + str(tb.layout.munge_socket)],
            ["controller", st.controller_host, st.controller_ip, pid(st.controller_pid, st.controller_running),
             st.controller_answer or "-"]]  # fmt: skip
    rows += [["node", n.name, n.ip, pid(n.pid, n.running), n.slurm_state] for n in st.nodes]
    click.echo(table(["role", "name", "ip", "pid", "state"], rows))
    click.echo(f"\njob user: {tb.user}   shared dir: {tb.shared_dir}   config: {tb.slurm_conf}")
    if st.problems:
        click.echo("problems: " + "; ".join(st.problems) + " (`ctrain testbed up` restarts it)")
        sys.exit(1)


@testbed.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_state_dir_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def testbed_exec(state_dir: Path | None, command: tuple[str, ...]) -> None:
    """Run COMMAND as the job user in the shared dir; exit with its code.

    For example `ctrain testbed exec -- sbatch -N2 job.sh`. Output (stdout and stderr together) is passed through as it comes.
    """
    from ctrain.testbed import Testbed

    sys.exit(Testbed(state_dir).stream_as_user(list(command), on_line=click.echo))


@testbed.command("demo-image")
@_state_dir_option
@click.argument("definition", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="SIF to write "
              "(default: DEFINITION's name in the shared dir).")  # fmt: skip
def testbed_demo_image(state_dir: Path | None, definition: Path, output: Path | None) -> None:
    """Build a small Apptainer DEFINITION into a SIF as the job user; print the SIF's path.

    `{{ busybox }}` in the definition is a static busybox from Debian's busybox-static package
    (downloaded, not installed): enough for images that need no base image, like
    examples/hello-node.def.
    """
    from ctrain.testbed import Testbed, build_demo_image

    click.echo(build_demo_image(Testbed(state_dir), definition, output))


# --- image: build / convert / push -----------------------------------------------------------------


@main.command()
@click.option(
    "--builder",
    type=click.Choice(["auto", "docker", "podman", "buildah", "apptainer"]),
    help="Default: image.builder, else auto (docker if its daemon answers, podman, buildah, apptainer).",
)
@click.option("--flavour", type=click.Choice(["gpu", "cpu"]), help="Default: image.flavour (gpu).")
@click.option("--base", metavar="REF", help="Base image (gpu: NGC PyTorch by default; cpu: python:3.11-slim-bookworm).")
@click.option("--local-base", is_flag=True, help="Make a Debian base with debootstrap (cpu, no registry needed; root).")
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False, path_type=Path),
    help="Install Python packages only from this directory: no network (see ctrain wheelhouse).",
)
@click.option("--tag", "-t", metavar="TAG|NAME:TAG", help="Default: image.name:image.tag (ctrain:latest).")
@click.option("--no-cache", is_flag=True, help="Rebuild every layer.")
@click.pass_context
def build(
    ctx: click.Context,
    builder: str | None,
    flavour: str | None,
    base: str | None,
    local_base: bool,
    wheelhouse: Path | None,
    tag: str | None,
    no_cache: bool,
) -> None:
    """Build the training image (containers/Dockerfile, or the standalone Apptainer definition).

    Streams the builder's output with the step and elapsed time on stderr; prints the image
    reference, ID and digest on stdout as `key: value` lines.
    """
    from ctrain.image.commands import run_build

    image = run_build(
        project(ctx),
        builder=builder,
        flavour=flavour,
        base=base,
        local_base=local_base,
        wheelhouse_dir=wheelhouse,
        tag=tag,
        no_cache=no_cache,
    )
    click.echo(f"image: {image.ref}\nid: {image.id}\ndigest: {image.digest or '-'}")


@main.command("wheelhouse")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.pass_context
def wheelhouse_cmd(ctx: click.Context, directory: Path) -> None:
    """Download every wheel the image installs into DIRECTORY (on a machine with network), for
    `ctrain build --wheelhouse DIRECTORY` on one without."""
    from ctrain.image.commands import run_wheelhouse

    wheels = run_wheelhouse(project(ctx), directory)
    click.echo(f"wheelhouse: {directory} ({len(wheels)} wheels)")


@main.command()
@click.option("--to", "to", type=click.Choice(["sif", "sqsh"]), help="Default: convert.to (sif).")
@click.option(
    "--compression",
    type=click.Choice(["auto", "none", "lzo", "gzip", "zstd", "xz", "lz4"]),
    help="Default: convert.compression (auto: gzip for SIF, zstd for sqsh; none starts fastest).",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Default: convert.output_dir/NAME-TAG.sif|sqsh (images/ctrain-latest.sif).",
)
@click.option("--image", "ref", metavar="REF", help="Image to convert (default: image.name:image.tag).")
@click.option("--force", is_flag=True, help="Convert even if the output is up to date.")
@click.pass_context
def convert(
    ctx: click.Context, to: str | None, compression: str | None, output: Path | None, ref: str | None, force: bool
) -> None:
    """Convert the built image to an Apptainer SIF or an enroot squashfs (for pyxis).

    Does nothing when the output was made from the same image ID with the same settings; writes
    atomically (an interrupted conversion leaves no file behind). Prints `path: FILE`.
    """
    from ctrain.image.commands import run_convert

    result = run_convert(project(ctx), to=to, compression=compression, output=output, ref=ref, force=force)
    click.echo(f"path: {result.path}\nid: {result.image_id}\ncached: {str(result.cached).lower()}")


@main.command()
@click.option("--registry", metavar="HOST/NAMESPACE", help="Push the image to this OCI registry.")
@click.option("--oras", metavar="oras://HOST/NAME:TAG", help="Push the SIF to this ORAS registry.")
@click.option(
    "--remote", metavar="[USER@]HOST:/PATH/", help="Copy SIF/sqsh files here (rsync over ssh, or a local path)."
)
@click.option(
    "--to",
    "formats",
    multiple=True,
    type=click.Choice(["sif", "sqsh"]),
    help="Which conversions go to --remote (repeatable; default: convert.to); made if missing.",
)
@click.option(
    "--file",
    "files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Send this .sif/.sqsh instead (repeatable).",
)
@click.option("--image", "ref", metavar="REF", help="Image to push (default: image.name:image.tag).")
@click.pass_context
def push(
    ctx: click.Context,
    registry: str | None,
    oras: str | None,
    remote: str | None,
    formats: tuple[str, ...],
    files: tuple[Path, ...],
    ref: str | None,
) -> None:
    """Push the image to a registry, the SIF to ORAS, and/or files to a cluster's filesystem.

    Without flags, pushes to every destination set under `push:` in ctrain.yaml. Files are checked
    by sha256 on both sides and renamed into place. Credentials come from the standard stores
    (docker/podman login, apptainer registry login, ssh keys), never from ctrain.
    """
    from ctrain.image.commands import run_push

    for pushed in run_push(
        project(ctx), registry=registry, oras=oras, remote=remote, formats=formats, ref=ref, files=files
    ):
        click.echo(f"pushed: {pushed.what} {pushed.where}")


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
    from ctrain.train.preflight import preflight

    loaded = _recipe(recipe, overrides)
    if check:
        for note in preflight(loaded, world_size=world_size):  # type: ignore[arg-type]
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
    from ctrain.train.preflight import preflight

    loaded = _recipe(recipe, overrides)
    notes = preflight(loaded)  # type: ignore[arg-type]
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


# --- slurm: submit / status / logs / cancel ------------------------------------------------------


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("recipe", required=False)
@click.argument("overrides", nargs=-1)
@click.option("--script", "-s", help="Script in sbatch/ (apptainer, apptainer_multinode, pyxis, pyxis_multinode) "
              "or a path (default: slurm.script, else RUNTIME for 1 node, RUNTIME_multinode for more).")  # fmt: skip
@click.option(
    "--runtime", type=click.Choice(["apptainer", "pyxis"]), help="Container runtime (default: slurm.runtime)."
)
@click.option("--nodes", "-N", type=int, help="Number of nodes.")
@click.option("--time", "-t", "time_limit", help="Time limit, e.g. 04:00:00 or 2-00:00:00.")
@click.option("--partition", "-p", help="Partition (queue).")
@click.option("--account", "-A", help="Account to charge.")
@click.option("--gpus-per-node", type=int, help="GPUs per node; one training process each.")
@click.option("--ntasks-per-node", type=int, help="Processes per node on nodes without GPUs.")
@click.option("--image", help="Image: a .sif/.sqsh path, or a registry reference (pyxis).")
@click.option(
    "--launcher", type=click.Choice(["torchrun", "accelerate", "deepspeed"]), help="Launcher (default: torchrun)."
)
@click.option("--job-name", "-J", help="Job name (names the log: logs/NAME-JOBID.out).")
@click.option("--dry-run", is_flag=True, help="Print the sbatch command and the exact script; queue nothing.")
@click.option("--write-script", type=click.Path(dir_okay=False, path_type=Path),
              help="Check, then write the script to this file instead of queueing it (run `sbatch FILE` "
              "from the project directory, e.g. as another user).")  # fmt: skip
@click.option("--wait", "wait_", is_flag=True, help="Follow the job's log until it ends; exit 1 unless it completed.")
@click.pass_context
def submit(ctx: click.Context, recipe: str | None, overrides: tuple[str, ...], script: str | None, runtime: str | None,
           nodes: int | None, time_limit: str | None, partition: str | None, account: str | None,
           gpus_per_node: int | None, ntasks_per_node: int | None, image: str | None, launcher: str | None,
           job_name: str | None, dry_run: bool, write_script: Path | None, wait_: bool) -> None:  # fmt: skip
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
    warnings = jobs.check(job)
    if dry_run:
        click.echo(job.describe(), nl=False)
    for warning in warnings:
        info(f"warning: {warning}")
    if dry_run:
        return
    if write_script:
        jobs.write_script(job, write_script)
        info(f"wrote {write_script}; queue it from {job.project} with: sbatch {write_script}")
        return
    job_id, log = jobs.submit(job)
    click.echo(job_id)
    info(f"submitted job {job_id}: log {log} (script: {log.with_suffix('.sbatch')})\n  follow: ctrain logs -f {job_id}")
    if wait_:
        final = slurm.follow(job_id, emit=click.echo, search=[job.log_dir])
        state = final.state if final else "UNKNOWN"
        info(f"job {job_id}: {state}")
        if state != "COMPLETED":
            sys.exit(1)


@main.command()
@click.argument("job_ids", nargs=-1)
def status(job_ids: tuple[str, ...]) -> None:
    """Show jobs: the given JOB_IDS (queued, running or finished), else your queued and running jobs.

    For each JOB_ID, also what its batch script last logged about a failure (a lost node, a failed
    rank, a hang) and whether it requeued the job."""
    from ctrain import slurm

    jobs = slurm.status(job_ids)
    click.echo(slurm.status_table(jobs))
    for job in jobs if job_ids else []:  # the jobs asked about by id: what their batch script decided
        for event in slurm.job_events(job):
            click.echo(f"job {job.id}: {event}")


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
@click.option("--signal", "-s", "signal_name", help="Send this signal to the job's batch script instead, as the "
              "time-limit warning does (USR1: checkpoint and requeue).")  # fmt: skip
def cancel(job_id: str, signal_name: str | None) -> None:
    """Cancel a job (scancel), or send its batch script a signal."""
    from ctrain import slurm

    slurm.cancel(job_id, signal=signal_name)
    click.echo(
        f"job {job_id}: " + (f"sent SIG{signal_name.upper().removeprefix('SIG')}" if signal_name else "cancelled")
    )


# --- cluster ---------------------------------------------------------------------------------------


_CLUSTER_DEFAULTS = ProjectConfig().cluster


def _target(command: click.decorators.FC) -> click.decorators.FC:
    """``--name`` and ``--region``, which every cluster command takes."""
    command = click.option("--region", help="AWS region (default: cluster.region, the config's Region, $AWS_REGION).")(
        command
    )
    return click.option("--name", help="Cluster name (default: cluster.name in ctrain.yaml, else 'ctrain').")(command)


# ctrain's own checks say what is wrong with a missing file or a directory, and what writes a good one.
_FILE = click.argument("file", required=False, type=click.Path(path_type=Path))
_SUPPRESS = click.option(
    "--suppress-validator",
    "suppress",
    multiple=True,
    metavar="TYPE",
    help="Skip one of ParallelCluster's validators, e.g. KeyPairValidator (repeatable).",
)
_POLL = click.option(
    "--poll", type=click.FloatRange(min=0), default=30.0, show_default=True, help="Seconds between status checks."
)
_TIMEOUT = click.option(
    "--timeout", type=click.FloatRange(min=1), default=60.0, show_default=True, help="Minutes to wait at most."
)


@main.group()
def cluster() -> None:
    """An AWS ParallelCluster for training: a GPU queue with EFA, FSx for Lustre, pyxis/enroot.

    \b
    From zero to a multi-node job and back (docs/cluster.md):
      ctrain cluster init --region REGION --subnet SUBNET --key-pair KEY --scripts-s3-uri s3://BUCKET/ctrain
      ctrain cluster validate       offline: ParallelCluster's schema and validators, ctrain's rules
      ctrain cluster up             create it, wait, print the head node address
      ctrain cluster ssh            on the head node: sbatch sbatch/pyxis_multinode.sbatch
      ctrain cluster down           delete it all (asks first)

    It costs money from `up` to `down`: GPU nodes (p5, p4d) cost tens of US dollars per hour each,
    and the head node and FSx file system are billed for as long as the cluster exists.
    `init --cpu-only` gives a cheap cluster for trying ctrain first.
    """


@cluster.command("init")
@_target
@click.option("--subnet", "head_node_subnet", metavar="SUBNET", help="Head node subnet (reachable for ssh).")
@click.option("--compute-subnet", metavar="SUBNET", help="Compute node subnet (default: the head node's).")
@click.option("--key-pair", metavar="NAME", help="EC2 key pair for ssh to the head node.")
@click.option(
    "--instance-type",
    "gpu_instance_type",
    metavar="TYPE",
    help=f"GPU instance type ({_CLUSTER_DEFAULTS.gpu_instance_type}).",
)
@click.option(
    "--nodes",
    "gpu_max_nodes",
    type=click.IntRange(min=1),
    help=f"Most GPU nodes the queue grows to ({_CLUSTER_DEFAULTS.gpu_max_nodes}).",
)
@click.option(
    "--capacity-reservation",
    metavar="CR_ID",
    help="Launch GPU nodes into this capacity reservation (cr-...); switches the placement group off.",
)
@click.option("--fsx-size", "fsx_size_gib", type=int, metavar="GIB", help="FSx for Lustre size in GiB.")
@click.option("--scripts-s3-uri", metavar="S3_URI", help="S3 prefix you own; `up` uploads the node scripts there.")
@click.option("--cpu-only", is_flag=True, help="Only the cheap CPU queue: try ctrain before paying for GPUs.")
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any other `cluster:` setting, e.g. --set gpu_min_nodes=1 (repeatable).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write (default: cluster.config_file, pcluster.yaml next to ctrain.yaml).",
)
@click.option("--force", is_flag=True, help="Replace an existing file that differs.")
@click.pass_context
def cluster_init(
    ctx: click.Context, assignments: tuple[str, ...], cpu_only: bool, output: Path | None, force: bool, **flags: object
) -> None:
    """Write a filled ParallelCluster config from the template in cluster/.

    Values come from the `cluster:` section of ctrain.yaml; flags and --set override them.
    """
    from ctrain.cluster import base, template
    from ctrain.settings import apply_overrides
    from ctrain.ui import info

    overrides = apply_overrides({}, assignments)
    overrides.update({key: value for key, value in flags.items() if value is not None})
    if cpu_only:
        overrides["gpu_queue"] = False
    setup = base.load(project(ctx), overrides)
    path = template.write(setup, output.resolve() if output else None, force=force)
    click.echo(path)
    info(f"next: ctrain cluster validate {path}, then ctrain cluster up (which starts the billing)")


@cluster.command("validate")
@_FILE
@_target
@click.option(
    "--aws",
    "against_aws",
    is_flag=True,
    help="Also run ParallelCluster's validators against your AWS account "
    "(pcluster create-cluster --dryrun true: uploads the node scripts, creates nothing).",
)
@_SUPPRESS
@click.pass_context
def cluster_validate(
    ctx: click.Context,
    file: Path | None,
    name: str | None,
    region: str | None,
    against_aws: bool,
    suppress: tuple[str, ...],
) -> None:
    """Check a ParallelCluster config (default: cluster.config_file) before paying for anything.

    Offline, with ParallelCluster's own config schema (keys, types, allowed values, required fields),
    those of its validators that need no AWS (names, counts, sizes, placement groups, storage) and
    ctrain's rules (instance types that exist, EFA instance types, placement group vs capacity
    reservation, node scripts present). Exits 2 and lists every problem when there are errors.
    """
    from ctrain.cluster import base, checks, pcluster

    setup = base.load(project(ctx), {"name": name, "region": region})
    path = file.resolve() if file else setup.config_file
    problems = checks.validate(setup, path, suppress)
    if against_aws:
        problems = checks.merge(problems, pcluster.dry_run(setup, path, suppress))
    for problem in problems:
        click.echo(problem)
    checked = "ParallelCluster schema and offline validators, ctrain rules"
    checked += ", ParallelCluster validators in AWS" if against_aws else ""
    click.echo(f"{setup.display(path)}: valid ({checked})")


@cluster.command("up")
@_FILE
@_target
@_SUPPRESS
@_POLL
@_TIMEOUT
@click.pass_context
def cluster_up(
    ctx: click.Context,
    file: Path | None,
    name: str | None,
    region: str | None,
    suppress: tuple[str, ...],
    poll: float,
    timeout: float,
) -> None:
    """Create the cluster and wait until it is ready; billing starts here.

    Validates the config, uploads the node scripts to cluster.scripts_s3_uri, runs pcluster
    create-cluster and follows its progress. On failure it prints the failed CloudFormation events.
    """
    from ctrain.cluster import base, pcluster
    from ctrain.ui import info

    setup = base.load(project(ctx), {"name": name, "region": region})
    state = pcluster.up(
        setup, file.resolve() if file else setup.config_file, suppress=suppress, poll=poll, timeout=timeout * 60
    )
    click.echo(f"cluster '{state.name}' is ready: head node {state.head_address}")
    info("next: ctrain cluster ssh, then sbatch sbatch/pyxis_multinode.sbatch; ctrain cluster down when done")


@cluster.command("status")
@_target
@click.pass_context
def cluster_status(ctx: click.Context, name: str | None, region: str | None) -> None:
    """State, head node address, compute fleet and compute nodes."""
    from ctrain.cluster import base, pcluster

    click.echo(pcluster.status(base.load(project(ctx), {"name": name, "region": region})))


@cluster.command("ssh", context_settings={"ignore_unknown_options": True})
@_target
@click.argument("ssh_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def cluster_ssh(ctx: click.Context, name: str | None, region: str | None, ssh_args: tuple[str, ...]) -> None:
    """Log in to the head node (pcluster ssh); extra arguments go to ssh.

    The key is cluster.ssh_key, else ~/.ssh/KEY_PAIR.pem when it exists.
    """
    from ctrain.cluster import base, pcluster

    pcluster.ssh(base.load(project(ctx), {"name": name, "region": region}), ssh_args)


@cluster.command("down")
@_target
@click.option("-y", "--yes", is_flag=True, help="Delete without asking.")
@_POLL
@_TIMEOUT
@click.pass_context
def cluster_down(
    ctx: click.Context, name: str | None, region: str | None, yes: bool, poll: float, timeout: float
) -> None:
    """Delete the cluster and wait until it is gone (asks first, unless --yes).

    Deletes the head node, the compute nodes and storage created with DeletionPolicy Delete,
    including the FSx file system and its data.
    """
    from ctrain.cluster import base, pcluster

    def confirm(question: str) -> bool:
        return yes or click.confirm(question, default=False, err=True)

    setup = base.load(project(ctx), {"name": name, "region": region})
    pcluster.down(setup, confirm=confirm, poll=poll, timeout=timeout * 60)
    click.echo(f"cluster '{setup.settings.name}' deleted")


# --- bench -----------------------------------------------------------------------------------------


def _ints(value: str | None) -> list[int] | None:
    try:
        return [int(v) for v in value.split(",")] if value else None
    except ValueError:
        raise click.BadParameter(f"expected comma-separated GPU counts such as 1,2,4, got {value!r}") from None


@main.command()
@click.option(
    "--cases",
    default="seeds,ctrain-same-batches,ctrain",
    show_default=True,
    help="Comma-separated cases: seeds, ctrain-same-batches, ctrain, ctrain-16k, ctrain-eager, "
    "ctrain-sync, ctrain-unbalanced, ctrain-bucket25, ctrain-bucket200, ctrain-bf16-reduce, ctrain-no-allreduce.",
)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--tiny", is_flag=True, help="A tiny model and data set: checks the code in about a minute on a CPU.")
@click.option("--warmup", default=8, show_default=True, help="Steps before timing starts (compilation, allocator).")
@click.option("--steps", default=30, show_default=True, help="Timed steps.")
@click.option("--gpus", help="Weak-scaling sweep of the cases over GPU counts, e.g. 1,2,4 (torchrun per count).")
@click.option(
    "--strategy",
    "strategies",
    default="ddp",
    show_default=True,
    help="Multi-GPU strategies for --gpus, comma-separated: ddp, fsdp, fsdp-no-reshard, zero2.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Directory for JSON results and profiles.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the JSON here instead of OUT/bench.json.",
)
@click.option("--profile", is_flag=True, help="Profile 3 steps of each ctrain case after timing (OUT/CASE/).")
def bench(
    cases: str,
    device: str,
    tiny: bool,
    warmup: int,
    steps: int,
    gpus: str | None,
    strategies: str,
    out: Path,
    json_path: Path | None,
    profile: bool,
) -> None:
    """Measure training throughput: TRL with the seeds' settings against ctrain's fast path.

    \b
    The fixed problem: a 374M-parameter Llama trained from scratch on 6000 synthetic chats
    (SFT, max length 2048). Prints tokens/s, MFU and peak memory, and whether the fast path's
    loss curve matches the seeds' settings on the same batches.
      ctrain bench                              one GPU: seeds vs ctrain
      ctrain bench --cases ctrain --gpus 1,2,4 --strategy ddp,fsdp
      ctrain bench --device cpu --tiny          smoke test
    """
    from ctrain.bench.suite import bench as run_bench

    table = run_bench(
        cases=[c for c in cases.split(",") if c],
        device=device,
        tiny=tiny,
        warmup=warmup,
        steps=steps,
        gpus=_ints(gpus),
        strategies=[s for s in strategies.split(",") if s],
        json_path=json_path,
        out=out,
        profile=profile,
    )
    if table:
        click.echo(table)
