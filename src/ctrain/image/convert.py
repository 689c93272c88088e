"""``ctrain convert --to sif|sqsh``: the built image as an Apptainer SIF or an enroot squashfs.

Cached by image ID: a sidecar file (``.NAME.ctrain.json``) records which image, format and
compression the output was made from; the same again does no work. Atomic: the output is written
to a temporary name in the same directory and renamed at the end, so a killed conversion never
leaves a file at the final path; its leftovers are removed by the next conversion. Checked first:
the output directory takes files, the tools are there, and the disk has room for the image
unpacked; a conversion that fails anyway leaves no lock, temporary file or directory it made.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ctrain import proc, resources, ui
from ctrain.errors import CommandError, ConfigError, CtrainError
from ctrain.files import (
    NotRegularFile,
    atomic_write_json,
    control_problem,
    creatable_dir_problem,
    load_json_bounded,
    make_dirs,
    open_lock,
    remove_dirs,
    writable_dir_problem,
)
from ctrain.image import sqsh, store
from ctrain.image.build import Progress, run_apptainer

FORMATS = ("sif", "sqsh")
FROM_IMAGE_DEF = Path("containers/ctrain.def")
# "auto": Apptainer's own default for SIF (gzip, which every kernel and squashfuse reads), zstd for
# enroot images (small and fast to decompress; use "none" for the fastest pyxis start).
AUTO_COMPRESSION = {"sif": "gzip", "sqsh": "zstd"}
SUFFIXES = {"sif": (".sif",), "sqsh": (".sqsh", ".squashfs")}
# Free space a conversion needs, in image sizes: the exported OCI layout, the unpacked root
# filesystem (umoci for sqsh, Apptainer's for SIF) and the output exist at the same time, each up
# to the image's size; plus a margin for the filesystem's own use.
SPACE_FACTOR = 3
SPACE_MARGIN = 64 << 20
_SQUASHFS_MAGIC = b"hsqs"
_SIF_MAGIC = b"SIF_MAGIC"
HEAD_BYTES = 128  # a SIF's magic is within its first 128 bytes, after the launch line
_NO_SPACE = "no space left on device"


@dataclass(frozen=True)
class Converted:
    """A conversion's result; ``cached`` when the existing file was already up to date."""

    path: Path
    image_id: str
    to: str
    compression: str
    cached: bool
    seconds: float


def resolve_compression(to: str, compression: str) -> str:
    value = AUTO_COMPRESSION[to] if compression == "auto" else compression
    if value not in sqsh.SQUASH_OPTIONS:
        raise ConfigError(f"unknown compression '{compression}'; valid: auto, {', '.join(sqsh.SQUASH_OPTIONS)}")
    return value


def file_format(path: Path) -> str | None:
    """``sif`` or ``sqsh`` from a file's first bytes (None for anything else, and for what is no
    regular file); OSError when it cannot be read. Opened without blocking, so a FIFO named by
    mistake returns at once instead of waiting for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, HEAD_BYTES)
    finally:
        os.close(fd)
    return head_format(head)


def head_format(head: bytes) -> str | None:
    """``sif`` or ``sqsh`` from a file's first :data:`HEAD_BYTES` bytes, None for anything else."""
    if head.startswith(_SQUASHFS_MAGIC):
        return "sqsh"
    if _SIF_MAGIC in head:
        return "sif"
    return None


# Where each format says how long it is: a SIF's global header (magic at byte 32) ends with its data
# section's offset and length (little-endian int64s at bytes 112 and 120); a squashfs superblock has
# bytes_used at byte 40 (the file is padded past it, to 4 KiB).
_SIF_MAGIC_AT = 32
_SIF_DATA_END = 112
_SQUASHFS_BYTES_USED = 40


def cut_short(path: Path, found: str) -> str | None:
    """Why an image file of format ``found`` (``sif``, ``sqsh``) is shorter than its own header says
    (an interrupted copy, push or build), else None; OSError when it cannot be read. A header this
    check does not know is left to the runtime."""
    import struct

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEAD_BYTES, 0)
    finally:
        os.close(fd)
    if found == "sif":
        if not head.startswith(_SIF_MAGIC, _SIF_MAGIC_AT) or len(head) < _SIF_DATA_END + 16:
            return None
        offset, length = struct.unpack_from("<2q", head, _SIF_DATA_END)
        end = offset + length if offset >= 0 and length >= 0 else 0
    else:
        if len(head) < _SQUASHFS_BYTES_USED + 8:
            return f"{size:,} bytes, shorter than a squashfs superblock"
        (end,) = struct.unpack_from("<q", head, _SQUASHFS_BYTES_USED)
    if end > size:
        return f"{size:,} bytes where its header says {end:,}"
    return None


def default_output(output_dir: Path, ref: str, to: str) -> Path:
    """``images/NAME-TAG.sif``: the name without registry or path, so scripts can rely on it."""
    last = ref.rsplit("/", 1)[-1]
    name, _, tag = last.partition(":")
    return output_dir / f"{name}-{tag or 'latest'}.{to}"


def _sidecar(output: Path) -> Path:
    return output.parent / f".{output.name}.ctrain.json"


def _record(output: Path) -> dict[str, object] | None:
    """The sidecar's record, None when there is none or it is not one (bounded: it is a few lines)."""
    try:
        record = load_json_bounded(_sidecar(output), 64 << 10, "conversion record")
    except ConfigError:
        return None
    return record if isinstance(record, dict) else None


def up_to_date(output: Path, image_id: str, to: str, compression: str) -> bool:
    """Whether ``output`` was made from exactly this image, format and compression, untouched since."""
    record = _record(output)
    if record is None or not output.is_file():
        return False
    st = output.stat()
    return record == {
        **record,
        "image_id": image_id,
        "to": to,
        "compression": compression,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(output: Path) -> list[Path]:
    """Remove temporary files of conversions to ``output`` whose process is gone (e.g. killed)."""
    pattern = re.compile(rf"^\.{re.escape(output.name)}\.(tmp|work)-(\d+)(-.*)?$")
    removed = []
    if not output.parent.is_dir():
        return removed
    for entry in output.parent.iterdir():
        match = pattern.match(entry.name)
        if match and not _pid_alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry)
    return removed


@contextlib.contextmanager
def _locked(output: Path, emit: Callable[[str], None]) -> Iterator[None]:
    """One conversion per output at a time (a second waits for the first, then finds it cached).

    The lock file goes when the conversion ends, success or not. A waiter may then hold a lock on
    the removed file, so each holder checks it locked the file that is still there, else retries.
    """
    lock = output.parent / f".{output.name}.lock"
    while True:
        try:  # never through a link, never a FIFO (opening one waits for a reader)
            handle = os.fdopen(open_lock(lock, 0o644), "a")
        except NotRegularFile:
            raise CtrainError(f"the conversion lock {lock} is not a regular file (a link, FIFO or directory): "
                              "remove it") from None  # fmt: skip
        except OSError as exc:
            raise CtrainError(f"cannot take the conversion lock {lock} ({exc.strerror})") from None
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                emit(f"convert: waiting for another conversion of {output} to finish")
                fcntl.flock(handle, fcntl.LOCK_EX)
            held = os.fstat(handle.fileno())
            try:
                current = os.stat(lock)
            except FileNotFoundError:
                current = None
        except BaseException:
            handle.close()
            raise
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            break
        handle.close()
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        handle.close()


_KINDS = {"sif": "a SIF", "sqsh": "an enroot squashfs"}


def check_replaceable(path: Path, to: str, fix: str) -> None:
    """A ConfigError unless ``path`` is free, or holds an image of the kind ``to`` (which ctrain
    replaces): never a device, FIFO or socket, and never a file of another kind (a recipe named by
    mistake), since writing there loses it. ``fix`` ends the message."""
    kind = _KINDS[to]
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{path} cannot be examined ({exc.strerror}): {fix}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path} is a directory: {fix}")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path} is not a regular file (a device, pipe or socket): it would not take {kind}; {fix}")
    try:
        found = file_format(path)
    except OSError as exc:
        raise ConfigError(f"{path} exists and cannot be read ({exc.strerror}), so ctrain cannot tell it is {kind} "
                          f"it may replace: move it away, or {fix}") from None  # fmt: skip
    if found != to:
        raise other_kind(str(path), found, not info.st_size, to, fix)


def other_kind(where: str, found: str | None, empty: bool, to: str, fix: str) -> ConfigError:
    """The refusal to write ``to`` over a file at ``where`` that holds ``found`` (None: no image)."""
    kind = _KINDS[to]
    what = f"{_KINDS[found]}, not {kind}" if found else "an empty file" if empty else "no container image"
    return ConfigError(f"{where} exists and is {what}: ctrain replaces only {kind} there, so it is kept; move it "
                       f"away, or {fix}")  # fmt: skip


def check_output(output: Path, to: str) -> None:
    """The output names a file of the format asked for, where no other file would be lost."""
    problem = control_problem(str(output))
    if problem:  # the SIF's work directory beside it reaches Apptainer's definition (From:)
        raise ConfigError(f"the output {str(output)!r} {problem}: name it without one")
    if output.is_dir():
        raise ConfigError(f"{output} is a directory: give the output file's name, e.g. {output}/NAME.{to}")
    other = next((f for f, suffixes in SUFFIXES.items() if f != to and output.name.endswith(suffixes)), None)
    if other:
        raise ConfigError(
            f"--to {to} writes {'a SIF' if to == 'sif' else 'an enroot squashfs'}, but {output.name} is named as "
            f"{'a SIF' if other == 'sif' else 'an enroot squashfs'}: use --to {other}, or name the output .{to}"
        )
    check_replaceable(output, to, f"write elsewhere with -o/--output DIR/NAME.{to}")


def check_target(output: Path, to: str) -> None:
    """What can be known of ``output`` before the image is even looked up: it names a file of the
    format asked for, in a place that takes files (the nearest existing directory, as the rest is
    created)."""
    check_output(output, to)
    problem = creatable_dir_problem(output.parent)
    if problem:
        raise CtrainError(
            f"cannot write {output}: {problem}: write it elsewhere with -o/--output DIR/{output.name} "
            "(or convert.output_dir in ctrain.yaml)"
        )


def _check_tools(image: store.Image, to: str, context: Path) -> None:
    """Every program and file the conversion needs, before any work starts."""
    if image.store == "sif":
        return
    proc.require("skopeo")
    if to == "sqsh":
        proc.require("umoci")
        proc.require("mksquashfs")
        return
    definition(context)
    proc.require("apptainer")


def definition(context: Path) -> Path:
    """containers/ctrain.def of the context (a checkout or a project from ``ctrain init``), else ctrain's own."""
    found = context / FROM_IMAGE_DEF
    return found if found.is_file() else resources.path(*FROM_IMAGE_DEF.parts)


def space_needed(image: store.Image) -> int | None:
    """Bytes a conversion of ``image`` needs in the output's filesystem (None: size unknown)."""
    if image.store == "sif" and image.path is not None:
        return image.path.stat().st_size + SPACE_MARGIN
    return None if image.size is None else image.size * SPACE_FACTOR + SPACE_MARGIN


def _check_space(image: store.Image, output: Path, to: str) -> None:
    needed = space_needed(image)
    free = shutil.disk_usage(output.parent).free
    if needed is not None and free < needed:
        size = image.path.stat().st_size if image.path is not None else image.size or 0
        raise CtrainError(
            f"not enough free space in {output.parent} to convert {image.ref} ({ui.size(size)}): about "
            f"{ui.size(needed)} needed (the image unpacked, and the {to}), {ui.size(free)} free: free some space, "
            f"or write elsewhere with -o/--output DIR/{output.name} (or convert.output_dir in ctrain.yaml)"
        )


def _failed(exc: OSError | CommandError, output: Path) -> CtrainError | None:
    """A conversion that failed on the way, as one message (None: the tool's own error says it
    best); a full disk says so and what to do."""
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or _NO_SPACE in str(exc).lower():
        return CtrainError(
            f"ran out of space in {output.parent} while converting (nothing was kept): free some space, or write "
            f"elsewhere with -o/--output DIR/{output.name}"
        )
    if isinstance(exc, OSError):
        return CtrainError(f"converting to {output} failed: {exc.strerror or exc} ({exc.filename or output.parent})")
    return None


def convert(
    image: store.Image,
    to: str,
    output: Path,
    *,
    compression: str = "auto",
    context: Path,
    force: bool = False,
    emit: Callable[[str], None] = ui.info,
) -> Converted:
    """Convert ``image`` to ``output`` (``to``: sif or sqsh); no work when it is already up to date."""
    if to not in FORMATS:
        raise ConfigError(f"unknown format '{to}'; valid: {', '.join(FORMATS)}")
    compression = resolve_compression(to, compression)
    if image.store == "sif" and to != "sif":
        raise CtrainError(
            f"{image.ref} is a SIF made by Apptainer; an enroot image needs an OCI image: build with "
            "podman, buildah or docker (ctrain build --builder podman)"
        )
    start = time.monotonic()
    output = output.absolute()
    check_output(output, to)
    made = make_dirs(output.parent, "write it elsewhere with -o/--output (or convert.output_dir in ctrain.yaml)")
    try:
        problem = writable_dir_problem(output.parent)
        if problem:
            raise CtrainError(
                f"cannot write {output.name} there: {problem}: write it elsewhere with -o/--output DIR/{output.name} "
                "(or convert.output_dir in ctrain.yaml)"
            )
        with _locked(output, emit):
            for path in clean_stale(output):
                emit(f"convert: removed {path.name}, left by an interrupted conversion")
            if not force and up_to_date(output, image.id, to, compression):
                emit(f"convert: {output} is up to date (image {image.short_id}, {to}, {compression}): nothing to do")
                return Converted(output, image.id, to, compression, True, time.monotonic() - start)
            _check_tools(image, to, context)
            _check_space(image, output, to)
            emit(f"convert: {image.ref} ({image.short_id}) -> {output} ({to}, {compression})")
            try:
                _write(image, to, output, compression, context, emit)
            except (OSError, CommandError) as exc:
                failure = _failed(exc, output)
                if failure is None:
                    raise
                raise failure from exc
    except BaseException:
        remove_dirs(made)
        raise
    seconds = time.monotonic() - start
    emit(f"convert: wrote {output} ({output.stat().st_size / 1e6:.0f} MB) in {seconds:.0f} s")
    return Converted(output, image.id, to, compression, False, seconds)


def _write(
    image: store.Image, to: str, output: Path, compression: str, context: Path, emit: Callable[[str], None]
) -> None:
    """The conversion itself, into a temporary file renamed over ``output``, with its sidecar."""
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.work-{os.getpid()}-", dir=output.parent))
    try:
        if image.store == "sif":
            assert image.path is not None
            with ui.file_progress(tmp, "convert", total=image.path.stat().st_size, emit=emit):
                shutil.copyfile(image.path, tmp)
        else:
            layout = work / "oci"
            emit("convert: exporting the image as an OCI layout")
            store.export_oci(image, layout, "image")
            with ui.file_progress(tmp, "convert", emit=emit):
                if to == "sif":
                    _sif(image, layout, tmp, compression, context, work, emit)
                else:
                    sqsh.write(layout, "image", store.oci_config(layout), tmp, compression, work, emit=emit)
        if to == "sqsh":
            sqsh.self_check(tmp, work, emit, shown=str(output))
        tmp.chmod(0o644)
        _sidecar(output).unlink(missing_ok=True)
        os.replace(tmp, output)
        st = output.stat()
        record = {
            "image_id": image.id,
            "image_ref": image.ref,
            "to": to,
            "compression": compression,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
        }
        atomic_write_json(_sidecar(output), record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        tmp.unlink(missing_ok=True)


def _sif(
    image: store.Image,
    layout: Path,
    tmp: Path,
    compression: str,
    context: Path,
    work: Path,
    emit: Callable[[str], None],
) -> None:
    """``apptainer build`` of containers/ctrain.def from the exported layout (the exact image ID)."""
    cmd = ["apptainer", "build", "--disable-cache"]
    if compression != AUTO_COMPRESSION["sif"]:
        cmd += ["--mksquashfs-args", " ".join(sqsh.SQUASH_OPTIONS[compression])]
    if os.geteuid() == 0:
        # Apptainer started as root needs every capability it asks for; where it may not have them
        # (containers, some sandboxes) the %test container would fail, so root skips it.
        emit("convert: running as root: skipping the definition's %test (run `apptainer test IMAGE.sif` as a user)")
        cmd.append("--notest")
    for key, value in {
        "BOOTSTRAP": "oci",
        "IMAGE": str(layout),
        "SOURCE_REF": image.ref,
        "SOURCE_ID": image.id,
    }.items():
        cmd += ["--build-arg", f"{key}={value}"]
    cmd += [str(tmp), str(definition(context))]
    scratch = work / "apptainer"
    scratch.mkdir()
    run_apptainer(cmd, env={"APPTAINER_TMPDIR": str(scratch)}, on_line=Progress(emit, "sif"))
