"""``ctrain build``, ``wheelhouse``, ``convert`` and ``push``: parse the flags, call
:mod:`ctrain.image.service`, print what it returns."""

from __future__ import annotations

from pathlib import Path

import click

from ctrain.clicore import project


@click.command()
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
@click.option("--platform", metavar="OS/ARCH", help="The cluster's platform, e.g. linux/amd64 from an Apple-silicon "
              "laptop (default: image.platform, else this machine's).")  # fmt: skip
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
    platform: str | None,
) -> None:
    """Build the training image (containers/Dockerfile, or the standalone Apptainer definition).

    Streams the builder's output with the step and elapsed time on stderr; prints the image
    reference, ID and digest on stdout as `key: value` lines.
    """
    from ctrain.image.service import run_build

    image = run_build(
        project(ctx),
        builder=builder,
        flavour=flavour,
        base=base,
        local_base=local_base,
        wheelhouse_dir=wheelhouse,
        tag=tag,
        no_cache=no_cache,
        platform=platform,
    )
    click.echo(f"image: {image.ref}\nid: {image.id}\ndigest: {image.digest or '-'}")


@click.command("wheelhouse")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.pass_context
def wheelhouse_cmd(ctx: click.Context, directory: Path) -> None:
    """Download every wheel the image installs into DIRECTORY (on a machine with network), for
    `ctrain build --wheelhouse DIRECTORY` on one without."""
    from ctrain.image.service import run_wheelhouse

    wheels = run_wheelhouse(project(ctx), directory)
    click.echo(f"wheelhouse: {directory} ({len(wheels)} wheels)")


@click.command()
@click.option("--to", "to", type=click.Choice(["sif", "sqsh"]),
              help="Default: convert.to, else the format of slurm.runtime (apptainer: sif, pyxis: sqsh).")  # fmt: skip
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
    atomically (an interrupted conversion leaves no file behind). Prints `path: FILE`, and what the
    image says it is (`image: ctrain ..., torch ..., CUDA ... (NVIDIA driver ... or newer on the nodes)`).
    """
    from ctrain.image.checks import image_facts
    from ctrain.image.facts import describe
    from ctrain.image.service import run_convert

    result = run_convert(project(ctx), to=to, compression=compression, output=output, ref=ref, force=force)
    click.echo(f"path: {result.path}\nid: {result.image_id}\ncached: {str(result.cached).lower()}")
    facts = image_facts(str(result.path), "pyxis" if result.path.suffix == ".sqsh" else "apptainer", result.path.parent)
    if facts:
        click.echo(f"image: {describe(facts)}")


@click.command()
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
    help="Which conversions go to --remote (repeatable; default: convert.to, else slurm.runtime's format); "
    "made if missing.",
)
@click.option(
    "--file",
    "files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Send this .sif/.sqsh instead (repeatable).",
)
@click.option("--image", "ref", metavar="REF", help="Image to push (default: image.name:image.tag).")
@click.option("--cluster", "cluster_name", metavar="NAME",
              help="Copy SIF/sqsh files to this cluster's images_dir (~/.config/ctrain/clusters.yaml), "
              "over its shared SSH connection.")  # fmt: skip
@click.pass_context
def push(
    ctx: click.Context,
    registry: str | None,
    oras: str | None,
    remote: str | None,
    formats: tuple[str, ...],
    files: tuple[Path, ...],
    ref: str | None,
    cluster_name: str | None,
) -> None:
    """Push the image to a registry, the SIF to ORAS, and/or files to a cluster's filesystem.

    Without flags, pushes to every destination set under `push:` in ctrain.yaml. Files are checked
    by sha256 on both sides and renamed into place. Credentials come from the standard stores
    (docker/podman login, apptainer registry login, ssh keys), never from ctrain.
    """
    from ctrain.image.service import run_push

    ssh_options = None
    if cluster_name:
        from ctrain import remote as remote_mod

        if remote:
            raise click.UsageError("--cluster and --remote both say where files go: give one")
        cluster = remote_mod.resolve(cluster_name)
        assert cluster is not None
        ssh = remote_mod.Ssh(cluster)
        ssh.run(["mkdir", "-p", "--", cluster.images_dir])
        remote, ssh_options = f"{cluster.profile.host}:{cluster.images_dir}/", ssh.ssh_args()[1:]
    for pushed in run_push(project(ctx), registry=registry, oras=oras, remote=remote, formats=formats, ref=ref,
                           files=files, ssh_options=ssh_options):  # fmt: skip
        click.echo(f"pushed: {pushed.what} {pushed.where}")


@click.group()
def cache() -> None:
    """The images the Apptainer jobs unpacked on this node (CTRAIN_IMAGE_CACHE, docs/sbatch.md).

    Run it where the jobs ran (on a cluster: srun --nodes=N --ntasks-per-node=1 ctrain cache list).
    """


_DIR = click.option("--dir", "directory", type=click.Path(path_type=Path),
                    help="The cache directory (default: as the sbatch scripts choose it for this user).")  # fmt: skip


@cache.command("list")
@_DIR
def cache_list(directory: Path | None) -> None:
    """One line per unpacked image, least recently used first."""
    from ctrain.image import cache as image_cache

    where = image_cache.check_dir(directory or image_cache.default_dir())
    found = image_cache.entries(where)
    for entry in found:
        click.echo(image_cache.describe(entry))
    other = len(image_cache.others(where))
    click.echo(f"{len(found)} image(s) in {where}" + (f"; {other} other thing(s) there are no cache entries" if other
               else ""), err=True)  # fmt: skip


@cache.command("clear")
@_DIR
def cache_clear(directory: Path | None) -> None:
    """Remove every unpacked image that no running job uses; the next job unpacks it again.

    Only the cache's entries are removed: anything else in the directory is left and named, and a
    directory that is no image cache at all is refused. A --dir or CTRAIN_IMAGE_CACHE that does not
    exist is refused too (a mistyped path would clear nothing, silently); the default one, where no
    job has unpacked an image yet, has nothing to clear."""
    import os

    from ctrain.errors import ConfigError
    from ctrain.image import cache as image_cache

    where = image_cache.check_dir(directory or image_cache.default_dir())
    if not where.exists():
        if directory is None and not os.environ.get("CTRAIN_IMAGE_CACHE"):
            click.echo(f"nothing to clear: {where} does not exist (no job has unpacked an image on this node yet)",
                       err=True)  # fmt: skip
            return
        given = "--dir" if directory is not None else "CTRAIN_IMAGE_CACHE"
        raise ConfigError(f"the image cache {where} ({given}) does not exist: nothing to clear; give the directory "
                          "the jobs unpack into (their CTRAIN_IMAGE_CACHE)")  # fmt: skip
    cleared = image_cache.clear(where)
    for entry in cleared.removed:
        click.echo(f"removed {entry.key} ({entry.image or '-'})")
    for entry in cleared.kept:
        click.echo(f"kept {entry.key}: in use by a running job ({entry.image or '-'})")
    for path in cleared.left:
        click.echo(f"left {path.name!r}: not an image cache entry (not ctrain's to remove)")
    click.echo(f"{len(cleared.removed)} removed, {len(cleared.kept)} in use, {len(cleared.left)} left alone, "
               f"in {where}", err=True)  # fmt: skip
