"""``ctrain submit``, ``preflight``, ``status``, ``logs``, ``cancel`` and ``report``: Slurm jobs, over
:mod:`ctrain.jobs.submit` and :mod:`ctrain.slurm`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ctrain import protocol, slurm
from ctrain.clicore import project
from ctrain.errors import ConfigError, CtrainError, ToolNotFound
from ctrain.jobs import chain
from ctrain.jobs.flags import slurm_flags
from ctrain.ui import info

if TYPE_CHECKING:
    from ctrain.jobs.job import Job


_CLUSTER = click.option(
    "--cluster", "cluster_name", metavar="NAME",
    help="A cluster of ~/.config/ctrain/clusters.yaml, reached over SSH (default: its `default`, else "
    "Slurm on this machine).",
)  # fmt: skip


def _client(cluster_name: str | None) -> tuple[slurm.Slurm, list[Path], str | None]:
    """The Slurm client for ``--cluster`` (over SSH) or this machine, where job logs are looked for,
    and the cluster's name (None: this machine)."""
    from ctrain import remote

    cluster = remote.resolve(cluster_name)
    if cluster is None:
        client = slurm.Slurm()
        if not client.runner.has("squeue"):  # a laptop: the cluster is what is missing, not Slurm
            raise ToolNotFound(
                f"no Slurm on this machine, and no cluster to reach: add your cluster's login node to "
                f"{remote.profiles_path()} (docs/remote.md) and pass --cluster NAME, or run this on the login node"
            )
        return client, [Path("logs")], None
    logs_dir = [Path(cluster.profile.project_dir) / "logs"] if cluster.profile.project_dir else []
    return slurm.Slurm(remote.Ssh(cluster)), logs_dir, cluster.name


def _unknown_here(job_id: str, cluster: str | None, exc: CtrainError) -> CtrainError:
    """``exc`` about a job this cluster does not know, with where it was submitted to, if from here."""
    from ctrain import remote

    hint = remote.elsewhere(job_id, cluster)
    return CtrainError(str(exc).rstrip() + hint) if hint else exc


class _CommandAfterDashes(click.Command):
    """A command whose words after the first ``--`` are a program of the user's own (ctx.meta), not arguments."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta[COMMAND] = tuple(args[cut + 1 :])
            args = args[:cut]
        return super().parse_args(ctx, args)


COMMAND = "ctrain.command"


# What preflight's flags say differently from submit's.
PREFLIGHT_HELPS = {"nodes": "Number of nodes (inside an allocation: all of its nodes).",
                   "gpus_per_node": "GPUs per node; one checking process each.", "time": "Time limit of the job.",
                   "runtime": "Container runtime (default: ctrain.yaml)."}  # fmt: skip


@click.command(cls=_CommandAfterDashes, context_settings={"ignore_unknown_options": False})
@click.argument("recipe", required=False)
@click.argument("overrides", nargs=-1)
@slurm_flags("submit")
@click.option("--dry-run", is_flag=True, help="Print the sbatch command and the exact script; queue nothing.")
@click.option("--write-script", type=click.Path(dir_okay=False, path_type=Path),
              help="Check, then write the script to this file instead of queueing it (run `sbatch FILE` "
              "from the project directory, e.g. as another user).")  # fmt: skip
@click.option("--wait", "wait_", is_flag=True, help="Follow the job's log until it ends; exit 1 unless it completed.")
@click.option("--fetch", "fetch", multiple=True, metavar="NAME",
              help="A hub repository the job needs (ORG/NAME, datasets/ORG/NAME), checked to be in the cache it "
              "mounts, as a recipe's are; repeatable (ctrain.yaml: fetch:).")  # fmt: skip
@click.option("--sweep", "sweep", multiple=True, metavar="KEY=V1,V2",
              help="A sweep: one job array with a task per combination of the values (repeatable: a grid); each "
              "task its own overrides and output directory (a command: CTRAIN_SWEEP_KEY and {key}).")  # fmt: skip
@click.option("--sweep-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="A sweep of hand-picked sets: a line per task, KEY=VALUE words separated by spaces.")
@click.option("--max-parallel", type=click.IntRange(1, 1000), metavar="N",
              help="At most N of the sweep's tasks run at once (Slurm's --array=...%N).")
@_CLUSTER
@click.pass_context
def submit(ctx: click.Context, recipe: str | None, overrides: tuple[str, ...], dry_run: bool,
           write_script: Path | None, wait_: bool, fetch: tuple[str, ...], sweep: tuple[str, ...],
           sweep_file: Path | None, max_parallel: int | None, cluster_name: str | None,
           **flags: Any) -> None:  # fmt: skip
    """Train RECIPE on the cluster: render an sbatch/ script with ctrain.yaml's `slurm:` settings,
    check it, and queue it. Or, after `--`, run a training program of your own the same way.

    \b
    Checked before anything is queued: the image exists and suits the runtime, the recipe (with
    KEY=VALUE OVERRIDES) validates, the partition has the GPUs asked for, every hub name the job
    needs is in the cache it mounts (its nodes have no internet: `ctrain fetch`).
      ctrain submit --nodes 2 recipes/demo-addition.yaml training.max_steps=200
      ctrain submit --dry-run --nodes 16 --gpus-per-node 8 RECIPE     show exactly what would run
      ctrain submit --nodes 2 --gpus-per-node 8 -- run_clm.py --deepspeed configs/zero3.json ...
      ctrain submit RECIPE --sweep training.learning_rate=1e-4,3e-4 --max-parallel 2
    A command runs under the launcher on every node, in the project directory (SCRIPT.py, -m MODULE,
    or any program), with the image, rendezvous, requeue and node-loss handling of a recipe.

    With --cluster (or a default cluster): the project's files go to the cluster's PROJECT_DIR
    (rsync; never outputs, logs, images or secrets), and the cluster's own ctrain, of this version,
    runs these checks and queues the job there.
    """
    from ctrain import remote
    from ctrain.jobs import submit as jobs

    command = ctx.meta.get(COMMAND)
    jobs.check_project_found(project(ctx), recipe if command is None else None)
    # Typed relative to where you are (as for `ctrain train`); the job sees the project directory.
    if command is None:
        recipe = ctx.params["recipe"] = jobs.from_here(recipe, project(ctx).root)
    cluster = remote.resolve(cluster_name)
    if cluster is not None:
        if write_script:
            raise click.UsageError("--write-script writes a file here; with --cluster, use --dry-run to see the script")
        sys.exit(_submit_there(ctx, cluster))

    sets = _sweep_sets(sweep, sweep_file)
    job = jobs.prepare(project(ctx), recipe=recipe, overrides=overrides, command=command, client=slurm.Slurm(),
                       fetch=fetch, sweep=sets, max_parallel=max_parallel,
                       **flags)  # the slurm: settings' flags (ctrain.jobs.flags)
    if _checked(job, dry_run):
        return
    if write_script:
        jobs.write_script(job, write_script)
        info(f"wrote {write_script}; queue it from {job.project} with: sbatch {write_script}")
        return
    job_id, log = jobs.submit(job)
    click.echo(job_id)
    if job.sweep:
        info(f"submitted sweep {job_id}: {len(job.sweep)} task(s), one job array (script: {log.with_suffix('.sbatch')})"
             f"\n  each task's log: {job.log_dir}/NAME-TASKJOBID.out; compare them: ctrain results {job_id}")  # fmt: skip
        return
    info(f"submitted job {job_id}: log {log} (script: {log.with_suffix('.sbatch')})\n  follow: ctrain logs -f {job_id}")
    if wait_:
        _ended(*chain.follow(slurm.Slurm(), job_id, emit=click.echo, note=info, search=[job.log_dir]))


@click.command()
@slurm_flags("preflight", helps=PREFLIGHT_HELPS, defaults={"time": "00:10:00"})
@click.option("--quick", is_flag=True, help="The short checks every job runs first, instead of the longer ones.")
@click.option("--dry-run", is_flag=True, help="Print the script it would run or queue, and run or queue nothing.")
@click.pass_context
def preflight(ctx: click.Context, quick: bool, dry_run: bool, **flags: Any) -> None:
    """Check nodes and their network before a long run, without training: each node's scratch and
    image-cache space, the shared project directory and its GPUs (nvidia-smi), then in the image the
    driver against its CUDA, every GPU's memory and matmul rate against its peers', and an
    all-reduce across all ranks with its bandwidth and the transport NCCL chose.

    \b
    Inside an allocation (salloc), on its nodes; otherwise as a short job (`ctrain submit`'s
    settings), followed until it ends. Exit 1 when a node is unfit; nothing is requeued.
      salloc -N 4 --gpus-per-node 8 ctrain preflight
      ctrain preflight --nodes 4 --gpus-per-node 8 --partition gpu
    Every job runs the quick checks first by itself (slurm.preflight in ctrain.yaml).
    """
    from ctrain import proc
    from ctrain.jobs import submit as jobs

    allocation = os.environ.get("SLURM_JOB_ID")
    if allocation and not slurm.is_job_id(allocation, array=False, step=False):
        raise ConfigError(f"SLURM_JOB_ID is {allocation!r}, not a job id: run ctrain preflight inside salloc, "
                          "or outside any")
    job = jobs.preflight_job(project(ctx), quick=quick, client=None if allocation else slurm.Slurm(), **flags)
    if _checked(job, dry_run):
        return
    if allocation:
        script = job.log_dir / f"preflight-{allocation}.sbatch"
        jobs.write_script(job, script)
        info(f"checking the nodes of allocation {allocation} (script: {script})")
        code = proc.stream(["bash", str(script)], check=False, cwd=job.project, on_line=click.echo,
                           env={"SLURM_SUBMIT_DIR": str(job.project)})  # fmt: skip
        if code != 0:
            sys.exit(1)
        return
    job_id, log = jobs.submit(job)
    info(f"submitted preflight job {job_id}: log {log}")
    _ended(job_id, slurm.Slurm().follow(job_id, emit=click.echo, search=[job.log_dir]))


def _sweep_sets(sweep: tuple[str, ...], sweep_file: Path | None) -> list[dict[str, str]] | None:
    """The sets of values of a sweep (--sweep's grid, or --sweep-file's lines); None for one job."""
    from ctrain.jobs import sweep as sweeps

    if sweep and sweep_file:
        raise ConfigError("give --sweep (a grid) or --sweep-file (a set a line), not both")
    if sweep:
        return sweeps.grid(sweep)
    return sweeps.from_file(sweep_file) if sweep_file else None


def _checked(job: Job, dry_run: bool) -> bool:
    """Check the job (ctrain.jobs.checks), print it for a dry run, then its notes and warnings; True
    for a dry run, which goes no further."""
    from ctrain.jobs import submit as jobs

    warnings = jobs.check(job, dry_run=dry_run)
    if dry_run:
        click.echo(job.describe(), nl=False)
    for note in job.notes:
        info(note if note.startswith("warning: ") else f"note: {note}")
    for warning in warnings:
        info(f"warning: {warning}")
    return dry_run


def _ended(job_id: str, final: slurm.Job | None) -> None:
    """Say how a followed job ended; exit 1 unless it COMPLETED (so scripts can chain on it)."""
    state = final.state if final else "UNKNOWN"
    info(f"job {job_id}: {state}")
    if state != "COMPLETED":
        sys.exit(1)


@click.command()
@click.argument("job_ids", nargs=-1)
@_CLUSTER
def status(job_ids: tuple[str, ...], cluster_name: str | None) -> None:
    """Show jobs: the given JOB_IDS (queued, running or finished), else your queued and running jobs.

    For each JOB_ID, also what its batch script last logged about a failure (a lost node, a failed
    rank, a hang) and whether it requeued the job; and the jobs that continued its run after it."""
    from ctrain import remote

    client, search, cluster = _client(cluster_name)
    asked = [slurm.check_job_id(job_id) for job_id in job_ids]
    jobs = client.status(list(dict.fromkeys(j for job_id in asked for j in chain.jobs_from(client, job_id, search))))
    click.echo(slurm.status_table(jobs))
    for job in jobs if job_ids else []:  # the jobs asked about by id: what their batch script decided
        for event in client.job_events(job, search=search):
            click.echo(f"job {job.id}: {event}")
        if job.state == "UNKNOWN" and (hint := remote.elsewhere(job.id, cluster)):
            click.echo(f"job {job.id}: {'this cluster' if cluster else 'Slurm here'} does not know it" + hint)


@click.command()
@click.option("--limit", "-n", type=click.IntRange(1, 10_000), default=30, show_default=True,
              help="Show the newest this many jobs.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as JSON instead of a table.")
@_CLUSTER
@click.pass_context
def jobs(ctx: click.Context, limit: int, as_json: bool, cluster_name: str | None) -> None:
    """The project's jobs, past ones too, newest first: what each ran, its state, when, its wall time,
    restarts and last training loss. From the project's own records (every `ctrain submit`), with what
    Slurm still knows; a run continued after a lost node shows its jobs as one row."""
    import json

    from ctrain import remote
    from ctrain.jobs import history
    from ctrain.ui import table

    client, search, cluster = _client(cluster_name)
    if cluster is None:
        root, runner = project(ctx).root, None
    else:
        profile = remote.resolve(cluster_name)
        if profile is None or not profile.profile.project_dir:
            raise ConfigError(f"cluster {cluster} has no project_dir in its profile ({remote.profiles_path()}): "
                              "add it, so that ctrain jobs knows where the project's records are")  # fmt: skip
        root, runner = Path(profile.profile.project_dir), client.runner
    entries, skipped = history.read(root, runner)
    rows = history.rows(client, root, entries[-limit:], search, here=cluster is None)
    if as_json:
        click.echo(json.dumps(history.as_json(rows), indent=2))
        return
    if not rows:
        info(f"no jobs submitted with ctrain submit from {root} yet ({root / protocol.STATE_DIR / protocol.HISTORY_FILE})")
        return
    click.echo(table(history.HEADERS, rows))
    if (said := history.note(client, [row[3] for row in rows])) is not None:
        info(said)
    if skipped:
        info(f"warning: {skipped} line(s) of {protocol.HISTORY_FILE} are not ctrain's records; skipped")


@click.command()
@click.argument("job_ids", nargs=-1, required=True)
@click.option("--sort", "metric", metavar="METRIC", help="Rank by this metric (default: eval_loss where the runs "
              "have one, else the training loss); losses best at their least, accuracies and scores at their most.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of a table.")
@click.option("--plot", type=click.Path(path_type=Path), metavar="FILE",
              help="Also draw every run's training and evaluation loss against steps: FILE.png, .svg, or .html (a "
              "self-contained page with the table); needs matplotlib (pip install 'ctrain-slurm[plot]').")  # fmt: skip
@click.pass_context
def results(ctx: click.Context, job_ids: tuple[str, ...], metric: str | None, as_json: bool,
            plot: Path | None) -> None:  # fmt: skip
    """Compare runs: one row per JOB_ID (any job of a run), from its output directory's metrics (the last
    training loss, the last evaluation, eval.json, tokens/s) and its timeline (goodput, hours, cost with
    report.gpu_hour_price), best first by one metric, the best marked *."""
    import json

    from ctrain.jobs import history
    from ctrain.jobs import results as compare
    from ctrain.ui import table

    if plot is not None:
        from ctrain.jobs import plots

        plots.check_target(plot)
    config = project(ctx)
    entries = {e.job: e for e in history.read(config.root)[0]}
    rows = []
    state = config.root / protocol.STATE_DIR
    for asked in dict.fromkeys(slurm.check_job_id(j, step=False) for j in job_ids):
        array, _, index = asked.partition("_")
        entry = entries.get(array if array in entries and entries[array].tasks else chain.run_of(state, asked))
        if entry is None:
            raise ConfigError(f"job {asked}: not in this project's history ({protocol.STATE_DIR}/{protocol.HISTORY_FILE}): "
                              "ctrain results compares jobs queued with ctrain submit from this project; see ctrain jobs")  # fmt: skip
        # A sweep's row per task (JOB_TASK: that task), each from its own output directory and run.
        runs = [(asked, entry.what, entry.output)] if not entry.tasks else [
            (f"{entry.job}_{t.index}", t.what(), t.output) for t in entry.tasks if not index or str(t.index) == index]
        for job, what, output in runs:
            run = chain.run_of(state, job)
            rows.append({"job": job, "run": run, "ran": what, "output": str(output or ""),
                         "metrics": compare.read_metrics(output) if output else {},
                         "account": compare.read_account(config.root, run, config.report.gpu_hour_price)})  # fmt: skip
    rows, sorted_by = compare.rank(rows, metric)
    if plot is not None:
        drawn = plots.loss_curves(rows, plot, f"ctrain results {' '.join(job_ids)}")
        info(f"plot: {drawn} curve(s) of {len(rows)} run(s) in {plot}")
    if as_json:
        click.echo(json.dumps({"sorted_by": sorted_by, "runs": rows}, indent=2))
        return
    header, cells = compare.table(rows)
    click.echo(table(header, cells))
    if sorted_by:
        info(f"sorted by {sorted_by} ({'most' if compare.higher_is_better(sorted_by) else 'least'} first); * the best")
    for row in rows:
        if not row["metrics"]:
            info(f"job {row['job']}: no metrics in {row['output'] or 'its output directory (none recorded: a command of your own)'} yet")


@click.command()
@click.argument("job_id")
@click.option("--models", is_flag=True, help="Also the final model or adapters (OUTPUT_DIR/final); never checkpoints.")
@_CLUSTER
@click.pass_context
def pull(ctx: click.Context, job_id: str, models: bool, cluster_name: str | None) -> None:
    """Bring a job's results home from the cluster: its metrics, evaluation, TensorBoard logs, logs,
    timeline and report (a sweep's: every task's) into this project, where ctrain results, ctrain report
    and TensorBoard read them. Only the job's own files are read there; a second pull brings only what
    changed, and one cut off goes on where it stopped.

    \b
      ctrain pull 4242 --cluster hpc && ctrain results 4242
    """
    from ctrain import __version__, remote
    from ctrain.jobs import pull as pulling

    job = slurm.check_job_id(job_id, step=False)
    if "_" in job:
        raise ConfigError(f"job {job}: give the sweep's id ({job.split('_')[0]}), which brings every task")
    cluster = remote.resolve(cluster_name)
    if cluster is None:
        raise ConfigError("ctrain pull copies from a cluster: give --cluster NAME (~/.config/ctrain/clusters.yaml), "
                          "or set a default there; on the login node the files are already here")  # fmt: skip
    root = project(ctx).root
    done = pulling.pull(remote.connect(cluster, __version__), job, root, models=models, emit=info)
    info(f"pulled job {job} from {cluster.name}: {done.files} file(s) new or changed, {done.outputs} output "
         f"director{'y' if done.outputs == 1 else 'ies'}, into {root}\n  compare: ctrain results {job}")  # fmt: skip


@click.command()
@click.argument("job_id")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the log grows, until the job ends; then say "
              "how it ended (exit 1 unless it COMPLETED).")  # fmt: skip
@_CLUSTER
def logs(job_id: str, follow: bool, cluster_name: str | None) -> None:
    """Print a job's log (Slurm's StdOut, else logs/*-JOB_ID.out); with --follow, on into the jobs that
    continue its run."""
    client, search, cluster = _client(cluster_name)
    try:
        if follow:
            last, final = chain.follow(client, job_id, emit=click.echo, note=info, search=search)
        else:
            text = client.read_log(job_id, search=search)
            click.echo(text, nl=False)
            if after := protocol.continued_as(text):
                info(f"job {job_id}: the run goes on as job {after}: ctrain logs {after}")
            return
    except CtrainError as exc:
        raise _unknown_here(job_id, cluster, exc) from None
    _ended(last, final)


@click.command()
@click.argument("job_id")
@click.option("--signal", "-s", "signal_name", help="Send this signal to the job's batch script instead, as the "
              "time-limit warning does (USR1: checkpoint and requeue).")  # fmt: skip
@_CLUSTER
def cancel(job_id: str, signal_name: str | None, cluster_name: str | None) -> None:
    """Cancel a job (scancel), or send its batch script a signal; a job whose run went on as another job
    (a lost node's continuation), that one."""
    client, search, cluster = _client(cluster_name)
    job_id = slurm.check_job_id(job_id)
    jobs = chain.jobs_from(client, job_id, search)
    try:
        client.cancel(job_id, signal=signal_name)
    except CtrainError as exc:
        raise _unknown_here(job_id, cluster, exc) from None
    click.echo(
        f"job {job_id}: " + (f"sent SIG{signal_name.upper().removeprefix('SIG')}" if signal_name else "cancelled")
    )
    for later in jobs[1:]:
        found = client.job(later)
        if found is None or found.final:
            continue
        client.cancel(later, signal=signal_name)
        click.echo(f"job {later} (the run of job {job_id}, continued): " + ("signalled" if signal_name else "cancelled"))


@click.command()
@click.argument("job_id")
@click.option("--timeline", type=click.Path(dir_okay=False, path_type=Path),
              help="The run's timeline (default: .ctrain/RUN.timeline in the project, RUN being the "
              "run's first job).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the account as JSON instead of lines.")
@click.option("--plot", type=click.Path(path_type=Path), metavar="FILE",
              help="Also draw the runs one after another, each segment in its colour: FILE.png, .svg or .html; "
              "needs matplotlib (pip install 'ctrain-slurm[plot]').")  # fmt: skip
@click.pass_context
def report(ctx: click.Context, job_id: str, timeline: Path | None, as_json: bool, plot: Path | None) -> None:
    """Where a run's time went, across its requeues and continuations (JOB_ID: any of its jobs): queue wait, start-up, preparation, training,
    checkpoint saves, evaluation, work lost (and why) and each run's end; goodput, GPU-hours and,
    with report.gpu_hour_price in ctrain.yaml, the cost. Also written as JSON beside the timeline."""
    import json

    from ctrain.files import atomic_write_json
    from ctrain.train import goodput

    job_id = slurm.check_job_id(job_id, step=False)
    config = project(ctx)
    run = chain.run_of(config.root / protocol.STATE_DIR, job_id)
    path = timeline or config.root / protocol.STATE_DIR / protocol.timeline_file(run)
    if plot is not None:
        from ctrain.jobs import plots

        plots.check_target(plot)
    result, lines = goodput.report(path, run, gpu_hour_price=config.report.gpu_hour_price)
    if plot is not None:
        plots.timeline(result, plot, f"ctrain report {job_id}: run {run}, goodput {100 * result['goodput']:.1f}%"
                       if result.get("goodput") is not None else f"ctrain report {job_id}: run {run}")  # fmt: skip
        info(f"plot: {len(result['runs'])} run(s) in {plot}")
    out = path.with_name(protocol.report_file(run))
    try:
        atomic_write_json(out, result)
    except (OSError, CtrainError):
        out = None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for line in lines:
        click.echo(line)
    if out is not None:
        click.echo(f"goodput: written to {out}")


def _command_line(ctx: click.Context, leave_out: tuple[str, ...]) -> list[str]:
    """This command's options and arguments as given, to run the same command elsewhere."""
    options: list[str] = []
    arguments: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if isinstance(param, click.Option) and param.is_flag and param.secondary_opts and value is not None:
            if param.name not in leave_out:  # --exclusive/--no-exclusive: either was said
                options.append(max(param.opts if value else param.secondary_opts, key=len))
            continue
        if param.name in leave_out or value is None or value is False or value == ():
            continue
        if isinstance(param, click.Argument):
            arguments += [str(v) for v in value] if isinstance(value, tuple) else [str(value)]
        elif isinstance(param, click.Option) and param.is_flag:
            options.append(max(param.opts, key=len))
        elif isinstance(value, tuple):  # a repeatable option: once per value
            for item in value:
                options += [max(param.opts, key=len), str(item)]
        else:
            options += [max(param.opts, key=len), str(value)]
    return [*options, *arguments]


def _submit_there(ctx: click.Context, cluster: object) -> int:
    """``ctrain submit`` on the cluster's login node, after sending the project's files; its exit code."""
    from ctrain import __version__, remote

    assert isinstance(cluster, remote.Cluster)
    ssh = remote.connect(cluster, __version__)
    root = project(ctx).root
    extra: list[str] = []  # a refused path stops the trip before any file is sent
    if ctx.params.get("recipe"):
        recipe = Path(ctx.params["recipe"])
        recipe = recipe if recipe.is_absolute() else root / recipe
        if recipe.is_file():
            unsent = remote.unsent_paths(recipe, ctx.params.get("overrides", ()), root)
            extra = remote.send_unsent_paths(ssh, unsent, root, emit=info)
    args = ["submit", *_command_line(ctx, ("cluster_name",)), *extra]
    if COMMAND in ctx.meta:
        args += ["--", *ctx.meta[COMMAND]]
    submitted: list[str] = []

    def line(text: str) -> None:
        if not submitted and slurm.is_job_id(text, array=False, step=False):
            submitted.append(text)
            remote.record_job(cluster.name, text)
        click.echo(text)

    return remote.run_in_project(ssh, root, args, emit=info, on_line=line)
