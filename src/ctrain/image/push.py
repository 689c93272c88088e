"""``ctrain push``: the image to an OCI registry, a SIF to an ORAS registry, and SIF/squashfs files to
a cluster's shared filesystem over rsync+ssh (sha256 checked on both sides, renamed into place).

Credentials come only from the tools' standard stores (containers auth.json or the Docker config
for registries, ``apptainer remote login`` / docker config for ORAS, ssh keys and agent for
rsync); ctrain never takes a password, and masks anything that looks like one in the errors it
raises (:func:`ctrain.redact.redact`, the one masking function, which every command error uses too).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

from ctrain import proc, ui
from ctrain.errors import CommandError, CtrainError, ParseError
from ctrain.image import store
from ctrain.image.build import sha256_file
from ctrain.redact import redact

P = ParamSpec("P")
T = TypeVar("T")
_LOOPBACK = re.compile(r"^(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d+)?$")


def _redacted(fn: Callable[P, T]) -> Callable[P, T]:
    """Errors from ``fn`` with credentials masked: command errors mask themselves, but a message
    of ctrain's own may quote a destination the user gave (``oras://user:pass@...``)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except CommandError:
            raise
        except CtrainError as exc:
            raise CtrainError(redact(str(exc))) from None

    return wrapper


def is_loopback(host: str) -> bool:
    return bool(_LOOPBACK.match(host))


def registry_destination(registry: str, ref: str) -> str:
    """``REGISTRY/NAME:TAG`` for a local ``[localhost/]NAME[:TAG]``."""
    last = ref.rsplit("/", 1)[-1]
    name, _, tag = last.partition(":")
    return f"{registry.rstrip('/')}/{name}:{tag or 'latest'}"


def _verify_tls(host: str, tls_verify: bool | None) -> bool:
    """Like Docker: plain HTTP is allowed for loopback registries only, unless set explicitly."""
    return (not is_loopback(host)) if tls_verify is None else tls_verify


@_redacted
def push_image(
    image: store.Image, destination: str, *, tls_verify: bool | None = None, emit: Callable[[str], None] = ui.info
) -> str:
    """Push ``image`` to ``destination`` (``host/name:tag``); returns ``host/name@sha256:...`` as the
    registry now serves it (checked by reading the tag back)."""
    if image.store == "sif":
        raise CtrainError(f"{image.ref} is a SIF: push it with --oras or --remote, or build an OCI image")
    host = destination.split("/", 1)[0]
    verify = _verify_tls(host, tls_verify)
    tls = [] if verify else ["--dest-tls-verify=false"]
    emit(f"push: {image.ref} ({image.short_id}) -> {destination}")
    with tempfile.TemporaryDirectory(prefix="ctrain-push-") as tmp:
        digestfile = Path(tmp) / "digest"
        if proc.which("skopeo"):
            proc.stream(
                ["skopeo", "copy", *tls, "--digestfile", digestfile, image.source, f"docker://{destination}"],
                prefix="push: ",
            )
        elif image.store == "containers" and proc.which("podman"):
            proc.stream(
                [
                    "podman",
                    "push",
                    *(["--tls-verify=false"] if not verify else []),
                    "--digestfile",
                    digestfile,
                    image.id.removeprefix("sha256:"),
                    f"docker://{destination}",
                ],
                prefix="push: ",
            )
        elif image.store == "docker":
            proc.run(["docker", "tag", image.id, destination])
            out = proc.run(["docker", "push", destination]).stdout
            match = re.search(r"digest: (sha256:[0-9a-f]{64})", out)
            if not match:
                raise ParseError("docker push output (no digest)", out)
            digestfile.write_text(match.group(1))
        else:
            proc.require("skopeo")
        digest = store.normalise_id(digestfile.read_text())
    served = registry_digest(destination, tls_verify=verify)
    if served != digest:
        raise CtrainError(f"pushed {digest}, but {destination} now resolves to {served}: another push raced this one?")
    name = destination.rsplit(":", 1)[0] if ":" in destination.rsplit("/", 1)[-1] else destination
    return f"{name}@{digest}"


def registry_digest(reference: str, *, tls_verify: bool | None = None) -> str:
    """The manifest digest a registry serves for ``reference`` (skopeo inspect)."""
    host = reference.split("/", 1)[0]
    tls = [] if _verify_tls(host, tls_verify) else ["--tls-verify=false"]
    out = proc.run(["skopeo", "inspect", *tls, "--format", "{{.Digest}}", f"docker://{reference}"]).stdout
    return store.normalise_id(out)


@_redacted
def push_oras(sif: Path, url: str, *, tls_verify: bool | None = None, emit: Callable[[str], None] = ui.info) -> str:
    """``apptainer push SIF oras://HOST/NAME:TAG`` (credentials: ``apptainer registry login``)."""
    if not url.startswith("oras://"):
        raise CtrainError(f"ORAS destination must start with oras:// (got {url})")
    host = url.removeprefix("oras://").split("/", 1)[0]
    cmd = ["apptainer", "push"]
    if not _verify_tls(host, tls_verify):
        cmd.append("--no-https")
    emit(f"push: {sif} -> {url}")
    proc.stream([*cmd, sif, url], prefix="push: ")
    return url


@dataclass(frozen=True)
class Remote:
    """A file destination: ``[user@]host:/path``, ``ssh://[user@]host[:port]/path`` or a local path."""

    host: str | None  # None: a local (e.g. shared, mounted) filesystem
    path: str
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Remote:
        if text.startswith("ssh://"):
            match = re.match(r"^ssh://([^/:]+(?:@[^/:]+)?)(?::(\d+))?(/.*)$", text)
            if not match:
                raise CtrainError(f"remote {text!r}: expected ssh://[user@]host[:port]/path")
            return cls(match.group(1), match.group(3), int(match.group(2)) if match.group(2) else None)
        head, sep, tail = text.partition(":")
        if sep and "/" not in head and head:
            if not tail:
                raise CtrainError(f"remote {text!r}: give a path after the colon (host:/path/to/images/)")
            return cls(head, tail)
        return cls(None, text)

    def __str__(self) -> str:
        if self.host is None:
            return self.path
        return f"ssh://{self.host}:{self.port}{self.path}" if self.port else f"{self.host}:{self.path}"


class _Target:
    """Shell-free operations on the destination side: local calls or ssh (arguments quoted)."""

    def __init__(self, remote: Remote, ssh_options: Sequence[str]) -> None:
        self.remote = remote
        self.ssh = ["ssh", "-o", "BatchMode=yes", *ssh_options, *(["-p", str(remote.port)] if remote.port else [])]

    def run(self, *args: str, check: bool = True) -> str:
        assert self.remote.host is not None
        result = proc.run([*self.ssh, self.remote.host, "--", shlex.join(args)], check=check)
        return result.stdout if result.returncode == 0 else ""

    def is_dir(self, path: str) -> bool:
        if self.remote.host is None:
            return Path(path).is_dir()
        assert self.remote.host is not None
        return (
            proc.run([*self.ssh, self.remote.host, "--", shlex.join(["test", "-d", path])], check=False).returncode == 0
        )

    def sha256(self, path: str) -> str | None:
        if self.remote.host is None:
            return sha256_file(Path(path)) if Path(path).is_file() else None
        out = self.run("sh", "-c", 'test -f "$1" && sha256sum -- "$1"', "sh", path, check=False).split()
        return out[0] if out else None

    def upload(self, source: Path, dest: str) -> None:
        if self.remote.host is None:
            shutil.copyfile(source, dest)
            os.chmod(dest, 0o644)
            return
        proc.stream(
            [
                "rsync",
                "--partial",
                "--times",
                "--chmod=F644",
                "-e",
                shlex.join(self.ssh),
                source,
                f"{self.remote.host}:{dest}",
            ],
            prefix="push: ",
        )

    def rename(self, src: str, dest: str) -> None:
        if self.remote.host is None:
            os.replace(src, dest)
        else:
            self.run("mv", "-f", "--", src, dest)

    def remove(self, path: str) -> None:
        if self.remote.host is None:
            Path(path).unlink(missing_ok=True)
        else:
            self.run("rm", "-f", "--", path, check=False)


@_redacted
def push_files(
    files: Sequence[Path], destination: str, *, ssh_options: Sequence[str] = (), emit: Callable[[str], None] = ui.info
) -> list[str]:
    """Copy ``files`` to ``destination`` (a directory, or the file name for a single file):
    upload to a temporary name beside the final one, check sha256 on both sides, rename into place.
    A file already there with the same checksum is not sent again. Returns the final paths."""
    remote = Remote.parse(destination)
    if remote.host is not None:
        proc.require("rsync")
        proc.require("ssh")
    target = _Target(remote, ssh_options)
    into_dir = remote.path.endswith("/") or target.is_dir(remote.path)
    if not into_dir and len(files) > 1:
        raise CtrainError(f"{destination} is not a directory; pushing {len(files)} files needs one (end it with /)")
    if not into_dir and remote.host is None and not Path(remote.path).parent.is_dir():
        raise CtrainError(f"{Path(remote.path).parent} does not exist")
    results = []
    for source in files:
        if not source.is_file():
            raise CtrainError(f"{source} does not exist; make it with ctrain convert")
        final = f"{remote.path.rstrip('/')}/{source.name}" if into_dir else remote.path
        directory, _, name = final.rpartition("/")
        local_sum = sha256_file(source)
        where = f"{remote.host}:{final}" if remote.host else final
        if target.sha256(final) == local_sum:
            emit(f"push: {where} already has this file (sha256 {local_sum[:12]}): nothing to send")
            results.append(where)
            continue
        tmp = f"{directory}/.{name}.ctrain-tmp-{os.getpid()}"
        emit(f"push: {source} -> {where} ({source.stat().st_size / 1e6:.0f} MB)")
        try:
            target.upload(source, tmp)
            remote_sum = target.sha256(tmp)
            if remote_sum != local_sum:
                raise CtrainError(f"checksum mismatch after upload to {where}: local {local_sum}, remote {remote_sum}")
            target.rename(tmp, final)
        except BaseException:
            target.remove(tmp)
            raise
        emit(f"push: {where} verified (sha256 {local_sum[:12]})")
        results.append(where)
    return results


__all__ = ["CommandError", "Remote", "push_files", "push_image", "push_oras", "registry_destination"]
