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
from typing import Any

import click

from ctrain import __version__
from ctrain.bench import cli as bench_cli
from ctrain.clicore import project
from ctrain.cluster import cli as cluster_cli
from ctrain.errors import ConfigError, CtrainError
from ctrain.image import cli as image_cli
from ctrain.jobs import cli as jobs_cli
from ctrain.redact import redact
from ctrain.testbed import cli as testbed_cli
from ctrain.train import cli as train_cli

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

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        """As click's, but its own errors from the root's options (``ctrain --bogus``, a missing
        ``--config`` file) are one ``error:`` line like every other."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as exc:
            hint = " (see ctrain --help)" if isinstance(exc, click.UsageError) else ""
            _error(exc.format_message() + hint)
            sys.exit(exc.exit_code)
        except click.Abort:
            _error("aborted")
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)

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
    image definitions, yours to read and run) and a .gitignore for images, outputs and logs; a
    repository's own .gitignore gets ctrain's lines appended in a marked block instead. An
    existing file of ctrain's stops it before anything is written. The documentation stays with
    ctrain: `ctrain docs`.
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
         f"\n  next: edit {directory / 'ctrain.yaml'} (runtime, image, partition), then ctrain submit --dry-run"
         "\n  the documentation the scripts and errors cite (docs/NAME.md): ctrain docs [NAME]"))  # fmt: skip


@main.command()
@click.option(
    "--for",
    "workflows",
    multiple=True,
    metavar="WORKFLOW",
    help="Fail (exit 1) unless this workflow is ready; repeatable. "
    "One of: build, sif, sqsh, push, slurm, apptainer-jobs, pyxis-jobs, gpu, train, cluster.",
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


@main.command()
@click.argument("page", required=False)
def docs(page: str | None) -> None:
    """ctrain's documentation as installed: each page with its path, or the text of one PAGE
    (e.g. `ctrain docs sbatch` for docs/sbatch.md, which the scripts and errors cite; `ctrain docs
    offline-nodes` or `ctrain docs guides/offline-nodes` for a guide by task)."""
    import difflib

    from ctrain import resources

    # Named by their path under docs/ without .md: sbatch, guides/offline-nodes, log/2026-11-21-image.
    pages = {p.relative_to("docs").with_suffix("").as_posix(): resources.root() / p
             for p in resources.files("docs") if p.suffix == ".md"}  # fmt: skip
    group = {n: 2 if n.startswith("log/") else 1 if "/" in n else 0 for n in pages}  # pages, guides, logs
    order = sorted(pages, key=lambda n: (group[n], n))
    if page is None:
        width = {g: max(len(n) for n in pages if group[n] == g) for g in group.values()}  # aligned in each group
        for name in order:
            click.echo(f"{name:<{max(14, width[group[name]])}} {pages[name]}")
        return
    name = page.removeprefix("docs/").removesuffix(".md")
    # A guide or a log by its own name too (`ctrain docs offline-nodes`); a top-level page comes first.
    by_name = {full.rsplit("/", 1)[-1]: full for full in reversed(order)}
    found = name if name in pages else by_name.get(name)
    if found is None:
        shown = [n for n in order if not n.startswith("log/")]
        close = difflib.get_close_matches(name, shown + [n.rsplit("/", 1)[-1] for n in shown], n=1)
        raise ConfigError(f"no documentation page '{page}'" + (f" (did you mean '{close[0]}'?)" if close else "")
                          + f"; the pages: {', '.join(shown)}; and the measurement logs (log/...), "
                          "which ctrain docs lists")  # fmt: skip
    click.echo(pages[found].read_text(), nl=False)


@main.command()
@click.argument("names", nargs=-1, metavar="[NAME | RECIPE.yaml]...")
@click.option("--dataset", is_flag=True, help="The NAMEs are data sets (else: datasets/ORG/NAME).")
@click.option("--revision", help="The branch, tag or commit of every NAME (else: NAME@REVISION, else main).")
@click.option("--cluster", "cluster_name", metavar="NAME",
              help="Fetch on that cluster's login node, over SSH (~/.config/ctrain/clusters.yaml).")  # fmt: skip
@click.pass_context
def fetch(ctx: click.Context, names: tuple[str, ...], dataset: bool, revision: str | None,
          cluster_name: str | None) -> None:  # fmt: skip
    """Download models, tokenizers and data sets by hub name into the Hugging Face cache that jobs
    mount (slurm.hf_cache, else $HF_HOME): compute nodes have no internet, so a job's hub names must
    be there before it is queued, and ctrain submit refuses one that is not, with the line to run.

    
    A RECIPE.yaml fetches what it names (model.path, tokenizer.path, data.source); no NAME fetches
    ctrain.yaml's `fetch:` list. Interrupted, it continues where it stopped; each commit fetched is
    recorded in the cache (ctrain-fetched.json). A gated model uses the token already configured
    (HF_TOKEN, or `hf auth login`).
      ctrain fetch Qwen/Qwen2.5-0.5B datasets/trl-lib/Capybara
      ctrain fetch recipes/llama-3.1-8b-lora.yaml --cluster hpc
    """
    from ctrain import remote
    from ctrain.train import fetch as fetching
    from ctrain.ui import info

    config = project(ctx)
    cluster = remote.resolve(cluster_name)
    if cluster is not None:
        args = ["fetch", *names, *(["--dataset"] if dataset else []), *(["--revision", revision] if revision else [])]
        ssh = remote.connect(cluster, __version__)
        sys.exit(remote.run_in_project(ssh, config.root, args, emit=info, on_line=click.echo))
    refs = fetching.refs_named(list(names) or config.fetch, dataset=dataset, revision=revision, root=config.root)
    if not refs:
        raise ConfigError("nothing to fetch: name models (ORG/NAME), data sets (datasets/ORG/NAME) or a recipe, "
                          "or list them under fetch: in ctrain.yaml")  # fmt: skip
    home = fetching.hf_home(config.slurm.hf_cache)
    fetching.fetch_all(refs, home, info)
    info(f"{len(refs)} fetched into {home}: jobs mount it at /hf_home and run with the hub offline")


# Each area's commands live next to its code.
main.add_command(image_cli.build)
main.add_command(image_cli.wheelhouse_cmd)
main.add_command(image_cli.convert)
main.add_command(image_cli.push)
main.add_command(image_cli.cache)
main.add_command(jobs_cli.submit)
main.add_command(jobs_cli.preflight)
main.add_command(jobs_cli.status)
main.add_command(jobs_cli.jobs)
main.add_command(jobs_cli.results)
main.add_command(jobs_cli.pull)
main.add_command(jobs_cli.logs)
main.add_command(jobs_cli.cancel)
main.add_command(jobs_cli.report)
main.add_command(testbed_cli.testbed)
main.add_command(cluster_cli.cluster)
main.add_command(bench_cli.bench)
main.add_command(train_cli.train)
main.add_command(train_cli.prepare)
main.add_command(train_cli.eval_)
