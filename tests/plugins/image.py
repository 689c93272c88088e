"""Fixtures for image tests, shared with the sbatch/testbed tests.

Session-scoped, built once per session through the real CLI (``ctrain build --local-base``,
``ctrain convert``), and cached across test runs by content: the key hashes containers/, pyproject
and the src/ctrain tree, so a rerun with nothing changed reuses the image and files, and a code
change rebuilds only the source layer. Everything lives under /var/tmp/ctrain-test (world-readable,
so the unprivileged Apptainer user can read it; override with CTRAIN_TEST_IMAGES).

- ``image_user``: name of the unprivileged user Apptainer runs as (the testbed's job user).
- ``test_wheelhouse``: Path of a wheelhouse with every wheel of the CPU image (air-gapped builds).
- ``cpu_image``: :class:`BuiltImage` (``ref``, ``id``, ``digest``, ``project``: the directory
  with the ``ctrain.yaml`` it was built with, ``key``), in containers-storage.
- ``cpu_sif``: Path of the CPU image as a SIF (zstd).
- ``cpu_sqsh``: Path of the CPU image as an enroot squashfs (zstd), with enroot's conventions.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import golden_files
from tests.conftest import need, need_root

REPO = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("CTRAIN_TEST_IMAGES", "/var/tmp/ctrain-test"))
CTRAIN = [sys.executable, "-m", "ctrain"]
IMAGE_NAME = "ctrain-test"
# What the image is made of: a change to any of these makes a new image (and new SIF/sqsh).
_KEY_FILES = ("containers", "pyproject.toml", ".dockerignore", "src/ctrain")


def assert_golden(name: str, text: str) -> None:
    """``text`` equals tests/golden/image/NAME."""
    golden_files.assert_golden("image", name, text)


def content_key(repo: Path = REPO) -> str:
    """Hash of everything the image is built from (file names and bytes), 12 hex digits."""
    digest = hashlib.sha256()
    for top in _KEY_FILES:
        path = repo / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            rel = file.relative_to(repo)
            inner = rel.relative_to(top).parts
            if "__pycache__" in inner or file.suffix == ".pyc" or any(part.startswith(".") for part in inner):
                continue
            digest.update(str(rel).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class BuiltImage:
    """The CPU test image: ``ref`` and ``id`` in containers-storage, ``project`` holds its ctrain.yaml."""

    ref: str
    id: str
    digest: str
    project: Path
    key: str

    @property
    def config(self) -> Path:
        return self.project / "ctrain.yaml"


def ctrain(args: Sequence[str | os.PathLike[str]], *, config: Path | None = None, log: Path | None = None,
           check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (``python -m ctrain``); stderr (progress) goes to ``log`` when given."""
    cmd = [*CTRAIN, *(["--config", str(config)] if config else []), *map(str, args)]
    if log is None:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    else:
        with open(log, "a") as err:
            result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, cwd=REPO)
    if check and result.returncode != 0:
        tail = log.read_text()[-4000:] if log else result.stderr
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n{tail}")
    return result


def parse_fields(stdout: str) -> dict[str, str]:
    """``key: value`` lines (what build/convert print on stdout) as a dict."""
    return dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)


def as_user(user: str, args: Sequence[str | os.PathLike[str]], *, check: bool = True,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run a command as the unprivileged ``user`` (from a directory it can enter)."""
    result = subprocess.run(["runuser", "-u", user, "--", *map(str, args)], capture_output=True, text=True,
                            timeout=timeout, cwd="/")
    if check and result.returncode != 0:
        raise AssertionError(f"as {user}: {' '.join(map(str, args))} exited {result.returncode}\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One builder of a cached thing at a time, across concurrent test sessions."""
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f".{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _open_up(path: Path) -> None:
    """World-readable (and enterable) from / down to ``path``, for the unprivileged user."""
    for directory in [ROOT, *[p for p in path.parents if ROOT in p.parents], path]:
        if directory.is_dir():
            directory.chmod(directory.stat().st_mode | 0o755)


@pytest.fixture(scope="session")
def image_user() -> str:
    """The unprivileged user Apptainer runs as (created if missing, /dev/fuse opened to users)."""
    need_root()
    from ctrain.testbed import host
    from ctrain.testbed.plan import JOB_USER

    host.ensure_user(JOB_USER)
    if host.fuse_needs_opening():
        host.open_fuse()
    return JOB_USER


@pytest.fixture(scope="session")
def test_wheelhouse() -> Path:
    """Every wheel of the CPU image, made once per pin set with ``ctrain wheelhouse`` (pip download
    through this machine's pip configuration, which serves the CPU torch wheel)."""
    need_root()
    pins = hashlib.sha256(b"".join((REPO / "containers" / n).read_bytes() for n in ("constraints.txt", "requirements.txt")))
    directory = ROOT / f"wheelhouse-{pins.hexdigest()[:12]}"
    with _locked("wheelhouse"):
        done = directory / ".complete"
        if not done.exists():
            for old in ROOT.glob("wheelhouse-*"):
                shutil.rmtree(old)
            project = ROOT / "wheelhouse-project"
            project.mkdir(parents=True, exist_ok=True)
            (project / "ctrain.yaml").write_text(f"image:\n  context: {REPO}\n  torch_index: none\n")
            ctrain(["wheelhouse", directory], config=project / "ctrain.yaml", log=ROOT / "wheelhouse.log")
            done.write_text("")
        _open_up(directory)
    return directory


@pytest.fixture(scope="session")
def cpu_image(test_wheelhouse: Path) -> BuiltImage:
    """The real Dockerfile's CPU flavour on a debootstrap base, built air-gapped from the wheelhouse
    with ``ctrain build --local-base`` and no other flag (the rest comes from ctrain.yaml)."""
    need_root()
    need(shutil.which("buildah") is not None or shutil.which("podman") is not None, "buildah or podman")
    need(shutil.which("debootstrap") is not None, "debootstrap")
    from ctrain.image import store

    key = content_key()
    project = ROOT / key
    ref = f"localhost/{IMAGE_NAME}:{key}"
    with _locked("build"):
        _prune(key)
        project.mkdir(parents=True, exist_ok=True)
        os.utime(project)  # in use: _prune in another test run leaves it alone
        _open_up(project)
        (project / "ctrain.yaml").write_text(
            f"image:\n  name: {IMAGE_NAME}\n  tag: {key}\n  context: {REPO}\n  flavour: cpu\n  builder: buildah\n"
            f"  wheelhouse: {test_wheelhouse}\n  torch_index: none\nconvert:\n  output_dir: images\n"
        )
        existing = store.inspect(ref, "containers")
        if existing is None:
            out = ctrain(["build", "--local-base"], config=project / "ctrain.yaml", log=project / "build.log")
            fields = parse_fields(out.stdout)
            assert fields["image"] == f"{IMAGE_NAME}:{key}", out.stdout
            existing = store.inspect(ref, "containers")
            assert existing is not None and existing.id == fields["id"], out.stdout
        assert existing.digest, f"no manifest digest for {ref}"
        return BuiltImage(ref, existing.id, existing.digest, project, key)


def _prune(current: str, keep: int = 3, grace: float = 3600) -> None:
    """Remove the images and files of other keys, except the newest few and anything used in the
    last hour (another test session on this machine may still be running jobs from them)."""
    keys = sorted((p for p in ROOT.iterdir() if p.is_dir() and re.fullmatch(r"[0-9a-f]{12}", p.name)
                   and p.name != current), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in keys[keep:]:
        if time.time() - old.stat().st_mtime > grace:
            shutil.rmtree(old, ignore_errors=True)
            subprocess.run(["buildah", "rmi", f"localhost/{IMAGE_NAME}:{old.name}"], capture_output=True)


def _converted(image: BuiltImage, to: str) -> Path:
    with _locked(f"convert-{to}"):
        out = ctrain(["convert", "--to", to, "--compression", "zstd"], config=image.config,
                     log=image.project / f"convert-{to}.log")
    path = Path(parse_fields(out.stdout)["path"])
    assert path.is_file() and path.stat().st_mode & 0o004, path
    _open_up(path.parent)
    return path


@pytest.fixture(scope="session")
def cpu_sif(cpu_image: BuiltImage, image_user: str) -> Path:
    """The CPU image as a SIF (``ctrain convert --to sif``), readable by ``image_user``."""
    need(shutil.which("apptainer") is not None, "apptainer")
    return _converted(cpu_image, "sif")


@pytest.fixture(scope="session")
def cpu_sqsh(cpu_image: BuiltImage) -> Path:
    """The CPU image as an enroot squashfs (``ctrain convert --to sqsh``)."""
    need(shutil.which("mksquashfs") is not None and shutil.which("umoci") is not None, "mksquashfs and umoci")
    return _converted(cpu_image, "sqsh")


# --- Apptainer definitions -------------------------------------------------------------------------

_SECTION = re.compile(r"^%(\w+)\s*$", re.M)
_TEMPLATE = re.compile(r"{{\s*(\w+)\s*}}")


def definition_sections(path: Path) -> dict[str, str]:
    """The %sections of an Apptainer definition, as dedented text keyed by name."""
    text = path.read_text()
    marks = list(_SECTION.finditer(text))
    return {
        m.group(1): textwrap.dedent(text[m.end(): marks[i + 1].start() if i + 1 < len(marks) else len(text)]).strip()
        for i, m in enumerate(marks)
    }


def render_definition(path: Path, args: dict[str, str]) -> str:
    """The definition with ``{{ VAR }}`` filled as ``apptainer build --build-arg`` does (``args``
    over the %arguments defaults); a variable with neither raises KeyError."""
    defaults = dict(
        line.strip().split("=", 1) for line in definition_sections(path).get("arguments", "").splitlines() if "=" in line
    )
    values = {**defaults, **args}
    return _TEMPLATE.sub(lambda m: values[m.group(1)], path.read_text())


# --- a real OCI registry and a private sshd, on loopback ---------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30, host: str = "127.0.0.1"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not listen on {host}:{port} within {timeout}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def oci_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's docker-registry (distribution) on a free loopback port, own config and storage;
    yields ``127.0.0.1:PORT`` and stops it afterwards."""
    binary = shutil.which("docker-registry") or shutil.which("registry")
    need(binary is not None, "docker-registry (apt-get install docker-registry)")
    assert binary is not None
    directory = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = directory / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {directory / 'storage'}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n"
    )
    with open(directory / "registry.log", "wb") as log:
        server = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, server, "docker-registry")
        yield f"127.0.0.1:{port}"
    finally:
        _stop(server)


@dataclass(frozen=True)
class SshServer:
    """A private sshd: ``user@127.0.0.1`` on ``port``; ``options`` are the ssh arguments to reach it."""

    user: str
    port: int
    options: tuple[str, ...]


@pytest.fixture(scope="session")
def ssh_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """sshd on a free loopback port with its own host key and one authorized client key (for root),
    nothing from the system's ssh configuration; stopped afterwards."""
    need_root()
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    need(Path(sshd).exists() and shutil.which("ssh-keygen") is not None, "openssh-server")
    directory = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / key)], check=True)
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())
    port = free_port()
    (directory / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {directory / 'host_key'}\nPidFile {directory / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {directory / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
    )
    host_key = (directory / "host_key.pub").read_text().split()
    (directory / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key[0]} {host_key[1]}\n")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    with open(directory / "sshd.log", "wb") as log:
        server = subprocess.Popen([sshd, "-D", "-e", "-f", str(directory / "sshd_config")], stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, server, "sshd")
        yield SshServer("root", port, ("-i", str(directory / "client_key"), "-o", "IdentitiesOnly=yes",
                                       "-o", f"UserKnownHostsFile={directory / 'known_hosts'}",
                                       "-o", "StrictHostKeyChecking=yes"))
    finally:
        _stop(server)


@pytest.fixture
def user_tmp() -> Iterator[Path]:
    """A fresh directory the unprivileged user can write (pytest's tmp_path is root-only), removed after."""
    ROOT.mkdir(parents=True, exist_ok=True)
    _open_up(ROOT)
    path = Path(tempfile.mkdtemp(prefix="tmp-", dir=ROOT))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tiny_sif(image_user: str, user_tmp: Path) -> Path:
    """A SIF of a directory with a shell (dash and the libraries it loads) and one file, built by the
    job user (milliseconds)."""
    root = user_tmp / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hello").write_text("hello\n")
    dash = Path(shutil.which("dash") or "/bin/dash").resolve()
    needed = re.findall(r"(/\S+)", subprocess.run(["ldd", dash], capture_output=True, text=True, check=True).stdout)
    for path in [dash, *map(Path, needed)]:
        (root / path.relative_to("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, root / path.relative_to("/"))
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy2(dash, root / "bin" / "sh")
    as_user(image_user, ["apptainer", "build", user_tmp / "tiny.sif", root])
    return user_tmp / "tiny.sif"
