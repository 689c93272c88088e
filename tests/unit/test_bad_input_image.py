"""Bad input to build, convert, push and submit's image handling: each mistake ends in one
``error:`` line that names the problem and the fix, quickly, with nothing left behind
(tests/badinput.py states the contract). These cases stop before any image tool is needed; those
that need buildah, skopeo or a full disk with a real image are in tests/integration.

Also here: the rule that tells an image file from a registry reference, stated in Python
(ctrain.jobs.submit.image_is_file, ctrain.image.reference.enroot) and in bash (ctrain_image_is_file,
ctrain_enroot_image in sbatch/lib/ctrain.sh), checked to agree on one table.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import shlex
from pathlib import Path

import pytest

from ctrain.config import load_config
from ctrain.errors import ConfigError, CtrainError
from ctrain.image import convert, reference, store
from ctrain.jobs import submit as submit_mod
from ctrain.jobs.submit import image_is_file, prepare
from tests.badinput import Case, run_case
from tests.conftest import need

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "sbatch" / "lib" / "ctrain.sh"
SIF_HEAD = b"#!/usr/bin/env run-singularity\n\0SIF_MAGIC0\x01" + b"\0" * 64
SQSH_HEAD = b"hsqs" + b"\0" * 64
DIGEST = "sha256:" + "ab" * 32


def files(**content: bytes | str | None) -> object:
    """A setup writing files (None: a directory), names relative to the case's directory ('__' is '/')."""

    def setup(root: Path) -> None:
        for name, data in content.items():
            path = root / name.replace("__", "/")
            if data is None:
                path.mkdir(parents=True, exist_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


def project(yaml: str = "", **content: bytes | str | None) -> object:
    """A project: ctrain.yaml (building from this checkout) plus ``content``."""
    config = f"image:\n  context: {REPO}\n  builder: buildah\n{yaml}"
    return files(**{"ctrain.yaml": config, **content})


PYXIS = "slurm:\n  runtime: pyxis\n"
APPTAINER = "slurm:\n  runtime: apptainer\n"


def submit(*args: str) -> list[str]:
    return ["submit", "--dry-run", *args, "recipes/demo-addition.yaml"]


def queue(*args: str) -> list[str]:
    """A submit that would queue (the script written instead): a dry run only warns of a missing image."""
    return ["submit", "--write-script", "job.sbatch", *args, "recipes/demo-addition.yaml"]


CASES = [
    # --- build: names and bases checked before any builder starts --------------------------------
    Case("build-tag-space", ["build", "--tag", "my tag"], ["--tag", "space", "ctrain:cpu"], project()),
    Case("build-tag-uppercase", ["build", "--tag", "Ctrain:1"], ["'Ctrain'", "lowercase"], project()),
    Case("build-tag-bad-tag", ["build", "--tag", "ctrain:-1"], ["tag '-1'", "128"], project()),
    Case("build-tag-digest", ["build", "--tag", f"ctrain@{DIGEST}"], ["digest", "does not belong"], project()),
    Case("build-tag-empty-tag", ["build", "--tag", "ghcr.io/team/ctrain:"], ["no tag after"], project()),
    Case("build-base-uppercase", ["build", "--flavour", "cpu", "--base", "Ubuntu:22.04"],
         ["--base", "lowercase", "python:3.11-slim-bookworm"], project()),  # fmt: skip
    Case("build-base-scheme", ["build", "--flavour", "cpu", "--base", "https://ghcr.io/team/base:1"],
         ["--base", "drop https://"], project()),  # fmt: skip
    Case("build-base-double-colon", ["build", "--flavour", "cpu", "--base", "ubuntu::22.04"],
         ["--base", "ubuntu:"], project()),  # fmt: skip
    Case("build-base-bad-port", ["build", "--flavour", "cpu", "--base", "registry:99999/base:1"],
         ["port", "1-65535"], project()),  # fmt: skip
    Case("build-config-name", ["build"], ["image.name", "lowercase"],
         files(**{"ctrain.yaml": f"image:\n  context: {REPO}\n  name: My-Image\n"}), exit_code=2),  # fmt: skip
    Case("build-config-tag", ["build"], ["image.tag", "128 letters"],
         files(**{"ctrain.yaml": f"image:\n  context: {REPO}\n  tag: .hidden\n"}), exit_code=2),  # fmt: skip
    Case("build-wheelhouse-is-a-file", ["build", "--wheelhouse", "wheels.txt"], ["--wheelhouse", "--help"],
         project(**{"wheels.txt": "x"})),  # fmt: skip
    Case("build-local-base-and-base", ["build", "--local-base", "--base", "debian:12"], ["drop --base"], project()),
    # --- convert: the output checked before the image is looked up --------------------------------
    Case("convert-suffix-mismatch", ["convert", "--to", "sif", "-o", "out/ctrain.sqsh"],
         ["--to sqsh", "name the output .sif"], project()),  # fmt: skip
    Case("convert-squashfs-suffix", ["convert", "--to", "sif", "-o", "ctrain.squashfs"], ["--to sqsh"], project()),
    Case("convert-output-is-a-dir", ["convert", "-o", "images"], ["directory", "--help"], project(images=None)),
    Case("convert-unknown-format", ["convert", "--to", "tar"], ["'tar' is not one of"], project()),
    Case("convert-unknown-compression", ["convert", "--compression", "brotli"], ["--compression"], project()),
    Case("convert-bad-image-ref", ["convert", "--image", "My Image"], ["--image", "space"], project()),
    Case("convert-read-only-dir", ["convert", "--to", "sqsh", "-o", "ro/ctrain.sqsh"], ["not writable", "-o/--output"],
         project(ro=None), read_only=["ro"]),  # fmt: skip
    Case("convert-read-only-parent", ["convert", "--to", "sif", "-o", "ro/new/deeper/ctrain.sif"],
         ["not writable", "-o/--output"], project(ro=None), read_only=["ro"]),  # fmt: skip
    Case("convert-over-a-recipe", ["convert", "--to", "sif", "-o", "recipes/r.yaml"], ["no container image", "kept"],
         project(**{"recipes__r.yaml": "x: 1\n"})),  # fmt: skip
    Case("convert-output-newline", ["convert", "--to", "sif", "-o", "a\nb.sif"], ["control character"], project()),
    # --- build: values the definition holds as text (a docker daemon that never answers: no build) --
    Case("build-torch-index-shell", ["build"], ["image.torch_index", "'$'", "http(s) URL"],
         files(**{"ctrain.yaml": f"image:\n  context: {REPO}\n  builder: docker\n  torch_index: "
                  "'https://x.example/$(touch pwned)'\n"}), env={"DOCKER_HOST": "unix:///nonexistent.sock"}),
    Case("build-base-quote", ["build", "--builder", "docker", "--flavour", "cpu", "--base", 'oci:/tmp/a"b'],
         ["image.base (--base)", "'\"'"], project(), env={"DOCKER_HOST": "unix:///nonexistent.sock"}),
    # --- cache clear: a directory that is no image cache is refused, nothing removed --------------
    Case("cache-clear-project-dir", ["cache", "clear", "--dir", "."], ["not an image cache", "nothing was removed"],
         project(recipes__r=None, configs__c=None)),  # fmt: skip
    Case("cache-clear-env-project-dir", ["cache", "clear"], ["not an image cache", "nothing was removed"],
         project(recipes__r=None), env={"CTRAIN_IMAGE_CACHE": "."}),  # fmt: skip
    # --- push: every destination checked before anything is converted or sent --------------------
    Case("push-registry-scheme", ["push", "--registry", "https://ghcr.io/team"], ["drop https://", "ghcr.io/team"],
         project()),  # fmt: skip
    Case("push-registry-uppercase", ["push", "--registry", "ghcr.io/MyTeam"], ["lowercase", "HOST[:PORT]"], project()),
    Case("push-registry-tag", ["push", "--registry", "ghcr.io/team:latest"], ["tag", "--image"], project()),
    Case("push-registry-digest", ["push", "--registry", f"ghcr.io/team@{DIGEST}"], ["tag or digest"], project()),
    Case("push-registry-bad-port", ["push", "--registry", "ghcr.io:https/team"], ["not a registry host"], project()),
    Case("push-registry-empty-component", ["push", "--registry", "ghcr.io//team"], ["empty path component"],
         project()),  # fmt: skip
    Case("push-registry-credentials", ["push", "--registry", "alice:s3cret@ghcr.io/team"], ["credentials", "login"],
         project(), never_says=["s3cret"]),  # fmt: skip
    Case("push-registry-from-config", ["push"], ["registry", "lowercase"],
         project("push:\n  registry: ghcr.io/Team\n")),  # fmt: skip
    Case("push-oras-no-scheme", ["push", "--oras", "ghcr.io/team/ctrain:sif"], ["oras://ghcr.io/team/ctrain:sif"],
         project()),  # fmt: skip
    Case("push-oras-uppercase", ["push", "--oras", "oras://ghcr.io/team/Ctrain:sif"], ["lowercase"], project()),
    Case("push-oras-no-host", ["push", "--oras", "oras://ctrain:sif"], ["no registry host", "oras://HOST/NAME:TAG"],
         project()),  # fmt: skip
    Case("push-oras-credentials", ["push", "--oras", "oras://bob:hunter2@ghcr.io/team/c:1"], ["credentials"],
         project(), never_says=["hunter2"]),  # fmt: skip
    Case("push-remote-no-path", ["push", "--remote", "login.cluster:"], ["path after the colon"], project()),
    Case("push-remote-bad-port", ["push", "--remote", "ssh://login:70000/images/"], ["port number"], project()),
    Case("push-remote-ssh-no-path", ["push", "--remote", "ssh://login"], ["ssh://[USER@]HOST[:PORT]/PATH"], project()),
    Case("push-remote-bad-host", ["push", "--remote", "login node:/images/"], ["not a host name"], project()),
    Case("push-remote-scheme", ["push", "--remote", "s3://bucket/images/"], ["s3:// is not supported"], project()),
    Case("push-remote-password", ["push", "--remote", "alice:pa55@login:/images/"], ["password", "ssh keys"],
         project(), never_says=["pa55"]),  # fmt: skip
    Case("push-remote-missing-dir", ["push", "--remote", "shared/images/"], ["does not exist", "mkdir -p"],
         project()),  # fmt: skip
    Case("push-remote-read-only", ["push", "--remote", "ro/"], ["not writable"], project(ro=None), read_only=["ro"]),
    Case("push-remote-full-disk", ["push", "--remote", "full/", "--file", "big.sqsh"], ["not enough free space"],
         project(full=None, **{"big.sqsh": SQSH_HEAD + bytes(2 << 20)}), full_disk=["full"]),  # fmt: skip
    Case("push-file-missing", ["push", "--remote", "out/", "--file", "images/none.sif"], ["--file", "does not exist"],
         project(out=None)),  # fmt: skip
    Case("push-file-not-an-image", ["push", "--remote", "out/", "--file", "notes.sif"], ["neither a SIF nor"],
         project(out=None, **{"notes.sif": "not an image"})),  # fmt: skip
    Case("push-bad-image-ref", ["push", "--image", "Ctrain", "--registry", "ghcr.io/team"], ["--image", "lowercase"],
         project()),  # fmt: skip
    Case("push-nowhere", ["push"], ["nowhere to push"], project()),
    Case("push-over-a-recipe", ["push", "--file", "c.sif", "--remote", "recipes/r.yaml"],
         ["no container image", "is kept", "--remote"], project(**{"c.sif": SIF_HEAD, "recipes__r.yaml": "x: 1\n"})),
    Case("push-remote-dash-path", ["push", "--file", "c.sif", "--remote", "login:-oProxyCommand=x/"],
         ["starts with '-'"], project(**{"c.sif": SIF_HEAD})),  # fmt: skip
    Case("wheelhouse-read-only", ["wheelhouse", "ro/wheels"], ["cannot fill the wheelhouse", "not writable"],
         project(ro=None), read_only=["ro"]),  # fmt: skip
    # --- submit: the image, before anything is queued --------------------------------------------
    # A dry run only warns of a missing image (a new project has none yet); a job is refused.
    Case("submit-missing-file", queue("--image", "images/ctrain.sqsh"), ["does not exist", "ctrain convert --to sqsh"],
         project(PYXIS)),  # fmt: skip
    Case("submit-image-is-a-dir", submit("--image", "images"), ["is a directory", "ctrain.sqsh"],
         project(PYXIS, **{"images__ctrain.sqsh": SQSH_HEAD})),  # fmt: skip
    Case("submit-apptainer-plain-dir", submit("--image", "./images"), ["is a directory"],
         project(APPTAINER, images=None)),  # fmt: skip
    Case("submit-sif-to-pyxis", submit("--image", "images/c.sif"), ["pyxis needs an enroot squashfs", "--to sqsh"],
         project(PYXIS, **{"images__c.sif": SIF_HEAD})),  # fmt: skip
    Case("submit-sqsh-to-apptainer", submit("--image", "images/c.sqsh"), ["Apptainer needs a SIF", "--to sif"],
         project(APPTAINER, **{"images__c.sqsh": SQSH_HEAD})),  # fmt: skip
    Case("submit-not-an-image", submit("--image", "images/notes.txt"), ["not a container image"],
         project(APPTAINER, **{"images__notes.txt": "hello"})),  # fmt: skip
    Case("submit-empty-image", submit("--image", "images/c.sqsh"), ["empty file"],
         project(PYXIS, **{"images__c.sqsh": b""})),  # fmt: skip
    Case("submit-dangling-symlink", queue("--image", "images/c.sqsh"), ["symbolic link to nothing"],
         lambda root: (project(PYXIS, images=None)(root), (root / "images/c.sqsh").symlink_to(root / "gone.sqsh"))),
    Case("submit-fifo", submit("--image", "images/c.sqsh"), ["not a regular file"],
         lambda root: (project(PYXIS, images=None)(root), os.mkfifo(root / "images/c.sqsh"))),
    Case("submit-typo-in-path", submit("--image", "images/ctrain.sqs"),
         ["does not exist", "docker.io/images/ctrain.sqs"], project(PYXIS, **{"images__ctrain.sqsh": SQSH_HEAD})),
    Case("submit-config-image-missing", submit(), ["does not exist"],
         project(PYXIS + "  image: images/missing.sqsh\n")),  # fmt: skip
    # --- the pyxis reference rule: references checked, only Docker's kind ------------------------
    Case("pyxis-ref-uppercase", submit("--image", "nvcr.io/NVIDIA/pytorch:24.10-py3"), ["'NVIDIA'", "lowercase"],
         project(PYXIS)),  # fmt: skip
    Case("pyxis-ref-bad-tag", submit("--image", "nvcr.io/nvidia/pytorch:24.10 py3"), ["space"], project(PYXIS)),
    Case("pyxis-ref-oras", submit("--image", "oras://ghcr.io/team/ctrain:sif"), ["Docker registries only"],
         project(PYXIS)),  # fmt: skip
    Case("pyxis-ref-enroot-bad-registry", submit("--image", "nvcr io#nvidia/pytorch:1"), ["not a registry host"],
         project(PYXIS)),  # fmt: skip
    Case("pyxis-ref-enroot-two-registries", submit("--image", "nvcr.io#ghcr.io/x:1"), ["two registries"],
         project(PYXIS)),  # fmt: skip
    Case("apptainer-ref-without-scheme", submit("--image", "nvcr.io/nvidia/pytorch:24.10-py3"),
         ["docker://nvcr.io/nvidia/pytorch:24.10-py3", "ctrain convert --to sif"], project(APPTAINER)),  # fmt: skip
    Case("apptainer-docker-uri-bad", submit("--image", "docker://ghcr.io/Team/c:1"), ["lowercase"],
         project(APPTAINER)),  # fmt: skip
    Case("pyxis-env-image-bad", submit(), ["lowercase"], project(PYXIS), env={"IMAGE": "nvcr.io/nvidia/PyTorch:1"}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: Case, tmp_path: Path) -> None:
    if case.read_only or case.full_disk:
        need(os.geteuid() == 0 and shutil.which("unshare") is not None, "root and unshare (read-only mounts)")
    run_case(case, tmp_path / "project")


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


def test_unreadable_image(tmp_path: Path) -> None:
    """Root reads everything, so the image that cannot be read is checked without root's override."""
    need(os.geteuid() == 0 and shutil.which("setpriv") is not None, "root and setpriv")

    def setup(root: Path) -> None:
        project(PYXIS, **{"images__c.sqsh": SQSH_HEAD})(root)
        (root / "images/c.sqsh").chmod(0)

    case = Case("submit-unreadable", submit("--image", "images/c.sqsh"), ["cannot be read", "chmod a+r"], setup,
                respect_modes=True)  # fmt: skip
    run_case(case, tmp_path / "project")


# --- things the subprocess cases cannot reach ---------------------------------------------------


def test_a_full_disk_mid_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the disk fills after the space check passed (an image larger than the store said), the
    error says so, and neither the lock, the temporary files nor the directories made stay."""
    image = store.Image("localhost/c:1", "sha256:" + "0" * 64, "containers", size=1)
    monkeypatch.setattr(convert, "_check_tools", lambda image, to, context: None)

    def fill_up(image: store.Image, layout: Path, tag: str) -> None:
        layout.mkdir()
        (layout / "blob").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "export_oci", fill_up)
    with pytest.raises(CtrainError, match="ran out of space in .* -o/--output"):
        convert.convert(image, "sqsh", tmp_path / "new" / "deeper" / "c.sqsh", context=REPO)
    assert list(tmp_path.iterdir()) == []


def test_a_tool_failing_with_a_full_disk_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ctrain.errors import CommandError

    image = store.Image("localhost/c:1", "sha256:" + "0" * 64, "containers", size=1)
    monkeypatch.setattr(convert, "_check_tools", lambda image, to, context: None)

    def skopeo_fails(*args: object) -> None:
        raise CommandError(["skopeo", "copy"], 1, "writing blob: write /x: no space left on device")

    monkeypatch.setattr(convert, "_write", skopeo_fails)
    (tmp_path / "images").mkdir()
    with pytest.raises(CtrainError, match="ran out of space"):
        convert.convert(image, "sqsh", tmp_path / "images" / "c.sqsh", context=REPO)
    assert list((tmp_path / "images").iterdir()) == []


def test_space_is_checked_against_the_image_size(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    huge = store.Image("localhost/c:1", "sha256:" + "0" * 64, "containers", size=free)
    assert convert.space_needed(huge) == free * convert.SPACE_FACTOR + convert.SPACE_MARGIN
    with pytest.raises(CtrainError, match=r"not enough free space .* needed .* free"):
        convert._check_space(huge, tmp_path / "c.sqsh", "sqsh")


def test_a_successful_conversion_leaves_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = store.Image("localhost/c:1", "sha256:" + "0" * 64, "containers", size=1)
    monkeypatch.setattr(convert, "_check_tools", lambda image, to, context: None)
    monkeypatch.setattr(convert, "_write", lambda image, to, output, *args: output.write_bytes(SQSH_HEAD))
    convert.convert(image, "sqsh", tmp_path / "c.sqsh", context=REPO)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.sqsh"]


def test_write_script_checks_where_it_writes(tmp_path: Path) -> None:
    (tmp_path / "ctrain.yaml").write_text("slurm:\n  runtime: pyxis\n  image: nvcr.io/nvidia/pytorch:24.10-py3\n")
    job = prepare(load_config(tmp_path / "ctrain.yaml"))
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(CtrainError, match="notes.txt is not a directory"):
        submit_mod.write_script(job, tmp_path / "notes.txt" / "job.sbatch")
    with pytest.raises(CtrainError, match="is a directory: give a file name"):
        submit_mod.write_script(job, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctrain.yaml", "notes.txt"]


# --- the file-or-reference rule, once in Python and once in bash ---------------------------------

# (image setting, is it a file, pyxis's spelling when it is a reference)
RULE = [
    ("images/ctrain-latest.sqsh", True, None),
    ("ctrain.sqsh", True, None),
    ("ctrain.sif", True, None),
    ("out/ctrain.squashfs", True, None),
    ("/shared/images/ctrain.sqsh", True, None),
    ("./ctrain", True, None),
    ("../images/ctrain", True, None),
    ("~/images/ctrain.sqsh", True, None),
    ("existing-file", True, None),  # made in the project directory by the test
    ("existing-dir/sub", True, None),  # likewise
    ("nvcr.io/nvidia/pytorch:24.10-py3", False, "nvcr.io#nvidia/pytorch:24.10-py3"),
    ("nvcr.io#nvidia/pytorch:24.10-py3", False, "nvcr.io#nvidia/pytorch:24.10-py3"),
    ("docker://nvcr.io/nvidia/pytorch:24.10-py3", False, "nvcr.io#nvidia/pytorch:24.10-py3"),
    ("docker.io/library/ubuntu:22.04", False, "ubuntu:22.04"),
    ("index.docker.io/library/ubuntu:22.04", False, "ubuntu:22.04"),
    ("docker.io/alice/tools:1", False, "alice/tools:1"),
    ("ubuntu:22.04", False, "ubuntu:22.04"),
    ("ubuntu", False, "ubuntu"),
    ("alice/tools", False, "alice/tools"),
    ("library/ubuntu:22.04", False, "library/ubuntu:22.04"),
    ("localhost:5000/team/ctrain:cpu", False, "localhost:5000#team/ctrain:cpu"),
    ("localhost/ctrain:cpu", False, "localhost#ctrain:cpu"),
    ("127.0.0.1:5000/ctrain", False, "127.0.0.1:5000#ctrain"),
    (f"ghcr.io/team/ctrain@{DIGEST}", False, f"ghcr.io#team/ctrain@{DIGEST}"),
    ("user@nvcr.io#nvidia/pytorch:24.10-py3", False, "user@nvcr.io#nvidia/pytorch:24.10-py3"),
    ("dockerd://ctrain:latest", False, "dockerd://ctrain:latest"),
    ("docker://ubuntu", False, "ubuntu"),
    ("", False, None),
]


def _bash(function: str, value: str, project: Path) -> subprocess.CompletedProcess[str]:
    script = f'source "$0" && CTRAIN_PROJECT_DIR="$1" && {function} "$2"'
    return subprocess.run(["bash", "-c", script, str(LIB), str(project), value], capture_output=True, text=True,
                          env={**os.environ, "HOME": "/home/alice"})  # fmt: skip


@pytest.fixture(scope="module")
def rule_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rule")
    (root / "existing-file").write_text("")
    (root / "existing-dir" / "sub").mkdir(parents=True)
    return root


@pytest.mark.parametrize(("image", "is_file", "enroot"), RULE, ids=[r[0] or "(empty)" for r in RULE])
def test_python_and_bash_agree_on_file_or_reference(image: str, is_file: bool, enroot: str | None,
                                                     rule_project: Path) -> None:  # fmt: skip
    assert image_is_file(image, rule_project) is is_file
    assert (_bash("ctrain_image_is_file", image, rule_project).returncode == 0) is is_file
    if enroot is not None:
        assert reference.enroot(image) == enroot
        assert _bash("ctrain_enroot_image", image, rule_project).stdout.strip() == enroot


def test_bash_makes_files_absolute_and_references_enroot_spelled(rule_project: Path) -> None:
    """What a job queued with plain sbatch gets: IMAGE as users write it, settled by the library."""
    cases = {
        "images/c.sqsh": f"{rule_project}/images/c.sqsh",
        "./c.sqsh": f"{rule_project}/c.sqsh",
        "~/c.sqsh": "/home/alice/c.sqsh",
        "nvcr.io/nvidia/pytorch:24.10-py3": "nvcr.io#nvidia/pytorch:24.10-py3",
        "docker.io/library/ubuntu:22.04": "ubuntu:22.04",
    }
    for given, expected in cases.items():
        script = 'source "$0" && SLURM_SUBMIT_DIR="$1" IMAGE="$2" && ctrain_settings pyxis && echo "$CTRAIN_IMAGE"'
        out = subprocess.run(["bash", "-c", script, str(LIB), str(rule_project), given], capture_output=True,
                             text=True, check=True, env={**os.environ, "HOME": "/home/alice"}).stdout  # fmt: skip
        assert out.strip() == expected, given


def test_submit_writes_enroot_spelling(tmp_path: Path) -> None:
    (tmp_path / "ctrain.yaml").write_text("slurm:\n  runtime: pyxis\n")
    job = prepare(load_config(tmp_path / "ctrain.yaml"), image="nvcr.io/nvidia/pytorch:24.10-py3")
    assert f"export CTRAIN_IMAGE={shlex.quote('nvcr.io#nvidia/pytorch:24.10-py3')}\n" in job.text
    assert job.settings["CTRAIN_IMAGE"] == "nvcr.io#nvidia/pytorch:24.10-py3"
    hub = prepare(load_config(tmp_path / "ctrain.yaml"), image="docker.io/library/ubuntu:22.04")
    assert hub.settings["CTRAIN_IMAGE"] == "ubuntu:22.04"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("ghcr.io/team/ctrain:", "no tag after"),
        ("ghcr.io/team/ctrain@", "no digest after"),
        ("ghcr.io/team/ctrain@sha256:12", "ALGORITHM:HEX"),
        ("ghcr.io/team/-ctrain", "lowercase letters and digits"),
        ("ghcr.io/team/ctrain/", "empty path component"),
        ("-ghcr.io/team", "not a registry host"),
        ("ghcr.io:0/team", "port"),
        ("a" * 256, "longer than 255"),
        ("ghcr.io/team/ctrain:" + "t" * 129, "128"),
    ],
)
def test_reference_problems(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        reference.parse(text)


@pytest.mark.parametrize(
    "text",
    ["ubuntu", "ubuntu:22.04", "library/ubuntu", "localhost/ctrain:cpu", "localhost:5000/a/b-c__d.e:1.0",
     "[::1]:5000/ctrain", f"ghcr.io/team/ctrain:1@{DIGEST}", "registry.example.org/a/b/c/d:TAG_upper"],
)  # fmt: skip
def test_valid_references(text: str) -> None:
    assert str(reference.parse(text)) == text
