"""Checks of the image a job names, before it waits in the queue: whether the setting names a file or a
registry reference (the rule bash has in ``ctrain_image_is_file``), the file's format against the
runtime (a SIF for Apptainer, an enroot squashfs for pyxis; whole, not cut short), and a reference
written the way the runtime pulls it (:mod:`ctrain.image.reference`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ctrain.errors import ConfigError
from ctrain.image import reference

# Container image references.
_URI_SCHEMES = (
    "docker://",
    "oras://",
    "library://",
    "shub://",
    "http://",
    "https://",
    "docker-archive:",
    "oci-archive:",
)
IMAGE_SUFFIXES = (".sif", ".sqsh", ".squashfs")


class MissingImage(ConfigError):
    """The image file is not there (yet): an error for a job, a note for a dry run."""


def image_is_file(image: str, project: Path) -> bool:
    """Whether an image setting names a file, else a registry reference: a path (``/``, ``./``,
    ``../``, ``~/``), a name ending .sif, .sqsh or .squashfs, or something that exists in the
    project directory; never a URI. Users copy references from registries (nvcr.io/nvidia/pytorch:TAG),
    so a ``/`` alone does not make a path. The same rule in bash is ``ctrain_image_is_file`` in
    sbatch/lib/ctrain.sh (for jobs queued with plain sbatch); a test keeps the two in agreement."""
    if not image:
        return False
    if image.startswith(("/", "./", "../", "~/")) or image in (".", ".."):
        return True
    if "://" in image:
        return False
    if image.endswith(IMAGE_SUFFIXES):
        return True
    return os.path.lexists(project / image)


def image_path(image: str, project: Path) -> Path:
    path = Path(image).expanduser()
    return path if path.is_absolute() else project / path


def image_setting(image: str, root: Path, runtime: str) -> str:
    """A file made absolute against the project config's directory ``root``; a registry reference checked,
    and for pyxis written the way enroot reads it."""
    if image_is_file(image, root):
        return str(image_path(image, root))
    return image_reference(image, runtime, root)


def image_reference(image: str, runtime: str, project: Path) -> str:
    """A registry reference as the runtime takes it (a ConfigError when it cannot)."""
    first = image.split("/", 1)[0]
    if "/" in image and "://" not in image and "#" not in image and not reference.is_domain(first):
        folder = project / first
        if folder.is_dir():
            inside = sorted(p.name for p in folder.iterdir() if p.name.endswith(IMAGE_SUFFIXES))
            hint = f" (it holds {', '.join(inside[:3])})" if inside else ""
            raise ConfigError(
                f"image {project / image} does not exist, and {first}/ is a directory here{hint}: fix the file's name, "
                f"or make it (ctrain convert); for Docker Hub's image {image} write docker.io/{image}"
            )
    if runtime == "pyxis":
        return reference.enroot(image, "the image")
    if image.startswith(("docker://", "oras://")):
        reference.parse(image.split("://", 1)[1], f"the image {image!r}:", example=f"docker://{reference.EXAMPLE}")
        return image
    if image.startswith(_URI_SCHEMES):
        return image
    as_docker = image.replace("#", "/", 1)
    if reference.problem(as_docker) is None:
        raise ConfigError(
            f"the image {image!r} is a registry reference, which Apptainer pulls through a URI: use "
            f"docker://{as_docker} (each node then converts it when the job starts), or make a SIF once "
            "(ctrain convert --to sif) and give its path"
        )
    raise ConfigError(
        f"the image {image!r} is neither an image file (.sif, or a path starting with / or ./) nor a "
        f"registry URI (docker://{reference.EXAMPLE}); for Apptainer make one with ctrain convert --to sif"
    )


def check_image(image: str, runtime: str, project: Path | None = None) -> None:
    """The image exists and suits the runtime: a readable file of the runtime's format, or a
    well-formed reference the runtime can pull."""
    project = project or Path.cwd()
    if not image_is_file(image, project):
        image_reference(image, runtime, project)
        return
    path = image_path(image, project)
    kind = image_kind(path, runtime)
    if runtime == "pyxis" and kind != "squashfs":
        fix = "ctrain convert --to sqsh" + (", or submit with --runtime apptainer" if kind == "SIF" else "")
        raise ConfigError(
            f"pyxis needs an enroot squashfs, and {image} is {'a ' + kind if kind == 'SIF' else kind}: run "
            f"{fix}, and set slurm.image (or IMAGE) to the .sqsh"
        )
    if runtime == "apptainer" and kind == "squashfs":
        raise ConfigError(
            f"Apptainer needs a SIF, and {image} is a squashfs (enroot's format, for pyxis): run ctrain convert "
            "--to sif and give the .sif, or submit with --runtime pyxis"
        )
    if runtime == "apptainer" and kind not in ("SIF", "a sandbox directory"):
        raise ConfigError(
            f"Apptainer cannot run {image}: it is {kind} (expected a .sif from `ctrain convert --to sif`)"
        )


def image_kind(path: Path, runtime: str) -> str:
    """SIF, squashfs, a sandbox directory (Apptainer), or a description of what else it is; a
    ConfigError for what is no image at all (missing, a plain directory, unreadable)."""
    make = "ctrain convert --to " + ("sqsh" if runtime == "pyxis" else "sif")
    if not path.exists():
        broken = " (a symbolic link to nothing)" if path.is_symlink() else ""
        raise MissingImage(
            f"image {path} does not exist{broken}: build and convert it (`ctrain build && {make}`), "
            "or set slurm.image / IMAGE to an existing image"
        )
    if path.is_dir():
        if runtime == "apptainer" and (path / ".singularity.d").is_dir():
            return "a sandbox directory"
        inside = sorted(p.name for p in path.iterdir() if p.name.endswith(IMAGE_SUFFIXES))
        hint = f" (it holds {', '.join(inside[:3])})" if inside else ""
        raise ConfigError(f"image {path} is a directory, not an image file{hint}: give the image file's path")
    if not path.is_file():
        raise ConfigError(f"image {path} is not a regular file (a device or pipe?): give the image file's path")
    from ctrain.image.convert import cut_short, file_format

    try:
        found = file_format(path)
        short = cut_short(path, found) if found is not None else None
    except OSError as exc:
        raise ConfigError(
            f"image {path} cannot be read ({exc.strerror}): make it readable by the job's user "
            f"(chmod a+r {path}) or copy it where they can read it"
        ) from exc
    if found is not None:
        if short is not None:
            raise ConfigError(
                f"image {path} is cut short ({short}): an interrupted copy or conversion, which would fail on "
                f"every node; make it again (`{make}`, then `ctrain push`) or copy it again"
            )
        return {"sqsh": "squashfs", "sif": "SIF"}[found]
    if path.stat().st_size == 0:
        return "an empty file (an interrupted copy?)"
    return "not a container image (neither SIF nor squashfs)"


# Where a ctrain image has it (containers/Dockerfile), then anywhere a Python package can be.
_CTRAIN_PATH = "opt/ctrain/venv/bin/ctrain"
_CTRAIN_PACKAGE = re.compile(r"/(?:site|dist)-packages/ctrain/__init__\.py$", re.MULTILINE)
# A SIF's descriptors (sif's rawDescriptor, packed): type int32, used, id, group, link, then offset
# and size int64, ...; 585 bytes each. The system partition (type 0x4004) holds the squashfs.
_SIF_DESCRIPTORS_AT = 96
_SIF_DESCRIPTOR_BYTES = 585
_SIF_PARTITION = 0x4004


def squashfs_offset(path: Path, kind: str) -> int | None:
    """Where the image's root file system (a squashfs) starts in the file: 0 for enroot's squashfs, the
    system partition's offset in a SIF; None where the file does not say."""
    if kind == "squashfs":
        return 0
    import struct

    with open(path, "rb") as image:
        head = image.read(128)
        if len(head) < 112:
            return None
        start, length = struct.unpack_from("<2q", head, _SIF_DESCRIPTORS_AT)
        if start <= 0 or not 0 < length <= 64 * 2**20:
            return None
        image.seek(start)
        table = image.read(length)
    for at in range(0, len(table) - _SIF_DESCRIPTOR_BYTES + 1, _SIF_DESCRIPTOR_BYTES):
        kind_, used = struct.unpack_from("<i?", table, at)
        if used and kind_ == _SIF_PARTITION:
            (offset,) = struct.unpack_from("<q", table, at + 17)
            return offset
    return None


def _squashfs(image: str, runtime: str, project: Path) -> tuple[Path, int] | None:
    """The image file and where its squashfs starts, where unsquashfs can read it here; None for a
    registry reference, a sandbox directory, no unsquashfs, a layout this does not know."""
    from ctrain import proc

    if not image_is_file(image, project) or proc.which("unsquashfs") is None:
        return None
    path = image_path(image, project)
    kind = image_kind(path, runtime)
    offset = squashfs_offset(path, kind) if kind in ("SIF", "squashfs") else None
    return None if offset is None else (path, offset)


def image_facts(image: str, runtime: str, project: Path) -> dict[str, object] | None:
    """What the image says it is (:mod:`ctrain.image.facts`), read from the file; None where it does not say."""
    from ctrain import proc
    from ctrain.image import facts

    found = _squashfs(image, runtime, project)
    if found is None:
        return None
    path, offset = found
    out = proc.run(["unsquashfs", "-no-progress", "-o", str(offset), "-cat", str(path), facts.FACTS_PATH],
                   check=False, timeout=120, binary=True)  # fmt: skip
    return facts.parse(out.stdout) if out.returncode == 0 else None


def holds_ctrain(image: str, runtime: str, project: Path) -> bool | None:
    """Whether an image file has ctrain installed (what ``python -m ctrain train`` needs on every node),
    read from its squashfs with unsquashfs; None where that cannot be told here (:func:`_squashfs`)."""
    from ctrain import proc

    found = _squashfs(image, runtime, project)
    if found is None:
        return None
    path, offset = found
    listing = ["unsquashfs", "-no-progress", "-o", str(offset), "-l", "-d", "", str(path)]
    quick = proc.run([*listing, _CTRAIN_PATH], check=False, timeout=120)
    if quick.returncode != 0:
        return None
    if _CTRAIN_PATH in quick.stdout:
        return True
    everything = proc.run(listing, check=False, timeout=300)
    return bool(_CTRAIN_PACKAGE.search(everything.stdout)) if everything.returncode == 0 else None
