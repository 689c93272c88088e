"""What ``ctrain build / wheelhouse / convert / push`` do, from the project config plus flags; the
click commands in image/cli.py only parse options and print what these return."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ctrain import ui
from ctrain.config import ProjectConfig, PushConfig
from ctrain.errors import ConfigError, CtrainError
from ctrain.image import localbase
from ctrain.image import build as builder_mod
from ctrain.image import convert as convert_mod
from ctrain.image import push as push_mod
from ctrain.image import reference, store, wheelhouse
from ctrain.settings import override

# The cpu flavour's base when none is given: Python 3.11 (the pinned CPU torch wheel's) with venv.
CPU_BASE = "docker.io/library/python:3.11-slim-bookworm"


def _context(config: ProjectConfig) -> Path:
    return Path(os.path.normpath(config.resolve(config.image.context)))


def image_ref(config: ProjectConfig, tag: str | None = None) -> str:
    """``NAME:TAG`` from the config; ``tag`` overrides the tag, or both when it is ``NAME:TAG``
    (a ``NAME`` with a ``/`` and no tag keeps the config's tag). Checked, so a bad one fails here
    rather than after the builder has started."""
    if not tag:
        return config.image.ref
    if ":" in tag.rsplit("/", 1)[-1]:
        ref = tag
    elif "/" in tag:
        ref = f"{tag}:{config.image.tag}"
    else:
        ref = f"{config.image.name}:{tag}"
    reference.parse(ref, f"--tag {tag!r} makes the image name", example="ctrain:cpu or ghcr.io/team/ctrain:1.0",
                    digest=False)  # fmt: skip
    return ref


# Where builders take a base image from besides a registry (containers-image transports).
_TRANSPORTS = ("containers-storage:", "oci:", "oci-archive:", "docker-archive:", "docker-daemon:", "dir:")


def check_base(base: str, builder: str) -> None:
    """A base image reference, checked before the builder spends seconds of retries on it."""
    if builder in ("apptainer", "auto") and reference.scheme(base) not in (None, "docker"):
        return  # Apptainer's other bootstrap agents (oci://DIR, library://...) name their own things
    if builder != "apptainer" and base.startswith(_TRANSPORTS):
        return
    reference.parse(base.removeprefix("docker://"), "--base", example="python:3.11-slim-bookworm or "
                    "nvcr.io/nvidia/pytorch:24.10-py3")  # fmt: skip


def run_build(
    config: ProjectConfig,
    *,
    builder: str | None = None,
    flavour: str | None = None,
    base: str | None = None,
    local_base: bool = False,
    wheelhouse_dir: Path | None = None,
    tag: str | None = None,
    no_cache: bool = False,
    platform: str | None = None,
) -> store.Image:
    """Build the image of ``config.image`` with the flags on top (``tag``, ``local_base``, ``no_cache``
    are not settings); a flag's value is checked as the setting in ctrain.yaml is."""
    ref = image_ref(config, tag)
    cfg = override(
        config.image,
        {
            "builder": builder,
            "flavour": flavour or ("cpu" if local_base else None),
            "base": base or None,
            # the flag is relative to the working directory, image.wheelhouse to ctrain.yaml
            "wheelhouse": wheelhouse_dir.absolute() if wheelhouse_dir else None,
            "platform": platform,
        },
        where="image",
    )
    flavour, base = cfg.flavour, cfg.base
    if local_base and base:
        raise ConfigError("--local-base makes the base image itself; drop --base (or image.base in ctrain.yaml)")
    if local_base and flavour != "cpu":
        raise ConfigError("--local-base is a plain Debian: it serves the cpu flavour only (--flavour cpu)")
    if base:
        check_base(base, cfg.builder)
        builder_mod.check_value("image.base (--base)", base)  # Apptainer writes it into the definition
    if cfg.torch_index:
        builder_mod.check_torch_index(cfg.torch_index)
    builder = builder_mod.choose(cfg.builder)
    if cfg.platform and builder == "apptainer":
        raise ConfigError(f"image.platform {cfg.platform}: Apptainer builds only for this machine's platform; build "
                          "with docker, podman or buildah (--builder), or on a machine of the cluster's platform")  # fmt: skip
    if local_base:
        if builder == "apptainer":
            raise ConfigError("--local-base needs docker, podman or buildah (Apptainer cannot read their image store)")
        base = localbase.debootstrap_base(builder=builder).ref
    if flavour == "cpu" and not base:
        base = CPU_BASE
    wheels = config.resolve(cfg.wheelhouse) if cfg.wheelhouse else None
    request = builder_mod.BuildRequest(
        context=_context(config),
        ref=ref,
        flavour=flavour,
        base=base,
        wheelhouse=wheels.absolute() if wheels else None,
        builder=builder,
        sif_dir=config.resolve(config.convert.output_dir),
        no_cache=no_cache,
        torch_index=cfg.torch_index,
        platform=cfg.platform,
    )
    return builder_mod.build(request)


def find_image(config: ProjectConfig, ref: str | None = None) -> store.Image:
    """The built image: in the builder's store, or the SIF the apptainer builder wrote."""
    ref = ref or config.image.ref
    reference.parse(ref, "--image", example="ctrain:latest or localhost/ctrain:cpu")
    if config.image.builder != "apptainer":
        try:
            return store.locate(ref, config.image.builder)
        except CtrainError:
            if config.image.builder != "auto":
                raise
    sif = builder_mod.sif_path(config.resolve(config.convert.output_dir), ref)
    if sif.is_file():
        return store.Image(str(sif), "sha256:" + builder_mod.sha256_file(sif), "sif", None, sif)
    raise CtrainError(f"image {ref} not found (no image store has it, and there is no {sif}); run ctrain build first")


def run_convert(
    config: ProjectConfig,
    *,
    to: str | None = None,
    compression: str | None = None,
    output: Path | None = None,
    ref: str | None = None,
    force: bool = False,
) -> convert_mod.Converted:
    """Convert the built image as ``config.convert`` says, with the flags on top (``output``, ``ref``,
    ``force`` are not settings)."""
    cfg = override(config.convert, {"to": to, "compression": compression}, where="convert")
    to = cfg.to or config.image_format
    if output is not None:
        convert_mod.check_target(output.absolute(), to)
    image = find_image(config, ref)
    target = output or convert_mod.default_output(config.resolve(config.convert.output_dir), image.ref, to)
    if image.path is not None and target.absolute() == image.path.absolute():
        ui.info(f"convert: {target} is the image itself (built by Apptainer): nothing to do")
        return convert_mod.Converted(target, image.id, to, "auto", True, 0.0)
    return convert_mod.convert(
        image, to, target, compression=cfg.compression, context=_context(config), force=force
    )


@dataclass(frozen=True)
class Pushed:
    what: str  # image | oras | remote
    where: str


def run_push(
    config: ProjectConfig,
    *,
    registry: str | None = None,
    oras: str | None = None,
    remote: str | None = None,
    formats: tuple[str, ...] = (),
    ref: str | None = None,
    files: tuple[Path, ...] = (),
    ssh_options: list[str] | None = None,
) -> list[Pushed]:
    """Push to every destination given (flags), else every one configured in ``push:``.
    ``ssh_options`` (a cluster profile's) replace ``push.ssh_options``."""
    cfg = config.push
    destinations = {"registry": registry, "oras": oras, "remote": remote}
    if any(destinations.values()):  # the destinations on the command line replace the configured ones
        cfg = override(PushConfig(ssh_options=cfg.ssh_options, tls_verify=cfg.tls_verify), destinations, where="push")
    cfg = override(cfg, {"ssh_options": ssh_options}, where="push")
    registry, oras, remote = cfg.registry, cfg.oras, cfg.remote
    if not any((registry, oras, remote)):
        raise ConfigError(
            "nowhere to push: set push.registry, push.oras or push.remote in ctrain.yaml, or pass "
            "--registry HOST/NAMESPACE, --oras oras://HOST/NAME:TAG or --remote [USER@]HOST:/PATH/"
        )
    # Every destination and file is checked before anything is converted or sent.
    if registry:
        registry = push_mod.check_registry(registry)
    if oras:
        push_mod.check_oras(oras)
    formats_of = {f: push_mod.check_source(f, config.convert.output_dir) for f in files}
    if remote:
        push_mod.check_destination(remote, len(files) or len(formats or (config.image_format,)),
                                   ssh_options=cfg.ssh_options)  # fmt: skip
    pushed = []
    image = find_image(config, ref) if (registry or not files) else None
    if registry:
        assert image is not None
        destination = push_mod.registry_destination(registry, image.ref)
        pushed.append(Pushed("image", push_mod.push_image(image, destination, tls_verify=cfg.tls_verify)))

    def converted(to: str) -> Path:
        return run_convert(config, to=to, ref=ref).path

    if oras:
        sif = next((f for f, found in formats_of.items() if found == "sif"), None) or converted("sif")
        pushed.append(Pushed("oras", push_mod.push_oras(sif, oras, tls_verify=cfg.tls_verify)))
    if remote:
        to_send = list(files) or [converted(to) for to in (formats or (config.image_format,))]
        for where in push_mod.push_files(to_send, remote, ssh_options=cfg.ssh_options):
            pushed.append(Pushed("remote", where))
    return pushed


def run_wheelhouse(config: ProjectConfig, directory: Path) -> list[Path]:
    index = config.image.torch_index or wheelhouse.CPU_TORCH_INDEX
    builder_mod.check_torch_index(index)  # the setting ctrain build takes, checked as it checks it
    return wheelhouse.fill(directory, _context(config), torch_index=None if index == "none" else index)
