"""``ctrain push``: the image to an OCI registry, a SIF to an ORAS registry, and SIF/squashfs files to
a cluster's shared filesystem over rsync+ssh (sha256 checked on both sides, renamed into place).

Credentials come only from the tools' standard stores (containers auth.json or the Docker config
for registries, ``apptainer remote login`` / docker config for ORAS, ssh keys and agent for
rsync); ctrain never takes a password, and masks anything that looks like one in the errors it
raises (:func:`ctrain.redact.redact`, the one masking function, which every command error uses too).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import shlex
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

from ctrain import proc, ui
from ctrain.errors import CommandError, ConfigError, CtrainError, ParseError
from ctrain.files import control_problem, shorten, writable_dir_problem
from ctrain.image import convert, reference, store
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
            masked = CtrainError(redact(str(exc)))
            masked.exit_code = exc.exit_code
            raise masked from None

    return wrapper


def is_loopback(host: str) -> bool:
    return bool(_LOOPBACK.match(host))


_REGISTRY_FORM = (
    "HOST[:PORT][/NAMESPACE] like ghcr.io/team or localhost:5000 (lowercase; the image's NAME:TAG is added)"
)


@_redacted
def check_registry(registry: str) -> str:
    """A registry to push to, ``HOST[:PORT][/NAMESPACE]``, checked before anything is sent (skopeo
    takes seconds of retries to say "invalid reference format"); returned without a trailing /."""
    text = registry.rstrip("/")
    found = reference.scheme(text)
    if found:
        raise ConfigError(f"registry {redact(registry)!r}: drop {found}://; a registry is {_REGISTRY_FORM}")
    first, slash, namespace = text.partition("/")
    if "@" in first:
        raise ConfigError(
            "the registry has credentials in it (USER@ or USER:PASSWORD@): ctrain never takes them; log in once "
            f"with `skopeo login {first.rpartition('@')[2]}` (or podman/docker login) and give {_REGISTRY_FORM}"
        )
    if slash and (":" in namespace or "@" in namespace) or (not slash and "@" in text):
        raise ConfigError(
            f"registry {registry!r} has a tag or digest: a registry is {_REGISTRY_FORM}; the image's name and "
            "tag come from --image (image.name:image.tag)"
        )
    reason = reference.problem(f"{text}/ctrain")
    if reason:
        raise ConfigError(f"registry {registry!r} is not valid: {reason}; a registry is {_REGISTRY_FORM}")
    return text


def registry_destination(registry: str, ref: str) -> str:
    """``REGISTRY/NAME:TAG`` for a local ``[localhost/]NAME[:TAG]``."""
    last = ref.rsplit("/", 1)[-1]
    name, _, tag = last.partition(":")
    destination = f"{registry.rstrip('/')}/{name}:{tag or 'latest'}"
    reference.parse(destination, "the destination")
    return destination


@_redacted
def check_oras(url: str) -> None:
    """An ORAS destination, ``oras://HOST[:PORT]/NAME[:TAG]``, checked before the SIF is made."""
    found = reference.scheme(url)
    if found != "oras":
        fix = f"oras://{url}" if found is None else "oras://" + url.split("://", 1)[1]
        raise ConfigError(f"ORAS destination must start with oras:// (got {url}); e.g. {fix}")
    rest = url.removeprefix("oras://")
    if "@" in rest.split("/", 1)[0]:
        raise ConfigError(
            "the ORAS destination has credentials in it (USER@ or USER:PASSWORD@): ctrain never takes them; log in "
            f"once with `apptainer registry login oras://{rest.split('/', 1)[0].rpartition('@')[2]}`"
        )
    parsed = reference.parse(rest, f"ORAS destination {url!r}:", example="oras://ghcr.io/team/ctrain:sif", digest=False)
    if parsed.domain is None:
        raise ConfigError(f"ORAS destination {url!r} names no registry host: write oras://HOST/NAME:TAG, e.g. "
                          f"oras://ghcr.io/{rest}")  # fmt: skip


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
        raise ConfigError(f"{image.ref} is a SIF: push it with --oras or --remote, or build an OCI image")
    host = destination.split("/", 1)[0]
    verify = _verify_tls(host, tls_verify)
    tls = [] if verify else ["--dest-tls-verify=false"]
    emit(f"push: {image.ref} ({image.short_id}) -> {destination}")
    try:
        digest = _copy_to_registry(image, destination, verify, tls)
    except CommandError as exc:
        raise registry_failure(exc, host) from exc
    served = registry_digest(destination, tls_verify=verify)
    if served != digest:
        raise CtrainError(f"pushed {digest}, but {destination} now resolves to {served}: another push raced this one?")
    name = destination.rsplit(":", 1)[0] if ":" in destination.rsplit("/", 1)[-1] else destination
    return f"{name}@{digest}"


def registry_failure(exc: CommandError, host: str) -> CtrainError:
    """A registry that refused or could not be reached, as one line saying what to do; anything
    else as the tool said it."""
    return registry_problem(exc, host, "--registry (push.registry)") or CtrainError(str(exc))


def registry_problem(exc: CommandError, host: str, flag: str) -> CtrainError | None:
    """The one line for a registry that refused or could not be reached, else None. ``flag`` is
    where the user set the registry's address."""
    text = exc.stderr or exc.stdout
    if "server gave HTTP response to HTTPS client" in text:
        return CtrainError(f"{host} speaks plain HTTP, not HTTPS: set push.tls_verify: false in ctrain.yaml if you "
                           "trust it (loopback registries need nothing)")  # fmt: skip
    if re.search(r"unauthorized|authentication required|denied|403 Forbidden", text, re.IGNORECASE):
        return CtrainError(f"{host} refused the push (not logged in, or no write access): log in once with `skopeo "
                           f"login {host}` (or podman/docker login) and check the namespace is yours")  # fmt: skip
    if re.search(r"pinging container registry|no such host|connection refused|i/o timeout|network is unreachable",
                 text, re.IGNORECASE):  # fmt: skip
        ping = re.search(r"pinging container registry [^\n]*", text)
        lines = [line.strip() for line in text.splitlines() if line.strip()] or [""]
        said = ping.group(0) if ping else lines[-1]
        said = said.replace('\\"', '"').rstrip('"')
        return CtrainError(f"cannot reach the registry {host} ({said[-200:]}): check the address and port in "
                           f"{flag}, and that this machine can reach it")  # fmt: skip
    return None


def _copy_to_registry(image: store.Image, destination: str, verify: bool, tls: list[str]) -> str:
    """Copy with skopeo (else podman or docker push); returns the manifest digest written."""
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
        return store.normalise_id(digestfile.read_text())


def registry_digest(reference: str, *, tls_verify: bool | None = None) -> str:
    """The manifest digest a registry serves for ``reference`` (skopeo inspect)."""
    host = reference.split("/", 1)[0]
    tls = [] if _verify_tls(host, tls_verify) else ["--tls-verify=false"]
    out = proc.run(["skopeo", "inspect", *tls, "--format", "{{.Digest}}", f"docker://{reference}"]).stdout
    return store.normalise_id(out)


@_redacted
def push_oras(sif: Path, url: str, *, tls_verify: bool | None = None, emit: Callable[[str], None] = ui.info) -> str:
    """``apptainer push SIF oras://HOST/NAME:TAG`` (credentials: ``apptainer registry login``)."""
    check_oras(url)
    host = url.removeprefix("oras://").split("/", 1)[0]
    cmd = ["apptainer", "push"]
    if not _verify_tls(host, tls_verify):
        cmd.append("--no-https")
    emit(f"push: {sif} -> {url}")
    try:
        proc.stream([*cmd, sif, url], prefix="push: ")
    except CommandError as exc:
        problem = registry_problem(exc, host, "--oras (push.oras)")
        if problem:
            raise problem from exc
        said = [line.strip() for line in (exc.stderr or exc.stdout).splitlines() if line.strip()] or [""]
        raise CtrainError(f"apptainer push to {url} failed: {said[-1][-300:]}") from exc
    return url


@dataclass(frozen=True)
class Remote:
    """A file destination: ``[user@]host:/path``, ``ssh://[user@]host[:port]/path`` or a local path."""

    host: str | None  # None: a local (e.g. shared, mounted) filesystem
    path: str
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Remote:
        """``text`` checked: a host ssh can reach by name, a port number, a path."""
        if not text:
            raise ConfigError("remote is empty: give [USER@]HOST:/PATH/ or a local directory")
        if text.startswith("ssh://"):
            authority, slash, path = text.removeprefix("ssh://").partition("/")
            user, at, host_port = authority.rpartition("@")
            host, colon, port = host_port, "", ""
            if ":" in host_port.rpartition("]")[2]:  # a port, not the colons of an [IPv6] address
                host, colon, port = host_port.rpartition(":")
            login = f"{user}{at}{host}"
            _check_login(login, text)
            if not slash:
                raise ConfigError(f"remote {text!r}: expected ssh://[USER@]HOST[:PORT]/PATH (a path after the host)")
            if colon and not (port.isdigit() and 0 < int(port) < 65536):
                raise ConfigError(f"remote {text!r}: {port!r} is not a port number (1-65535)")
            _check_path("/" + path, text)
            return cls(login, "/" + path, int(port) if port else None)
        found = reference.scheme(text)
        if found:
            raise ConfigError(f"remote {text!r}: {found}:// is not supported; give [USER@]HOST:/PATH/, "
                              "ssh://[USER@]HOST[:PORT]/PATH or a local directory")  # fmt: skip
        head, sep, tail = text.partition(":")
        if sep and "/" not in head and head:
            login = tail.split("/", 1)[0].split(":", 1)[0]
            _check_login(f"{head}:{login}" if "@" in login else head, text)
            if not tail:
                raise ConfigError(f"remote {text!r}: give a path after the colon (host:/path/to/images/)")
            _check_path(tail, text)
            return cls(head, tail)
        _check_path(text, text)
        return cls(None, text)

    def __str__(self) -> str:
        if self.host is None:
            return self.path
        return f"ssh://{self.host}:{self.port}{self.path}" if self.port else f"{self.host}:{self.path}"


_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?")
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*|\[[0-9a-fA-F:.]+\]")


def _check_path(path: str, text: str) -> None:
    """The path of a remote: no control character (it reaches rsync, ssh and messages) and no
    leading '-' (a command there would read it as an option)."""
    problem = control_problem(path)
    if problem:
        raise ConfigError(f"remote {shorten(text)!r}: the path {problem}; give a path without one")
    if path.startswith("-"):
        raise ConfigError(f"remote {shorten(text)!r}: the path starts with '-', which commands read as an option; "
                          "give it as an absolute path (/...) or start it with ./")  # fmt: skip


def _check_login(login: str, text: str) -> None:
    """``[USER@]HOST`` of a remote, as ssh takes it."""
    user, at, host = login.rpartition("@")
    if at and ":" in user:
        raise ConfigError(
            f"the remote for {host} has a password in it: ctrain never takes one; use ssh keys or an agent "
            "(push.ssh_options, e.g. [-i, ~/.ssh/cluster]) and give USER@HOST:/PATH/"
        )
    if at and not _USER.fullmatch(user):
        raise ConfigError(f"remote {text!r}: {user!r} is not a user name")
    if not _HOST.fullmatch(host):
        raise ConfigError(
            f"remote {text!r}: {host!r} is not a host name; write [USER@]HOST:/PATH/ (for a local path with a "
            f"':' in it, start it with ./ or /)"
        )


# What is at "$1" on the destination: missing, other (no regular file), or its first bytes in hex.
_PEEK = ('if [ ! -e "$1" ]; then echo missing; elif [ ! -f "$1" ]; then echo other; '
         f'else head -c {convert.HEAD_BYTES} -- "$1" | od -An -v -tx1 | tr -d " \\n"; fi')  # fmt: skip


class _Target:
    """Shell-free operations on the destination side: local calls or ssh (arguments quoted)."""

    def __init__(self, remote: Remote, ssh_options: Sequence[str]) -> None:
        self.remote = remote
        self.ssh = ["ssh", "-o", "BatchMode=yes", *ssh_options, *(["-p", str(remote.port)] if remote.port else [])]

    def run(self, *args: str, check: bool = True) -> str:
        assert self.remote.host is not None
        result = proc.run([*self.ssh, self.remote.host, "--", shlex.join(args)], check=check)
        return result.stdout if result.returncode == 0 else ""

    def check_dir(self, directory: str, destination: str) -> None:
        """``directory`` exists and takes files; a ConfigError saying which it is not, or that ssh
        cannot reach the host at all."""
        if self.remote.host is None:
            problem = writable_dir_problem(Path(directory))
            if problem:
                exists = Path(directory).exists()
                fix = "choose one you can write" if exists else f"create it (mkdir -p {directory})"
                raise ConfigError(f"remote {destination!r}: {problem}: {fix}")
            return
        probe = 'test -d "$1" || exit 3; test -w "$1" || exit 4'
        result = proc.run([*self.ssh, self.remote.host, "--", shlex.join(["sh", "-c", probe, "sh", directory])],
                          check=False)  # fmt: skip
        if result.returncode == 3:
            raise ConfigError(f"remote {destination!r}: {directory} does not exist on {self.remote.host}: create it "
                              f"(ssh {self.remote.host} mkdir -p {directory})")  # fmt: skip
        if result.returncode == 4:
            raise ConfigError(f"remote {destination!r}: {directory} on {self.remote.host} is not writable for you")
        if result.returncode != 0:
            said = (result.stderr.strip().splitlines() or ["no answer"])[-1]
            raise CtrainError(
                f"cannot reach {self.remote.host} over ssh ({said}): check the host name, and that `ssh "
                f"{self.remote.host} true` works without a password (ssh keys or agent; push.ssh_options)"
            )

    def free_bytes(self, directory: str) -> int | None:
        """Bytes free in ``directory`` (``df -Pk`` over ssh); None where it cannot be told."""
        if self.remote.host is None:
            return shutil.disk_usage(directory).free
        lines = self.run("df", "-Pk", "--", directory, check=False).splitlines()
        fields = lines[-1].split() if len(lines) >= 2 else []
        return int(fields[3]) * 1024 if len(fields) >= 6 and fields[3].isdigit() else None

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
            with ui.file_progress(Path(dest), "push", total=source.stat().st_size):
                shutil.copyfile(source, dest)
            os.chmod(dest, 0o644)
            return
        # --protect-args and proc.RSYNC_ENV: the remote path is an argument, never shell (see there).
        proc.stream(
            [
                "rsync",
                "--protect-args",
                "--partial",
                "--times",
                "--chmod=F644",
                "--info=progress2",  # bytes, share and rate; one line in PROGRESS_EVERY is shown
                "-e",
                shlex.join(self.ssh),
                source.absolute(),  # never a word rsync could read as an option
                f"{self.remote.host}:{dest}",
            ],
            on_line=_every(ui.PROGRESS_EVERY, "push: "),
            env=proc.RSYNC_ENV,
        )

    def check_replaceable(self, path: str, to: str, fix: str) -> None:
        """A ConfigError unless ``path`` is free or holds an image of the kind ``to``
        (:func:`ctrain.image.convert.check_replaceable`, there over ssh)."""
        if self.remote.host is None:
            convert.check_replaceable(Path(path), to, fix)
            return
        result = proc.run([*self.ssh, self.remote.host, "--", shlex.join(["sh", "-c", _PEEK, "sh", path])],
                          check=False)  # fmt: skip
        said = result.stdout.strip()
        where = f"{self.remote.host}:{path}"
        if result.returncode != 0 or not re.fullmatch(r"missing|other|(?:[0-9a-f]{2})*", said):
            why = (result.stderr.strip().splitlines() or ["no answer"])[-1]
            raise CtrainError(f"cannot look at {where} over ssh ({why}): check that `ssh {self.remote.host} true` "
                              "works")  # fmt: skip
        if said == "other":
            raise ConfigError(f"{where} is not a regular file (a directory, device, pipe or socket): {fix}")
        if said != "missing":
            head = bytes.fromhex(said)
            found = convert.head_format(head)
            if found != to:
                raise convert.other_kind(where, found, not head, to, fix)

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


@dataclass(frozen=True)
class Destination:
    """Where files go, checked: the remote, whether it is a directory, and that directory."""

    remote: Remote
    into_dir: bool
    directory: str


@_redacted
def check_destination(
    destination: str, count: int = 1, *, size: int = 0, ssh_options: Sequence[str] = ()
) -> Destination:
    """Where ``count`` files go, checked before anything is converted or sent: a host ssh reaches
    and a directory there that exists and takes files, with room for ``size`` bytes (``df`` there)."""
    remote = Remote.parse(destination)
    if remote.host is not None:
        proc.require("rsync")
        proc.require("ssh")
    target = _Target(remote, ssh_options)
    into_dir = remote.path.endswith("/") or target.is_dir(remote.path)
    if not into_dir and count > 1:
        raise ConfigError(f"{destination} is not a directory; pushing {count} files needs one (end it with /)")
    if into_dir:
        directory = remote.path.rstrip("/") or "/"
    else:
        directory = remote.path.rpartition("/")[0] or ("/" if remote.path.startswith("/") else ".")
    target.check_dir(directory, destination)
    free = target.free_bytes(directory) if size else None
    if free is not None and free < size:
        where = f"{remote.host}:{directory}" if remote.host else directory
        raise CtrainError(
            f"not enough free space in {where} for {size / 1e6:.0f} MB ({free / 1e6:.0f} MB free): free "
            "some space, or push somewhere else (--remote, or the cluster profile's images_dir)"
        )
    return Destination(remote, into_dir, directory)


def check_source(source: Path, output_dir: Path = Path("images")) -> str:
    """The format (sif, sqsh) of a file to send, refused at once when it is missing, no regular
    file (a FIFO would hang the copy, a device never end) or no image."""
    try:
        info = os.stat(source)
    except FileNotFoundError:
        raise ConfigError(f"{source} does not exist; make it with ctrain convert") from None
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{source} is not a regular file (a directory, device, pipe or socket): give the .sif or "
                          f".sqsh file ctrain convert wrote ({output_dir}/NAME-TAG.sif or .sqsh)")  # fmt: skip
    try:
        found = convert.file_format(source)
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read ({exc.strerror}): make it readable") from None
    if found is None:
        raise ConfigError(f"{source} is neither a SIF nor an enroot squashfs: push the files ctrain convert writes "
                          f"({output_dir}/NAME-TAG.sif or .sqsh)")  # fmt: skip
    short = convert.cut_short(source, found)
    if short is not None:
        raise ConfigError(f"{source} is cut short ({short}): an interrupted copy or conversion; make it again with "
                          "ctrain convert")  # fmt: skip
    return found


def _copy_failed(exc: BaseException, source: Path, where: str) -> CtrainError:
    """A failed upload as one message; a full disk says so and what to do."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left on device" in text:
        return CtrainError(f"the destination ran out of space while copying {source} to {where}: free some space "
                           "there, or push somewhere else (--remote)")  # fmt: skip
    return CtrainError(f"copying {source} to {where} failed: {text}")


@_redacted
def push_files(
    files: Sequence[Path], destination: str, *, ssh_options: Sequence[str] = (), emit: Callable[[str], None] = ui.info
) -> list[str]:
    """Copy ``files`` to ``destination`` (a directory, or the file name for a single file):
    upload to a temporary name beside the final one, check sha256 on both sides, rename into place.
    A file already there with the same checksum is not sent again; one that is no image of the
    same kind (a recipe named by mistake, a FIFO) is never replaced. Returns the final paths."""
    kinds = {source: check_source(source) for source in files}
    size = sum(source.stat().st_size for source in files)
    checked = check_destination(destination, len(files), size=size, ssh_options=ssh_options)
    remote = checked.remote
    target = _Target(remote, ssh_options)

    def final_of(source: Path) -> str:
        return f"{checked.directory.rstrip('/')}/{source.name}" if checked.into_dir else remote.path

    for source, kind in kinds.items():  # every file there checked before any is sent
        target.check_replaceable(final_of(source), kind, "push to another path (--remote)")
    results = []
    for source in files:
        final = final_of(source)
        name = final.rpartition("/")[2]
        local_sum = sha256_file(source)
        where = f"{remote.host}:{final}" if remote.host else final
        if target.sha256(final) == local_sum:
            emit(f"push: {where} already has this file (sha256 {local_sum[:12]}): nothing to send")
            results.append(where)
            continue
        tmp = f"{checked.directory.rstrip('/')}/.{name}.ctrain-tmp-{os.getpid()}"
        emit(f"push: {source} -> {where} ({source.stat().st_size / 1e6:.0f} MB)")
        try:
            target.upload(source, tmp)
            remote_sum = target.sha256(tmp)
            if remote_sum != local_sum:
                raise CtrainError(f"checksum mismatch after upload to {where}: local {local_sum}, remote {remote_sum}")
            target.rename(tmp, final)
        except (OSError, CommandError) as exc:
            target.remove(tmp)
            raise _copy_failed(exc, source, where) from exc
        except BaseException:
            target.remove(tmp)
            raise
        emit(f"push: {where} verified (sha256 {local_sum[:12]})")
        results.append(where)
    return results


__all__ = [
    "CommandError",
    "Remote",
    "check_destination",
    "check_oras",
    "check_registry",
    "check_source",
    "push_files",
    "push_image",
    "push_oras",
    "registry_destination",
]


def _every(seconds: float, prefix: str) -> Callable[[str], None]:
    """Show rsync's progress lines (it rewrites one line many times a second) once in ``seconds``,
    and every other line as it comes."""
    shown = [-seconds]

    def line(text: str) -> None:
        text = text.strip()
        if not text:
            return
        if "%" in text and "/s" in text:
            now = time.monotonic()
            if now - shown[0] < seconds:
                return
            shown[0] = now
        ui.info(prefix + text)

    return line
