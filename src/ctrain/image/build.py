"""``ctrain build``: build the training image from containers/Dockerfile (docker, podman, buildah)
or containers/ctrain-standalone.def (apptainer), streaming the builder's output with progress.

Auto-detection order: docker (only when its daemon answers), podman, buildah, apptainer: the
first three keep an OCI image that converts to both SIF and enroot squashfs and pushes to a
registry; apptainer makes a SIF directly, for machines that have nothing else.

Credentials in an index URL never become a build argument: :mod:`ctrain.image.secrets` passes them
as a netrc that exists only while the build runs and is mounted for the install step only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ctrain import proc, resources, ui
from ctrain.errors import CommandError, ConfigError, CtrainError
from ctrain.files import control_problem, make_dirs, remove_dirs, shorten, writable_dir_problem
from ctrain.image import secrets, store

BUILDERS = ("docker", "podman", "buildah", "apptainer")
DOCKERFILE = Path("containers/Dockerfile")
STANDALONE_DEF = Path("containers/ctrain-standalone.def")


@dataclass(frozen=True)
class BuildRequest:
    """What to build; paths are absolute."""

    context: Path  # the ctrain checkout: containers/ and src/ live here
    ref: str  # name:tag the image gets
    flavour: str = "gpu"
    base: str | None = None  # None: the Dockerfile's default (NGC PyTorch)
    wheelhouse: Path | None = None
    builder: str = "auto"
    sif_dir: Path | None = None  # where the apptainer builder writes its SIF
    no_cache: bool = False
    # cpu flavour: TORCH_INDEX_URL ("none": pip's configuration only); user:password@ in it is
    # passed as a build secret, never as the argument
    torch_index: str | None = None
    platform: str | None = None  # --platform: the cluster's (linux/amd64), when this machine is another


def available() -> list[str]:
    """Builders usable on this machine, in auto-detection order."""
    found = []
    for name in BUILDERS:
        usable = store.docker_daemon_up() if name == "docker" else proc.which(name) is not None
        if usable:
            found.append(name)
    return found


def choose(builder: str) -> str:
    """The builder to use: ``builder`` itself (checked), or the first available for ``auto``."""
    if builder == "auto":
        found = available()
        if not found:
            raise CtrainError(
                "no image builder found: install podman or buildah (apt-get install podman), Docker, or Apptainer"
            )
        return found[0]
    if builder not in BUILDERS:
        raise ConfigError(f"unknown builder '{builder}'; valid: auto, {', '.join(BUILDERS)}")
    if builder == "docker" and proc.which("docker") and not store.docker_daemon_up():
        raise CtrainError(
            "docker is installed but its daemon does not answer (docker version); start it or use --builder podman"
        )
    proc.require(builder)
    return builder


def check_context(context: Path, builder: str) -> None:
    recipe = STANDALONE_DEF if builder == "apptainer" else DOCKERFILE
    if not (context / recipe).is_file() or not (context / "src" / "ctrain").is_dir():
        raise CtrainError(
            f"{context} is not a ctrain checkout ({recipe} or src/ctrain missing): run ctrain build in the "
            "repository, or point --config at its ctrain.yaml"
        )


@contextlib.contextmanager
def source_context(context: Path) -> Iterator[Path]:
    """The directory the builder reads: ``context`` itself when it is a ctrain checkout (it has
    ``src/ctrain``); else, for an installed ctrain in a project from ``ctrain init``, a temporary
    one with the project's ``containers/`` (ctrain's own where it has none), the running ctrain's
    package source and its ``pyproject.toml``: an installed ctrain builds an image of itself."""
    if (context / "src" / "ctrain").is_dir():
        yield context
        return
    containers = context / "containers" if (context / "containers").is_dir() else resources.path("containers")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_data")
    with tempfile.TemporaryDirectory(prefix="ctrain-context-") as tmp:
        staged = Path(tmp)
        shutil.copytree(containers, staged / "containers", ignore=ignore)
        shutil.copy2(resources.pyproject(), staged / "pyproject.toml")
        shutil.copytree(resources.package_dir(), staged / "src" / "ctrain", ignore=ignore)
        yield staged


def check_wheelhouse(path: Path) -> None:
    if not path.is_dir():
        raise ConfigError(f"wheelhouse {path} is not a directory (make one with: ctrain wheelhouse {path})")
    if not any(p.suffix == ".whl" or p.name.endswith(".tar.gz") for p in path.iterdir()):
        raise ConfigError(f"wheelhouse {path} holds no wheels (fill it with: ctrain wheelhouse {path})")


def source_version(context: Path) -> str:
    """ctrain's version in the tree being built (not necessarily the one running)."""
    text = (context / "src" / "ctrain" / "__init__.py").read_text()
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    return match.group(1) if match else "unknown"


def git_commit(context: Path) -> str:
    """HEAD of the checkout, with ``-dirty`` when tracked files differ; ``unknown`` outside git."""
    if not proc.which("git"):
        return "unknown"
    head = proc.run(["git", "-C", context, "rev-parse", "HEAD"], check=False)
    if head.returncode != 0:
        return "unknown"
    dirty = proc.run(["git", "-C", context, "status", "--porcelain", "--untracked-files=no"], check=False)
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


class Progress:
    """Prefixes each builder line with the step it is on (docker, podman, buildah) and the elapsed
    time, so a long build shows where it is (``[build 5/16 01:23] ...``)."""

    _PATTERNS = (
        re.compile(r"\bSTEP (\d+/\d+):?\s*(.*)"),  # buildah, podman
        re.compile(r"^#\d+ \[(?:[\w.-]+ )?(\d+/\d+)\]\s*(.*)"),  # docker --progress=plain
    )

    def __init__(self, emit: Callable[[str], None] = ui.info, label: str = "build") -> None:
        self.label = label
        self.step = ""
        self.instruction = ""
        self.start = time.monotonic()
        self.emit = emit

    @property
    def where(self) -> str:
        """The step the build is on, for an error: ``step 6/17 (RUN ...)``; empty before the first."""
        if not self.step:
            return ""
        instruction = " ".join(self.instruction.split())
        return f"step {self.step}" + (f" ({instruction[:60]}...)" if len(instruction) > 60 else f" ({instruction})")

    def __call__(self, line: str) -> None:
        for pattern in self._PATTERNS:
            match = pattern.search(line)
            if match:
                self.step, self.instruction = match.group(1), match.group(2)
                break
        elapsed = int(time.monotonic() - self.start)
        step = f" {self.step}" if self.step else ""  # apptainer's INFO lines name their phase themselves
        self.emit(f"[{self.label}{step} {elapsed // 60:02d}:{elapsed % 60:02d}] {line}")


# What a value that reaches the build's recipe may hold. Apptainer pastes each --build-arg into the
# definition's text (TORCH_INDEX_URL into a double-quoted %post shell line, BASE into the From: header
# and a label), so a quote, $, `, \, ;, a space or a newline would end the value and run as shell or
# as definition; the Dockerfile's build arguments are held to the same rule.
ARG_CHARS = "letters, digits and - . _ ~ : / ? # [ ] @ % + = , &"
_SAFE_ARG = re.compile(r"[A-Za-z0-9._~:/?#\[\]@%+=,&-]*")
# Where each build argument's value comes from, for the error that refuses one.
_ARG_SOURCES = {
    "FLAVOUR": "image.flavour (--flavour)",
    "BASE_IMAGE": "image.base (--base)",
    "BASE": "image.base (--base)",
    "BOOTSTRAP": "the scheme of image.base (--base)",
    "TORCH_INDEX_URL": "image.torch_index",
    "CTRAIN_VERSION": "__version__ in src/ctrain/__init__.py of the build context",
    "GIT_COMMIT": "the build context's git commit",
}


def _unsafe(value: str) -> str | None:
    """The first character of ``value`` that may not reach the definition, or None."""
    return next((char for char in value if not _SAFE_ARG.fullmatch(char)), None)


def check_value(what: str, value: str) -> None:
    """A ConfigError naming ``what`` unless ``value`` can go into the image's definition as text."""
    bad = _unsafe(value)
    if bad is not None:
        raise ConfigError(
            f"{what} {shorten(value, 120)!r} contains {bad!r}: a value the image's build definition holds may have "
            f"{ARG_CHARS} only (quotes, $, `, \\, ;, spaces would run as shell during the build); percent-encode a "
            "URL's other characters, or move a file to a path without them"
        )


def check_torch_index(url: str, setting: str = "image.torch_index") -> str:
    """``url`` without credentials, checked: ``none``, or an http(s) URL of :data:`ARG_CHARS` only,
    since Apptainer writes it into a shell line of the definition (``ctrain build``)."""
    if url == "none":
        return url
    clean = secrets.split_url(url, setting)[0]
    bad = _unsafe(clean)
    if bad is not None:
        raise ConfigError(
            f"{setting} {shorten(clean, 120)!r} contains {bad!r}: give an http(s) URL of {ARG_CHARS} only "
            "(percent-encode anything else), or none; Apptainer writes it into a shell line of the build definition"
        )
    try:
        parts = urlsplit(clean)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # a malformed [IPv6] host or port
        usable = False
    if not usable:
        raise ConfigError(
            f"{setting} {shorten(clean, 120)!r} is not an index URL: give http(s)://HOST/PATH (the default is "
            "https://download.pytorch.org/whl/cpu), or none for pip's own configuration"
        )
    return clean


def build_args(req: BuildRequest) -> tuple[dict[str, str], list[secrets.Credential]]:
    """The builder's build arguments (index URLs without credentials), and the credentials; each
    value checked (:func:`check_value`) before a builder pastes it into the recipe."""
    if req.torch_index:
        check_torch_index(req.torch_index)
    indexes, credentials = secrets.split_urls({"image.torch_index": req.torch_index})
    args = {
        "FLAVOUR": req.flavour,
        "CTRAIN_VERSION": source_version(req.context),
        "GIT_COMMIT": git_commit(req.context),
    }
    if req.base:
        args["BASE_IMAGE"] = req.base
    if indexes["image.torch_index"]:
        args["TORCH_INDEX_URL"] = indexes["image.torch_index"]
    for key, value in args.items():
        check_value(_ARG_SOURCES.get(key, key), value)
    return args, credentials


def _oci_command(
    builder: str, req: BuildRequest, iidfile: Path, args: dict[str, str], netrc: Path | None = None
) -> list[str]:
    cmd = [builder]
    if builder == "docker":
        cmd += ["build", "--progress=plain"]
    elif builder == "podman":
        cmd += ["build", "--layers"]
    else:
        cmd += ["bud", "--layers"]
    if builder in ("podman", "buildah"):
        # The default OCI isolation needs a full container runtime; chroot isolation builds in
        # unprivileged and nested environments too. BUILDAH_ISOLATION set by the user wins.
        if not os.environ.get("BUILDAH_ISOLATION"):
            cmd += ["--isolation", "chroot"]
        # --force-rm (podman's default, not buildah's): a failed build, and the empty wheelhouse
        # stage, leave no working container behind in the shared store
        cmd += ["--network", "host", "--force-rm"]
    if req.no_cache:
        cmd.append("--no-cache")
    if req.platform:
        cmd += ["--platform", req.platform]
    cmd += ["-f", str(req.context / DOCKERFILE), "-t", req.ref, "--iidfile", str(iidfile)]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    if req.wheelhouse:
        cmd += ["--build-context", f"wheelhouse={req.wheelhouse}"]
    if netrc:
        # the Dockerfile mounts it for the install step only (RUN --mount=type=secret)
        cmd += ["--secret", f"id={secrets.SECRET_ID},src={netrc}"]
    return [*cmd, str(req.context)]


def build(req: BuildRequest, *, emit: Callable[[str], None] = ui.info) -> store.Image:
    """Build the image; returns where it is, with its ID and (where the store has one) digest."""
    project = req.context
    if not (project / "src" / "ctrain").is_dir() and (project / "containers").is_dir():
        # A project's own containers/ is what gets built: one without the builder's recipe is named
        # here, not as the temporary directory that source_context stages it into.
        recipe = STANDALONE_DEF if choose(req.builder) == "apptainer" else DOCKERFILE
        if not (project / recipe).is_file():
            raise CtrainError(
                f"{project / recipe} is missing: the project's containers/ is what ctrain build builds; restore "
                "it with ctrain init --force (which rewrites sbatch/ and containers/ from this ctrain), or write your own"
            )
    with source_context(req.context) as context:
        return _build(replace(req, context=context), emit=emit)


def _build(req: BuildRequest, *, emit: Callable[[str], None]) -> store.Image:
    builder = choose(req.builder)
    check_context(req.context, builder)
    if req.wheelhouse:
        check_wheelhouse(req.wheelhouse)
    args, credentials = build_args(req)
    emit(
        f"build: {builder}, flavour {req.flavour}, base {req.base or '(Dockerfile default)'}"
        + (f", wheelhouse {req.wheelhouse} (no network)" if req.wheelhouse else "")
        + (", index credentials as a build secret (not in the image)" if credentials else "")
    )
    with secrets.netrc_file(credentials) as netrc:
        if builder == "apptainer":
            return _build_sif(req, args, emit, netrc)
        before = _leftovers(builder)
        progress = Progress(emit)
        with tempfile.TemporaryDirectory(prefix="ctrain-build-") as tmp:
            iidfile = Path(tmp) / "iid"
            try:
                proc.stream(_oci_command(builder, req, iidfile, args, netrc), on_line=progress, cwd=req.context)
            except CommandError as exc:
                _clean_up(builder, before)
                raise explain_failure(exc, req, progress.where) from None
            except BaseException:
                _clean_up(builder, before, containers=True)
                raise
            image_id = store.normalise_id(iidfile.read_text())
    _clean_up(builder, before, failed=False)
    image = store.inspect(req.ref, "docker" if builder == "docker" else "containers")
    if image is None or image.id != image_id:
        raise CtrainError(f"{builder} reported image {image_id}, but {req.ref} does not resolve to it")
    return image


@dataclass(frozen=True)
class _Leftovers:
    """Build containers and images in containers-storage (podman, buildah) at one moment."""

    containers: frozenset[str]
    images: frozenset[str]
    nameless: frozenset[str]


def _leftovers(builder: str) -> _Leftovers | None:
    """What a failed build could leave behind, listed before it starts so that only what it made is
    taken away afterwards. Docker's BuildKit keeps nothing of a failed build: None."""
    if builder == "buildah":
        containers = proc.run(["buildah", "containers", "--quiet", "--notruncate"], check=False)
        images = proc.run(["buildah", "images", "--all", "--json", "--no-trunc"], check=False)
        listed = _json_list(images.stdout) if images.returncode == 0 else None
        if containers.returncode != 0 or listed is None:
            return None  # nothing known, so nothing will be removed
        return _Leftovers(_ids(containers.stdout.split()), _all(listed, "id"), _nameless(listed, "id", "names"))
    if builder == "podman":
        ps = proc.run(["podman", "ps", "--all", "--external", "--format", "json"], check=False)
        images = proc.run(["podman", "images", "--all", "--format", "json"], check=False)
        entries = _json_list(ps.stdout) if ps.returncode == 0 else None
        listed = _json_list(images.stdout) if images.returncode == 0 else None
        if entries is None or listed is None:
            return None
        found = _ids(e.get("Id", "") for e in entries if str(e.get("State", "")).lower() == "storage")
        return _Leftovers(found, _all(listed, "Id"), _nameless(listed, "Id", "Names"))
    return None


def _json_list(text: str) -> list[dict[str, Any]] | None:
    """A JSON list of objects, or None when ``text`` is not one."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        return None
    return [entry for entry in data if isinstance(entry, dict)] if isinstance(data, list) else None


def _ids(values: Any) -> frozenset[str]:
    return frozenset(str(v).removeprefix("sha256:") for v in values if v)


def _all(listed: list[dict[str, Any]], key: str) -> frozenset[str]:
    return _ids(entry.get(key) for entry in listed)


def _nameless(listed: list[dict[str, Any]], key: str, names: str) -> frozenset[str]:
    return _ids(entry.get(key) for entry in listed if not entry.get(names))


def _dangling(builder: str) -> frozenset[str] | None:
    """Nameless images nothing builds on: the stage images a build leaves (``FROM scratch AS
    wheelhouse`` makes a new one each time)."""
    args = ["images", "--all", "--filter", "dangling=true"]
    result = proc.run([builder, *args, "--json", "--no-trunc"] if builder == "buildah" else
                      [builder, *args, "--format", "json"], check=False)  # fmt: skip
    listed = _json_list(result.stdout) if result.returncode == 0 else None
    return None if listed is None else _ids(entry.get("id") or entry.get("Id") for entry in listed)


def _clean_up(builder: str, before: _Leftovers | None, *, containers: bool = False, failed: bool = True) -> None:
    """Remove the nameless images that appeared since ``before``: after a failure all of them (the
    failed build's intermediate images), after a success the dangling ones (its stage images; the
    intermediate images under the new image are its cache). With ``containers`` also the build
    containers. Never what was there already: an image the new one took the tag from stays, as
    builders leave it.

    A failed build's containers are the builder's own to remove (``--force-rm``), which it does
    exactly; ctrain removes containers only after an interruption, when the builder may not have.
    A second build running at the same moment in the same store could lose intermediate images it
    has finished with (its cache); those its containers use stay, as rmi refuses them.
    """
    if before is None:
        return
    after = _leftovers(builder)
    if after is None:
        return
    made = sorted(after.containers - before.containers)
    if containers and made:
        proc.run([builder, "rm", *made], check=False)
    images = after.nameless - before.images
    if not failed:
        images &= _dangling(builder) or frozenset()
    if images:
        proc.run([builder, "rmi", *sorted(images)], check=False)


# What builders print when the base image cannot be pulled (buildah/podman, docker BuildKit).
_PULL_FAILED = re.compile(
    r"creating build container: (.*)|failed to resolve source metadata for (.*)|pull access denied(.*)|"
    r"conveyor failed to get: (.*)|(repository .* not found.*)",
    re.IGNORECASE,
)


def explain_failure(exc: CommandError, req: BuildRequest, where: str) -> CtrainError:
    """A failed build as one line that says what failed and what to do (the builder's own output
    is already on the screen above)."""
    base = req.base or "the Dockerfile's default base (nvcr.io/nvidia/pytorch)"
    if "no space left on device" in exc.stderr.lower():
        return CtrainError(
            "the build ran out of disk space (the image store: /var/lib/containers for podman and buildah, "
            "/var/lib/docker for Docker, the temporary directory for Apptainer): free space there, e.g. remove "
            "old images (podman image prune), and build again"
        )
    for line in reversed(exc.stderr.splitlines()):
        match = _PULL_FAILED.search(line)
        if match:
            why = next(g for g in match.groups() if g is not None).strip() or line.strip()
            return CtrainError(
                f"the base image {base} could not be pulled ({why[-200:]}): check its name and tag, log in if "
                "the registry needs it (podman login HOST), or build from a reachable registry's base (--base "
                "REF), or from a local one: --local-base (cpu flavour, no registry)"
            )
    lines = [line.strip() for line in exc.stderr.splitlines() if line.strip()] or [f"exit {exc.returncode}"]
    # buildah and podman end with "Error: building at STEP ...": the line before it says why.
    cause = lines[-2] if len(lines) > 1 and lines[-1].startswith("Error: building at STEP") else lines[-1]
    at = f" at {where}" if where else ""
    return CtrainError(
        f"the build failed{at}: {cause[-300:]}; the builder's output is above. If the base image is the cause, "
        "choose another with --base (the cpu flavour needs python3 >= 3.10 with venv) or use --local-base"
    )


def sif_path(sif_dir: Path, ref: str) -> Path:
    """Where the apptainer builder puts ``name:tag`` (``images/name-tag.sif``)."""
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    return sif_dir / f"{name.rsplit('/', 1)[-1]}-{tag}.sif"


def apptainer_command(
    req: BuildRequest, args: dict[str, str], output: Path, netrc: Path | None = None
) -> list[str]:
    """``apptainer build`` of the standalone definition; ``--base scheme://ref`` picks the bootstrap
    agent (``docker://`` when no scheme; ``oci://DIR`` for a local OCI layout). ``netrc``'s
    directory (holding nothing else) is bound read-only where Docker builds mount secrets: binds
    last only while a section runs and are not recorded in the SIF."""
    def_args = {k: v for k, v in args.items() if k != "BASE_IMAGE"}
    if req.base:
        bootstrap, _, source = req.base.partition("://") if "://" in req.base else ("docker", "", req.base)
        def_args |= {"BOOTSTRAP": bootstrap, "BASE": source}
    cmd = ["apptainer", "build", "--force"]
    if os.geteuid() == 0:
        cmd.append("--notest")  # Apptainer may refuse to start the %test container as root (convert.py)
    for key, value in def_args.items():
        check_value(_ARG_SOURCES.get(key, key), value)
        cmd += ["--build-arg", f"{key}={value}"]
    if req.wheelhouse:
        shown = str(req.wheelhouse)
        if any(char in shown for char in ":,") or control_problem(shown):
            raise ConfigError(f"wheelhouse {shown!r}: Apptainer's --bind cannot take a path with ':', ',' or a "
                              "control character; move the wheelhouse to a path without them")  # fmt: skip
        cmd += ["--bind", f"{req.wheelhouse}:/wheelhouse"]
    if netrc:
        cmd += ["--bind", f"{netrc.parent}:{secrets.MOUNT_DIR}:ro"]
    return [*cmd, str(output), str(STANDALONE_DEF)]


def _build_sif(
    req: BuildRequest, args: dict[str, str], emit: Callable[[str], None], netrc: Path | None = None
) -> store.Image:
    """Apptainer builds the standalone definition straight into a SIF (atomically)."""
    if req.sif_dir is None:
        raise ValueError("sif_dir is needed for the apptainer builder")
    final = sif_path(req.sif_dir, req.ref)
    fix = "set convert.output_dir in ctrain.yaml to a directory you can write (the SIF goes there)"
    made = make_dirs(final.parent, fix)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    progress = Progress(emit)
    try:
        problem = writable_dir_problem(final.parent)
        if problem:
            raise CtrainError(f"cannot write the SIF: {problem}: {fix}")
        try:
            run_apptainer(apptainer_command(req, args, tmp, netrc), on_line=progress, cwd=req.context)
        except CommandError as exc:
            raise explain_failure(exc, req, progress.where) from None
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        remove_dirs(made)
        raise
    return store.Image(str(final), "sha256:" + sha256_file(final), "sif", None, final)


_ROOT_CAPABILITIES = re.compile(r"Requesting capability set .* while permitted capability set is")


def run_apptainer(cmd: list[str], **kwargs: Any) -> None:
    """``proc.stream`` an Apptainer build, explaining the one failure users cannot decode: Apptainer
    started as root asks for every capability, and inside containers or sandboxes root may lack one."""
    try:
        proc.stream(cmd, **kwargs)
    except CommandError as exc:
        if os.geteuid() == 0 and _ROOT_CAPABILITIES.search(exc.stderr):
            raise CtrainError(
                "Apptainer, run as root here, may not start containers (root lacks a capability Apptainer "
                "asks for, as in many containers and sandboxes): run this as a normal user, or set "
                "`root default capabilities = no` in apptainer.conf\n" + str(exc)
            ) from exc
        raise


def sha256_file(path: Path, chunk: int = 4 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
