"""``ctrain cluster``: the commands over :mod:`ctrain.cluster` (an AWS ParallelCluster)."""

from __future__ import annotations

from pathlib import Path

import click

from ctrain.clicore import project
from ctrain.config import ProjectConfig

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
    "--timeout", type=click.FloatRange(min=1), default=3600.0, show_default=True,
    help="Seconds to wait at most (like --poll, in seconds).",
)


@click.group()
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
    "--max-nodes",
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
    from ctrain.cluster import setup as cluster_setup
    from ctrain.cluster import template
    from ctrain.settings import apply_overrides
    from ctrain.ui import info

    overrides = apply_overrides({}, assignments)
    overrides.update({key: value for key, value in flags.items() if value is not None})
    if cpu_only:
        overrides["gpu_queue"] = False
    setup = cluster_setup.load(project(ctx), overrides)
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
    from ctrain.cluster import checks, pcluster
    from ctrain.cluster import setup as cluster_setup

    setup = cluster_setup.load(project(ctx), {"name": name, "region": region})
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
    from ctrain.cluster import pcluster
    from ctrain.cluster import setup as cluster_setup
    from ctrain.ui import info

    setup = cluster_setup.load(project(ctx), {"name": name, "region": region})
    state = pcluster.up(
        setup, file.resolve() if file else setup.config_file, suppress=suppress, poll=poll, timeout=timeout
    )
    click.echo(f"cluster '{state.name}' is ready: head node {state.head_address}")
    written = pcluster.save_profile(setup, state)
    if written:
        info(f"cluster profile '{state.name}' in {written}: ctrain push --cluster {state.name}, "
             f"ctrain submit --cluster {state.name} ... work from here")  # fmt: skip
    info("next: ctrain cluster ssh, then sbatch sbatch/pyxis_multinode.sbatch; ctrain cluster down when done")


@cluster.command("status")
@_target
@click.pass_context
def cluster_status(ctx: click.Context, name: str | None, region: str | None) -> None:
    """State, head node address, compute fleet and compute nodes."""
    from ctrain.cluster import pcluster
    from ctrain.cluster import setup as cluster_setup

    click.echo(pcluster.status(cluster_setup.load(project(ctx), {"name": name, "region": region})))


@cluster.command("ssh", context_settings={"ignore_unknown_options": True})
@_target
@click.argument("ssh_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def cluster_ssh(ctx: click.Context, name: str | None, region: str | None, ssh_args: tuple[str, ...]) -> None:
    """Log in to the head node (pcluster ssh); extra arguments go to ssh.

    The key is cluster.ssh_key, else ~/.ssh/KEY_PAIR.pem when it exists.
    """
    from ctrain.cluster import pcluster
    from ctrain.cluster import setup as cluster_setup

    pcluster.ssh(cluster_setup.load(project(ctx), {"name": name, "region": region}), ssh_args)


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
    from ctrain.cluster import pcluster
    from ctrain.cluster import setup as cluster_setup

    def confirm(question: str) -> bool:
        return yes or click.confirm(question, default=False, err=True)

    setup = cluster_setup.load(project(ctx), {"name": name, "region": region})
    pcluster.down(setup, confirm=confirm, poll=poll, timeout=timeout)
    click.echo(f"cluster '{setup.settings.name}' deleted")
