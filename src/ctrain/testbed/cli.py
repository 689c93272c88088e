"""``ctrain testbed``: the commands over :mod:`ctrain.testbed` (a Slurm cluster on this machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

_state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="CTRAIN_TESTBED_DIR",
    show_envvar=True,
    help="Where the testbed keeps config, state, logs and the shared dir (default: /var/lib/ctrain/testbed).",
)


@click.group()
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
@click.option("--pyxis", "pyxis_sources", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Also run pyxis and enroot, built from the enroot-VERSION.tar.gz and pyxis-VERSION.tar.gz "
              "(their GitHub releases) or source trees in this directory; they stay until `down --purge`.")
@_state_dir_option
def testbed_up(nodes: int, pyxis_sources: Path | None, state_dir: Path | None) -> None:
    """Start munged, slurmctld and one slurmd per node (as root); wait until all nodes are idle.

    Running it again with the same --nodes is harmless; a half-started testbed is cleaned up first.
    """
    from ctrain.testbed import Testbed, usage
    from ctrain.testbed.pyxis import Sources

    tb = Testbed(state_dir)
    tb.up(nodes, with_pyxis=Sources.from_dir(pyxis_sources) if pyxis_sources else None)
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
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Image to write "
              "(default: DEFINITION's name in the shared dir).")  # fmt: skip
@click.option("--sqsh", is_flag=True, help="Write a squashfs for pyxis (srun --container-image) instead of a SIF.")
def testbed_demo_image(state_dir: Path | None, definition: Path, output: Path | None, sqsh: bool) -> None:
    """Build a small Apptainer DEFINITION into a SIF as the job user; print the image's path.

    `{{ busybox }}` in the definition is a static busybox from Debian's busybox-static package
    (downloaded, not installed): enough for images that need no base image, like
    examples/hello-node.def.
    """
    from ctrain.testbed import Testbed, build_demo_image

    click.echo(build_demo_image(Testbed(state_dir), definition, output, sqsh=sqsh))
