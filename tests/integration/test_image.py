"""The training image for real: the CPU flavour of containers/Dockerfile built air-gapped on a
debootstrap base (buildah), converted to SIF and enroot squashfs, run under Apptainer as an
unprivileged user, pushed to a real registry (docker-registry) and over rsync+ssh (a private
sshd), and the standalone Apptainer definition built and compared package by package. A private
index's password reaches the install step of both builders, and nothing they leave holds it."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctrain.image import localbase as base_mod
from ctrain.image import build as build_mod
from ctrain.image import convert as convert_mod
from ctrain.image import sqsh, store
from tests.conftest import need, need_root
from tests.plugins.image import (
    CTRAIN,
    IMAGE_NAME,
    REPO,
    BuiltImage,
    SshServer,
    _locked,
    as_user,
    ctrain,
    parse_fields,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK = ("torch", "transformers", "trl", "datasets", "accelerate", "deepspeed")


def _pins() -> dict[str, str]:
    lines = (REPO / "containers" / "constraints.txt").read_text().splitlines()
    return {n.lower(): v for n, v in (line.split("==", 1) for line in lines if "==" in line and line[0] != "#")}


def _config(image: BuiltImage) -> dict:
    out = subprocess.run(["skopeo", "inspect", "--config", f"containers-storage:{image.id.removeprefix('sha256:')}"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _check_versions(output: str) -> None:
    report = json.loads(output.strip().splitlines()[-1])
    assert report["problems"] == []
    pins = _pins()
    for dist in STACK:
        assert report["versions"][dist].split("+")[0] == pins[dist], dist
    assert report["versions"]["ctrain-slurm"] == build_mod.source_version(REPO)


def test_image_from_the_real_dockerfile(cpu_image: BuiltImage) -> None:
    """Labels (version, commit, base), environment pointing at the bind-mount targets, entrypoint."""
    config = _config(cpu_image)["config"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == build_mod.source_version(REPO)
    commit = labels["org.opencontainers.image.revision"]
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", commit)
    subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", commit.removesuffix("-dirty")], check=True)
    assert labels["org.opencontainers.image.base.name"] == base_mod.DEFAULT_REF
    assert labels["org.ctrain.flavour"] == "cpu"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["PYTHONUNBUFFERED"] == "1" and env["HF_HOME"] == "/hf_home" and env["CTRAIN_OUTPUT_DIR"] == "/outputs"
    assert config["Entrypoint"] == ["/opt/ctrain/venv/bin/ctrain"]
    assert config["WorkingDir"] == "/workspace"
    assert set(config["Volumes"]) == {"/data", "/hf_home", "/outputs"}


def test_code_change_rebuilds_only_the_source_layer(cpu_image: BuiltImage, test_wheelhouse: Path,
                                                     tmp_path: Path) -> None:
    context = tmp_path / "checkout"
    for rel in ("containers", "src", "pyproject.toml", ".dockerignore"):
        src = REPO / rel
        shutil.copytree(src, context / rel) if src.is_dir() else shutil.copy2(src, context / rel)
    with open(context / "src" / "ctrain" / "ui.py", "a") as handle:
        handle.write("\n# a code-only change\n")
    config = tmp_path / "ctrain.yaml"
    config.write_text(cpu_image.config.read_text().replace(f"context: {REPO}", f"context: {context}")
                      .replace(f"tag: {cpu_image.key}", "tag: code-change"))
    out = ctrain(["build", "--local-base"], config=config, log=tmp_path / "build.log")
    try:
        rebuilt = parse_fields(out.stdout)
        assert rebuilt["id"] != cpu_image.id
        layers = [json.loads(subprocess.run(["skopeo", "inspect", f"containers-storage:{i.removeprefix('sha256:')}"],
                                            capture_output=True, text=True, check=True).stdout)["Layers"]
                  for i in (cpu_image.id, rebuilt["id"])]
        # base + dependency layer (and the COPY of the install files) shared; only the source layers differ
        shared = [a for a, b in zip(*layers) if a == b]
        assert len(shared) >= 3 and len(layers[0]) - len(shared) <= 3, layers
        assert "--> Using cache" in (tmp_path / "build.log").read_text()
    finally:
        subprocess.run(["buildah", "rmi", f"localhost/{IMAGE_NAME}:code-change"], capture_output=True)


def test_sif_runs_the_pinned_stack_as_an_unprivileged_user(cpu_sif: Path, cpu_image: BuiltImage,
                                                            image_user: str) -> None:
    check = as_user(image_user, ["apptainer", "exec", "--containall", cpu_sif,
                                 "python", "/opt/ctrain/build/check.py"])
    _check_versions(check.stdout)
    run = as_user(image_user, ["apptainer", "run", "--containall", cpu_sif, "--version"])
    assert f"version {build_mod.source_version(REPO)}" in run.stdout
    as_user(image_user, ["apptainer", "test", cpu_sif])  # the definition's %test (skipped when root built it)
    labels = json.loads(as_user(image_user, ["apptainer", "inspect", "--json", "--labels", cpu_sif]).stdout)
    labels = labels["data"]["attributes"]["labels"]
    assert labels["org.ctrain.source.id"] == cpu_image.id
    assert labels["org.opencontainers.image.version"] == build_mod.source_version(REPO)


def test_sqsh_holds_enroot_conventions(cpu_sqsh: Path, cpu_image: BuiltImage) -> None:
    def cat(path: str) -> str:
        return subprocess.run(["unsquashfs", "-cat", str(cpu_sqsh), path], capture_output=True, text=True,
                              check=True).stdout

    expected = sqsh.enroot_files(_config(cpu_image))
    for path, text in expected.items():
        assert cat(path) == text, path
    environment = cat("etc/environment").splitlines()
    assert "PYTHONUNBUFFERED=1" in environment and "HF_HOME=/hf_home" in environment
    assert any(line.startswith("PATH=/opt/ctrain/venv/bin:") for line in environment)
    rc = cat("etc/rc")
    assert 'cd "/workspace" && unset OLDPWD || exit 1' in rc
    assert "exec '/opt/ctrain/venv/bin/ctrain' \"$@\"" in rc and "exec '/opt/ctrain/venv/bin/ctrain' '--help'" in rc
    assert "${ENROOT_ROOTFS}/outputs /outputs none x-create=dir,bind,rw,nosuid,nodev" in cat("etc/fstab")
    listing = subprocess.run(["unsquashfs", "-lls", str(cpu_sqsh)], capture_output=True, text=True, check=True).stdout
    entries = [line for line in listing.splitlines() if "squashfs-root" in line]
    assert all(" root/root " in line for line in entries[:200])  # -all-root, as enroot does
    paths = [line.split("squashfs-root", 1)[1] for line in entries]
    assert "/dev/null" not in paths and "/.dockerenv" not in paths
    assert not [p for p in paths if re.search(r"/(\.git|\.venv|images|outputs/.+|wheelhouse/.+)(/|$)", p)]


def test_sqsh_starts_like_enroot_and_runs_the_pinned_stack(cpu_sqsh: Path, image_user: str) -> None:
    """enroot sources /etc/environment and runs /etc/rc with the command; Apptainer can do the same."""
    start = "set -a; . /etc/environment; set +a; exec /bin/sh /etc/rc \"$@\""
    version = as_user(image_user, ["apptainer", "exec", "--containall", cpu_sqsh, "/bin/sh", "-c", start, "rc",
                                   "--version"])
    assert f"version {build_mod.source_version(REPO)}" in version.stdout
    check = as_user(image_user, ["apptainer", "exec", "--containall", cpu_sqsh,
                                 "/opt/ctrain/venv/bin/python", "/opt/ctrain/build/check.py"])
    _check_versions(check.stdout)


def test_second_conversion_of_the_same_image_does_no_work(cpu_sif: Path, cpu_sqsh: Path,
                                                          cpu_image: BuiltImage) -> None:
    before = {p: p.stat().st_mtime_ns for p in (cpu_sif, cpu_sqsh)}
    for to in ("sif", "sqsh"):
        out = ctrain(["convert", "--to", to, "--compression", "zstd"], config=cpu_image.config)
        fields = parse_fields(out.stdout)
        assert fields["cached"] == "true" and fields["id"] == cpu_image.id
        assert "nothing to do" in out.stderr
    assert {p: p.stat().st_mtime_ns for p in (cpu_sif, cpu_sqsh)} == before


@pytest.mark.full
def test_killed_conversion_leaves_no_file(cpu_image: BuiltImage, tmp_path: Path) -> None:
    """Full tier alone; CI tier: test_clean_stale_removes_only_leftovers_of_dead_processes (what a killed
    conversion leaves is removed)."""
    output = tmp_path / "killed.sqsh"
    log = tmp_path / "convert.log"
    with open(log, "w") as err:
        job = subprocess.Popen(
            [*CTRAIN, "--config", str(cpu_image.config), "convert", "--to", "sqsh", "--compression", "none",
             "--output", str(output)],
            stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, start_new_session=True)
    tmp = tmp_path / f".killed.sqsh.tmp-{job.pid}"
    deadline = time.monotonic() + 600
    while not (tmp.exists() and tmp.stat().st_size > 0) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.poll() is None, log.read_text()
    os.killpg(job.pid, signal.SIGKILL)  # the whole conversion, as a scheduler or OOM killer would
    job.wait()
    time.sleep(1)
    assert not output.exists()
    assert not convert_mod._sidecar(output).exists()
    leftovers = convert_mod.clean_stale(output)
    assert tmp in leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == [".killed.sqsh.lock", "convert.log"]


def test_push_to_a_registry_and_pull_back_the_same_digest(cpu_image: BuiltImage, oci_registry: str,
                                                          tmp_path: Path) -> None:
    out = ctrain(["push", "--registry", f"{oci_registry}/ci"], config=cpu_image.config)
    what, where = parse_fields(out.stdout)["pushed"].split(" ", 1)
    name, digest = where.split("@")
    assert what == "image" and name == f"{oci_registry}/ci/ctrain-test"
    tagged = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}",
                             f"docker://{name}:{cpu_image.key}"], capture_output=True, text=True, check=True)
    assert tagged.stdout.strip() == digest
    layout = tmp_path / "pulled"
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", f"docker://{where}", f"oci:{layout}:x"],
                   check=True)
    index = json.loads((layout / "index.json").read_text())
    assert index["manifests"][0]["digest"] == digest
    manifest = json.loads((layout / "blobs" / "sha256" / digest.split(":")[1]).read_text())
    assert manifest["config"]["digest"] == cpu_image.id  # the very image that was built


def test_push_sif_to_oras(cpu_sif: Path, cpu_image: BuiltImage, oci_registry: str, image_user: str,
                          user_tmp: Path) -> None:
    url = f"oras://{oci_registry}/ci/ctrain-sif:{cpu_image.key}"
    out = ctrain(["push", "--oras", url, "--file", cpu_sif], config=cpu_image.config)
    assert parse_fields(out.stdout)["pushed"] == f"oras {url}"
    pulled = user_tmp / "pulled.sif"
    as_user(image_user, ["apptainer", "pull", "--no-https", pulled, url])
    assert build_mod.sha256_file(pulled) == build_mod.sha256_file(cpu_sif)


def test_build_and_push_with_no_flags_over_ssh(cpu_image: BuiltImage, cpu_sqsh: Path, oci_registry: str,
                                               ssh_server: SshServer, tmp_path: Path) -> None:
    """ctrain.yaml names the registry and the cluster path: `ctrain push` needs no flags; the file
    lands by rsync over ssh, sha256 checked on both sides, renamed into place."""
    dest = tmp_path / "cluster-shared"
    dest.mkdir()
    config = tmp_path / "ctrain.yaml"
    options = json.dumps(list(ssh_server.options))
    config.write_text(
        cpu_image.config.read_text().replace("output_dir: images", f"output_dir: {cpu_image.project / 'images'}")
        + f"  to: sqsh\npush:\n  registry: {oci_registry}/noflags\n"
        f"  remote: ssh://{ssh_server.user}@127.0.0.1:{ssh_server.port}{dest}/\n  ssh_options: {options}\n"
    )
    out = ctrain(["push"], config=config)
    pushed = [line.split(" ", 2)[1:] for line in out.stdout.splitlines() if line.startswith("pushed: ")]
    assert [p[0] for p in pushed] == ["image", "remote"]
    assert pushed[1][1] == f"{ssh_server.user}@127.0.0.1:{dest}/{cpu_sqsh.name}"
    assert "nothing to do" in out.stderr  # the sqsh was already converted from this image
    assert build_mod.sha256_file(dest / cpu_sqsh.name) == build_mod.sha256_file(cpu_sqsh)
    assert [p.name for p in dest.iterdir()] == [cpu_sqsh.name]  # no temporary file left
    again = ctrain(["push"], config=config)
    assert "nothing to send" in again.stderr


@pytest.mark.full
def test_standalone_definition_builds_the_same_packages(cpu_image: BuiltImage, cpu_sif: Path, image_user: str,
                                                         test_wheelhouse: Path, user_tmp: Path) -> None:
    """containers/ctrain-standalone.def, built by Apptainer (unprivileged) from the same base and
    wheelhouse, holds the same packages at the same versions as the Dockerfile's image.
    Full tier alone; CI tier: test_apptainer_build_with_an_index_password_leaves_it_nowhere (the standalone
    definition built by Apptainer)."""
    work = user_tmp
    base = store.inspect(base_mod.DEFAULT_REF, "containers")
    assert base is not None
    store.export_oci(base, work / "base", "base")
    checkout = work / "checkout"  # a copy the user can read wherever the repository lives
    for rel in ("containers", "src/ctrain", "pyproject.toml"):
        src = REPO / rel
        shutil.copytree(src, checkout / rel) if src.is_dir() else shutil.copy2(src, checkout / rel)
    subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)
    out = work / "out"
    out.mkdir()
    shutil.chown(out, image_user)
    sandbox = out / "sandbox"
    request = build_mod.BuildRequest(context=checkout, ref="ctrain-standalone:test", flavour="cpu",
                                     base=f"oci://{work / 'base'}", wheelhouse=test_wheelhouse, builder="apptainer")
    cmd = build_mod.apptainer_command(request, {"FLAVOUR": "cpu", "TORCH_INDEX_URL": "none"}, sandbox)
    cmd.insert(cmd.index("build") + 1, "--sandbox")  # a directory is enough to compare; no squashfs to write
    result = subprocess.run(["runuser", "-u", image_user, "--", "env", f"APPTAINER_TMPDIR={out}", *cmd],
                            cwd=checkout, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check_versions(as_user(image_user, ["apptainer", "exec", "--containall", sandbox, "python",
                                         "/opt/ctrain/build/check.py"]).stdout)

    def freeze(image: Path) -> list[str]:
        return as_user(image_user, ["apptainer", "exec", "--containall", image, "python", "-m", "pip", "freeze",
                                    "--all"]).stdout.splitlines()

    assert freeze(sandbox) == freeze(cpu_sif)

    def cat(image: Path, path: str) -> str:
        return as_user(image_user, ["apptainer", "exec", "--containall", image, "cat", path]).stdout

    assert cat(sandbox, "/opt/ctrain/pins.txt") == cat(cpu_sif, "/opt/ctrain/pins.txt")


# --- a private index's password: in the build, nowhere after it ------------------------------------

SECRET = "S3CRET-8c1f"
PRIVATE_INDEX = f"http://ci-user:{SECRET}@127.0.0.1:9/simple"
# Stands in for containers/install.sh (the real one would install the whole stack): the deps step
# reads the login where the real one finds it, says it has it (not what it is), and for FLAVOUR=gpu
# fails printing it in a URL, as pip might. The real Dockerfile and definition run it.
_STUB_INSTALL = """#!/bin/sh
set -eu
case "$1" in
    deps)
        read -r _ host _ login _ password < /run/secrets/ctrain-netrc
        echo "stub install.sh: login for $host: $login (${#password} characters); index ${TORCH_INDEX_URL:-}"
        if [ "$2" = gpu ]; then
            echo "ERROR: HTTP 404 for http://$login:$password@$host:9/simple/torch/" >&2
            exit 2
        fi
        mkdir -p /opt/ctrain/venv/bin
        ln -sf "$(command -v python3)" /opt/ctrain/venv/bin/python ;;
    ctrain) ;;
esac
"""


@pytest.fixture(scope="session")
def local_base() -> store.Image:
    """The debootstrap base the CPU test image is built on (made once, shared with cpu_image)."""
    need_root()
    need(shutil.which("buildah") is not None and shutil.which("debootstrap") is not None, "buildah, debootstrap")
    with _locked("build"):
        return base_mod.debootstrap_base(builder="buildah")


def _stub_checkout(directory: Path) -> Path:
    """The real Dockerfile, definitions and source, with the stub install step (seconds to build)."""
    for rel in ("containers", "src/ctrain", "pyproject.toml", ".dockerignore"):
        src = REPO / rel
        shutil.copytree(src, directory / rel) if src.is_dir() else shutil.copy2(src, directory / rel)
    (directory / "containers" / "install.sh").write_text(_STUB_INSTALL)
    (directory / "containers" / "check.py").write_text("print('stub check: ok')\n")
    subprocess.run(["chmod", "-R", "a+rX", str(directory)], check=True)
    return directory


def _holds(path: Path, needles: tuple[bytes, ...], decompress: bool = True) -> list[bytes]:
    """Which of ``needles`` the file holds; a gzip or zstd file (an image layer) read decompressed."""
    with open(path, "rb") as raw:
        magic = raw.read(4)
    if decompress and magic[:2] == b"\x1f\x8b":
        stream = gzip.open(path, "rb")
    elif decompress and magic == b"\x28\xb5\x2f\xfd":
        need(shutil.which("zstd") is not None, "zstd (a zstd-compressed layer)")
        stream = subprocess.Popen(["zstd", "-dc", str(path)], stdout=subprocess.PIPE).stdout
    else:
        stream = open(path, "rb")
    found: set[bytes] = set()
    keep = max(map(len, needles)) - 1
    tail = b""
    with stream:
        while chunk := stream.read(16 << 20):
            window = tail + chunk
            found.update(n for n in needles if n in window)
            tail = window[-keep:]
    return sorted(found)


def _secret_files(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("ctrain-secrets-*"))


def _build(config: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``ctrain build`` (stdout and stderr together), its temporary files under ``tmp``."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.run([*CTRAIN, "--config", str(config), "build", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env, timeout=900)


@pytest.fixture
def private_index_project(local_base: store.Image, tmp_path: Path) -> Iterator[Path]:
    """A ctrain.yaml building the stub checkout with buildah, torch from a password-protected
    index; the image is removed afterwards."""
    checkout = _stub_checkout(tmp_path / "checkout")
    (tmp_path / "tmp").mkdir()
    config = tmp_path / "ctrain.yaml"
    config.write_text(
        f"image:\n  name: ctrain-private-index\n  tag: test\n  context: {checkout}\n  flavour: cpu\n"
        f"  builder: buildah\n  base: {local_base.ref}\n  torch_index: {PRIVATE_INDEX}\n"
    )
    yield config
    subprocess.run(["buildah", "rmi", "localhost/ctrain-private-index:test"], capture_output=True)


def test_index_password_reaches_the_install_step_and_no_layer_or_history(private_index_project: Path,
                                                                          tmp_path: Path) -> None:
    result = _build(private_index_project, tmp_path / "tmp", "--no-cache")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "stub install.sh: login for 127.0.0.1: ci-user (11 characters)" in result.stdout  # it got there
    assert SECRET not in result.stdout
    assert _secret_files(tmp_path / "tmp") == []
    image_id = parse_fields(result.stdout)["id"].removeprefix("sha256:")
    history = subprocess.run(["podman", "history", "--no-trunc", "--format", "{{.CreatedBy}}", image_id],
                             capture_output=True, text=True, check=True).stdout
    inspect = subprocess.run(["buildah", "inspect", "--type", "image", image_id],
                             capture_output=True, text=True, check=True).stdout
    assert SECRET not in history and SECRET not in inspect
    assert "TORCH_INDEX_URL=http://127.0.0.1:9/simple" in history  # the URL is there, its password not
    assert "--mount=type=secret,id=ctrain-netrc" in history
    layout = tmp_path / "oci"
    subprocess.run(["skopeo", "copy", "--quiet", f"containers-storage:{image_id}", f"oci:{layout}:x"], check=True)
    blobs = [b for b in sorted((layout / "blobs").rglob("*")) if b.is_file()]
    assert len(blobs) >= 5  # config, manifest, base and added layers
    found = {b.name: _holds(b, (SECRET.encode(), b"login ci-user")) for b in blobs}
    assert {name: needles for name, needles in found.items() if needles} == {}
    assert "index http://127.0.0.1:9/simple" in result.stdout  # the URL reached the step, without the password


def test_failing_build_with_an_index_password_prints_none(private_index_project: Path, tmp_path: Path) -> None:
    """The install step fails printing the URL with the password (as pip might): ctrain's output,
    the streamed lines and the error, shows it masked, and the secret file is gone."""
    result = _build(private_index_project, tmp_path / "tmp", "--flavour", "gpu")
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: the build failed at"), result.stdout[-3000:]
    # The failing step's own output, streamed as it ran, shows the URL with its login masked.
    assert "HTTP 404 for http://***:***@127.0.0.1:9/simple/torch/" in result.stdout
    assert SECRET not in result.stdout
    assert _secret_files(tmp_path / "tmp") == []


def test_apptainer_build_with_an_index_password_leaves_it_nowhere(local_base: store.Image, image_user: str,
                                                                  user_tmp: Path) -> None:
    """The standalone definition, built by ctrain's apptainer builder as an unprivileged user: the
    login is bound for %post, and neither the SIF's definition nor its squashfs holds it."""
    need(shutil.which("apptainer") is not None and shutil.which("unsquashfs") is not None, "apptainer, unsquashfs")
    store.export_oci(local_base, user_tmp / "base", "base")
    checkout = _stub_checkout(user_tmp / "checkout")
    for directory in ("tmp", "apptainer", "images"):
        (user_tmp / directory).mkdir(mode=0o777)
        (user_tmp / directory).chmod(0o777)
    sif_dir = user_tmp / "images"
    # ctrain's build as the user (ctrain's own venv may not be readable by it; the library needs
    # only the standard library); uncompressed squashfs: the test needs no small file.
    script = (
        "import sys; from pathlib import Path; from ctrain.image import build\n"
        "request = build.BuildRequest(context=Path(sys.argv[1]), ref='ctrain-private-index:sif', flavour='cpu', "
        "base=sys.argv[2], builder='apptainer', sif_dir=Path(sys.argv[3]), torch_index=sys.argv[4])\n"
        "print('path:', build.build(request).path)\n"
    )
    result = subprocess.run(
        ["runuser", "-u", image_user, "--", "env", f"TMPDIR={user_tmp / 'tmp'}",
         f"APPTAINER_TMPDIR={user_tmp / 'apptainer'}", "APPTAINER_MKSQUASHFS_ARGS=-noI -noD -noF -noX",
         f"PYTHONPATH={checkout / 'src'}", "/usr/bin/python3", "-c", script, str(checkout),
         f"oci://{user_tmp / 'base'}", str(sif_dir), PRIVATE_INDEX],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "stub install.sh: login for 127.0.0.1: ci-user (11 characters)" in result.stdout  # it got there
    assert SECRET not in result.stdout
    assert _secret_files(user_tmp / "tmp") == []
    sif = Path(parse_fields(result.stdout)["path"])
    deffile = subprocess.run(["apptainer", "inspect", "--deffile", str(sif)], capture_output=True, text=True,
                             check=True).stdout
    assert SECRET not in deffile and 'TORCH_INDEX_URL="http://127.0.0.1:9/simple"' in deffile
    needles = (SECRET.encode(), b"login ci-user")
    assert _holds(sif, needles) == []  # descriptors (definition, labels, environment) and squashfs
    objects = subprocess.run(["apptainer", "sif", "list", str(sif)], capture_output=True, text=True,
                             check=True).stdout
    start = next(line.split("|")[3].split("-")[0].strip() for line in objects.splitlines() if "Squashfs" in line)
    rootfs = user_tmp / "rootfs"
    subprocess.run(["unsquashfs", "-no-progress", "-quiet", "-o", start, "-d", str(rootfs), str(sif)], check=True,
                   stdout=subprocess.DEVNULL)
    assert (rootfs / "opt/ctrain/build/install.sh").is_file()  # the extraction worked
    assert list((rootfs / "run/secrets").iterdir()) == []  # the mount point, empty
    files = [p for p in rootfs.rglob("*") if p.is_file() and not p.is_symlink()]
    found = {str(p): _holds(p, needles, decompress=False) for p in files}
    assert {path: hits for path, hits in found.items() if hits} == {}
    assert "index http://127.0.0.1:9/simple" in result.stdout  # the URL reached %post, without the password
