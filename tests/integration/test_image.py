"""The training image for real: the CPU flavour of containers/Dockerfile built air-gapped on a
debootstrap base (buildah), converted to SIF and enroot squashfs, run under Apptainer as an
unprivileged user, pushed to a real registry (docker-registry) and over rsync+ssh (a private
sshd), and the standalone Apptainer definition built and compared package by package."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ctrain.image import base as base_mod
from ctrain.image import build as build_mod
from ctrain.image import convert as convert_mod
from ctrain.image import sqsh, store
from tests.plugins.image import CTRAIN, IMAGE_NAME, REPO, BuiltImage, SshServer, as_user, ctrain, parse_fields

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
    assert report["versions"]["ctrain"] == build_mod.source_version(REPO)


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


def test_killed_conversion_leaves_no_file(cpu_image: BuiltImage, tmp_path: Path) -> None:
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


def test_standalone_definition_builds_the_same_packages(cpu_image: BuiltImage, cpu_sif: Path, image_user: str,
                                                         test_wheelhouse: Path, user_tmp: Path) -> None:
    """containers/ctrain-standalone.def, built by Apptainer (unprivileged) from the same base and
    wheelhouse, holds the same packages at the same versions as the Dockerfile's image."""
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
