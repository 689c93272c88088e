"""Image build/convert/push logic that needs no image: command lines, progress, caching, atomic
file pushes to a local directory, credentials kept out of builds and errors, settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ctrain.config import ProjectConfig, PushConfig, load_config
from ctrain.errors import ConfigError, CtrainError
from ctrain.image import build, convert, push, secrets, service, store
from ctrain.image.build import BuildRequest, Progress
from tests.conftest import need
from tests.plugins.image import render_definition

REPO = Path(__file__).resolve().parents[2]
IMAGE = store.Image("localhost/ctrain:latest", "sha256:" + "ab" * 32, "containers", "sha256:" + "cd" * 32)


# --- build ---------------------------------------------------------------------------------------


def _request(**kw: object) -> BuildRequest:
    defaults: dict[str, object] = {"context": REPO, "ref": "ctrain:cpu", "flavour": "cpu", "base": "localhost/base:1"}
    return BuildRequest(**{**defaults, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("builder", ["buildah", "podman", "docker"])
def test_oci_build_command(builder: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("BUILDAH_ISOLATION", raising=False)
    req = _request(wheelhouse=tmp_path)
    cmd = build._oci_command(builder, req, tmp_path / "iid", {"FLAVOUR": "cpu", "BASE_IMAGE": "localhost/base:1"})
    assert cmd[0] == builder and cmd[-1] == str(REPO)
    assert cmd[cmd.index("-f") + 1] == str(REPO / "containers" / "Dockerfile")
    assert cmd[cmd.index("-t") + 1] == "ctrain:cpu"
    assert f"wheelhouse={tmp_path}" in cmd
    assert "FLAVOUR=cpu" in cmd and "BASE_IMAGE=localhost/base:1" in cmd
    assert ("--isolation" in cmd) == (builder != "docker")
    assert ("--force-rm" in cmd) == (builder != "docker")
    assert "--layers" in cmd or builder == "docker"


def test_buildah_isolation_from_environment_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BUILDAH_ISOLATION", "oci")
    assert "--isolation" not in build._oci_command("buildah", _request(), tmp_path / "iid", {})


def test_progress_tracks_steps_and_elapsed_time() -> None:
    lines: list[str] = []
    progress = Progress(lines.append)
    progress("INFO:    Starting build...")
    progress("[2/2] STEP 5/16: RUN sh install.sh")
    progress("Collecting torch")
    progress("#7 [stage-1 3/9] COPY src /src")
    assert lines[0] == "[build 00:00] INFO:    Starting build..."
    assert lines[1].startswith("[build 5/16 00:00] ")
    assert lines[2] == "[build 5/16 00:00] Collecting torch"
    assert lines[3].startswith("[build 3/9 ")


def test_source_version_and_git_commit() -> None:
    from ctrain import __version__

    assert build.source_version(REPO) == __version__
    commit = build.git_commit(REPO)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert commit.removesuffix("-dirty") == head
    assert build.git_commit(Path("/")) == "unknown"


def test_wheelhouse_and_context_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        build.check_wheelhouse(tmp_path / "missing")
    with pytest.raises(ConfigError, match="holds no wheels"):
        build.check_wheelhouse(tmp_path)
    (tmp_path / "torch-2.13.0-cp311-none-any.whl").write_text("")
    build.check_wheelhouse(tmp_path)
    with pytest.raises(CtrainError, match="not a ctrain checkout"):
        build.check_context(tmp_path, "buildah")
    build.check_context(REPO, "buildah")
    build.check_context(REPO, "apptainer")


def test_unknown_builder_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="valid: auto, docker, podman, buildah, apptainer"):
        build.choose("kaniko")


def test_sif_path_and_default_outputs(tmp_path: Path) -> None:
    assert build.sif_path(tmp_path, "localhost/ctrain:cpu") == tmp_path / "ctrain-cpu.sif"
    assert build.sif_path(tmp_path, "registry:5000/team/ctrain") == tmp_path / "ctrain-latest.sif"
    assert convert.default_output(tmp_path, "localhost/ctrain:cpu", "sqsh") == tmp_path / "ctrain-cpu.sqsh"


def test_image_ref_from_config_and_tag_option() -> None:
    config = ProjectConfig()
    assert service.image_ref(config) == "ctrain:latest"
    assert service.image_ref(config, "v2") == "ctrain:v2"
    assert service.image_ref(config, "other:v3") == "other:v3"


def test_image_source_is_pinned_by_id() -> None:
    hex_id = "ab" * 32
    assert IMAGE.source == f"containers-storage:{hex_id}"
    assert store.Image("x", IMAGE.id, "docker").source == f"docker-daemon:sha256:{hex_id}"
    assert store.normalise_id(hex_id + "\n") == IMAGE.id
    with pytest.raises(CtrainError, match="could not parse an image ID"):
        store.normalise_id("not-an-id")


def test_local_base_rejects_conflicting_options(tmp_path: Path) -> None:
    config = ProjectConfig()
    with pytest.raises(ConfigError, match="drop --base"):
        service.run_build(config, builder="buildah", local_base=True, base="x")
    with pytest.raises(ConfigError, match="cpu flavour only"):
        service.run_build(config, builder="buildah", local_base=True, flavour="gpu")


# --- convert: cache and atomicity -----------------------------------------------------------------


def _record(output: Path, image_id: str, to: str = "sqsh", compression: str = "zstd") -> None:
    st = output.stat()
    convert._sidecar(output).write_text(json.dumps(
        {"image_id": image_id, "to": to, "compression": compression, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))


def test_up_to_date_needs_same_image_format_compression_and_untouched_file(tmp_path: Path) -> None:
    output = tmp_path / "ctrain.sqsh"
    assert not convert.up_to_date(output, IMAGE.id, "sqsh", "zstd")
    output.write_bytes(b"squashfs")
    assert not convert.up_to_date(output, IMAGE.id, "sqsh", "zstd")  # no record
    _record(output, IMAGE.id)
    assert convert.up_to_date(output, IMAGE.id, "sqsh", "zstd")
    assert not convert.up_to_date(output, "sha256:" + "00" * 32, "sqsh", "zstd")
    assert not convert.up_to_date(output, IMAGE.id, "sqsh", "none")
    output.write_bytes(b"squashfs, changed")
    assert not convert.up_to_date(output, IMAGE.id, "sqsh", "zstd")


def test_cached_conversion_does_no_work(tmp_path: Path) -> None:
    """An up-to-date output returns at once: no tool is run (this image could not be exported)."""
    output = tmp_path / "ctrain.sqsh"
    output.write_bytes(b"hsqs squashfs")
    _record(output, IMAGE.id)
    messages: list[str] = []
    result = convert.convert(IMAGE, "sqsh", output, compression="zstd", context=REPO, emit=messages.append)
    assert result.cached and result.path == output
    assert "nothing to do" in messages[-1]


def test_clean_stale_removes_only_leftovers_of_dead_processes(tmp_path: Path) -> None:
    output = tmp_path / "ctrain.sif"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_file = tmp_path / f".ctrain.sif.tmp-{dead.pid}"
    stale_dir = tmp_path / f".ctrain.sif.work-{dead.pid}-x1"
    live = tmp_path / f".ctrain.sif.tmp-{os.getpid()}"
    other = tmp_path / f".other.sif.tmp-{dead.pid}"
    for path in (stale_file, live, other):
        path.write_text("")
    stale_dir.mkdir()
    (stale_dir / "rootfs").mkdir()
    assert sorted(convert.clean_stale(output)) == sorted([stale_file, stale_dir])
    assert live.exists() and other.exists() and not stale_file.exists() and not stale_dir.exists()


def test_compression_resolution() -> None:
    assert convert.resolve_compression("sif", "auto") == "gzip"
    assert convert.resolve_compression("sqsh", "auto") == "zstd"
    assert convert.resolve_compression("sqsh", "none") == "none"
    with pytest.raises(CtrainError, match="valid: auto, none"):
        convert.resolve_compression("sqsh", "brotli")


def test_sif_built_by_apptainer_cannot_become_sqsh(tmp_path: Path) -> None:
    sif = store.Image(str(tmp_path / "x.sif"), IMAGE.id, "sif", None, tmp_path / "x.sif")
    with pytest.raises(CtrainError, match="needs an OCI image"):
        convert.convert(sif, "sqsh", tmp_path / "x.sqsh", context=REPO)


# --- push ----------------------------------------------------------------------------------------


def test_push_files_to_a_local_directory_is_verified_and_atomic(tmp_path: Path) -> None:
    source = tmp_path / "ctrain-cpu.sqsh"
    source.write_bytes(b"hsqs" + bytes(60) + os.urandom(1 << 20))  # a superblock whose bytes_used (0) fits
    dest = tmp_path / "shared"
    dest.mkdir()
    messages: list[str] = []
    assert push.push_files([source], str(dest), emit=messages.append) == [str(dest / source.name)]
    assert (dest / source.name).read_bytes() == source.read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == [source.name]  # no temporary file left
    assert any("verified" in m for m in messages)
    messages.clear()
    push.push_files([source], str(dest) + "/", emit=messages.append)
    assert any("nothing to send" in m for m in messages)
    renamed = dest / "current.sqsh"
    push.push_files([source], str(renamed), emit=messages.append)
    assert renamed.read_bytes() == source.read_bytes()


def test_push_files_errors(tmp_path: Path) -> None:
    a, b = tmp_path / "a.sif", tmp_path / "b.sqsh"
    a.write_bytes(b"\0SIF_MAGIC a")
    b.write_bytes(b"hsqs" + bytes(64))
    with pytest.raises(CtrainError, match="needs one"):
        push.push_files([a, b], str(tmp_path / "not-a-dir"))
    with pytest.raises(CtrainError, match="does not exist"):
        push.push_files([tmp_path / "missing.sif"], str(tmp_path) + "/")


@pytest.mark.parametrize(
    ("text", "host", "path", "port"),
    [
        ("alice@login.hpc.example.org:/scratch/images/", "alice@login.hpc.example.org", "/scratch/images/", None),
        ("cluster:images/", "cluster", "images/", None),
        ("ssh://bob@127.0.0.1:2222/data/img.sif", "bob@127.0.0.1", "/data/img.sif", 2222),
        ("/shared/images/", None, "/shared/images/", None),
        ("./images/x:y.sif", None, "./images/x:y.sif", None),
    ],
)
def test_remote_destinations(text: str, host: str | None, path: str, port: int | None) -> None:
    assert push.Remote.parse(text) == push.Remote(host, path, port)


def test_registry_destination_and_loopback() -> None:
    assert push.registry_destination("127.0.0.1:5000/team/", "localhost/ctrain:cpu") == "127.0.0.1:5000/team/ctrain:cpu"
    assert push.registry_destination("ghcr.io/me", "ctrain") == "ghcr.io/me/ctrain:latest"
    assert push.is_loopback("127.0.0.1:5000") and push.is_loopback("localhost") and push.is_loopback("[::1]:443")
    assert not push.is_loopback("registry.example.org:5000") and not push.is_loopback("10.0.0.1:5000")


def test_push_errors_are_redacted() -> None:
    with pytest.raises(CtrainError) as info:
        push.push_oras(Path("/nonexistent.sif"), "https://user:pw@host/x")
    assert "pw" not in str(info.value) and "must start with oras://" in str(info.value)


def test_push_needs_a_destination() -> None:
    with pytest.raises(ConfigError, match="nowhere to push: set push.registry"):
        service.run_push(ProjectConfig())



def test_push_flags_replace_the_configured_destinations(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A destination on the command line replaces push: in ctrain.yaml (the ssh options stay)."""
    config = ProjectConfig(push=PushConfig(registry="ghcr.io/team", oras="oras://h/x:1", ssh_options=["-p2222"]))
    sif = tmp_path / "a.sif"
    sif.write_bytes(b"\0SIF_MAGIC")
    sent: list[tuple[list[Path], str, list[str]]] = []
    monkeypatch.setattr(service.push_mod, "check_destination", lambda *a, **k: None)
    monkeypatch.setattr(service.push_mod, "push_files", lambda files, remote, ssh_options: sent.append(
        (files, remote, ssh_options)) or [f"{remote}{files[0].name}"])  # fmt: skip
    pushed = service.run_push(config, remote="host:/images/", files=(sif,))
    assert pushed == [service.Pushed("remote", "host:/images/a.sif")]
    assert sent == [([sif], "host:/images/", ["-p2222"])]


def test_build_and_convert_flags_are_checked_as_settings() -> None:
    with pytest.raises(ConfigError, match="'image.flavour' is 'tpu'; valid values: gpu, cpu"):
        service.run_build(ProjectConfig(), flavour="tpu")
    with pytest.raises(ConfigError, match="'convert.to' is 'tar'; valid values: sif, sqsh"):
        service.run_convert(ProjectConfig(), to="tar")


# --- project config --------------------------------------------------------------------------------


def test_unknown_image_key_lists_valid_ones(tmp_path: Path) -> None:
    path = tmp_path / "ctrain.yaml"
    path.write_text("image:\n  nmae: x\n")
    with pytest.raises(ConfigError, match=r"unknown key 'image.nmae' \(did you mean 'name'\?\); valid keys under image"):
        load_config(path)
    path.write_text("push:\n  remtoe: x\n")
    with pytest.raises(ConfigError, match="valid keys under push: oras, registry, remote, ssh_options, tls_verify"):
        load_config(path)


def test_bad_image_name_and_tag(tmp_path: Path) -> None:
    path = tmp_path / "ctrain.yaml"
    path.write_text("image:\n  tag: 'a:b'\n")
    with pytest.raises(ConfigError, match="image.tag"):
        load_config(path)


def test_example_config_is_valid() -> None:
    config = load_config(REPO / "containers" / "ctrain.example.yaml")
    assert config.push.remote and config.push.registry


def test_apptainer_refusing_root_gets_an_explanation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capability failure of Apptainer as root becomes advice; other failures pass unchanged."""
    fake = tmp_path / "apptainer"
    fake.write_text("#!/bin/sh\necho 'ERROR  : Requesting capability set 0x1ff while permitted capability set is 0x1fe' >&2\n"
                    "exit 255\n")
    fake.chmod(0o755)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(CtrainError, match="run this as a normal user, or set `root default capabilities = no`"):
        build.run_apptainer([str(fake), "build"], on_line=lambda line: None)
    fake.write_text("#!/bin/sh\necho 'FATAL: no space left' >&2\nexit 1\n")
    with pytest.raises(CtrainError) as info:
        build.run_apptainer([str(fake), "build"], on_line=lambda line: None)
    assert "normal user" not in str(info.value) and "no space left" in str(info.value)


def test_apptainer_build_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    req = _request(base="oci:///var/tmp/base-layout", wheelhouse=tmp_path, builder="apptainer")
    cmd = build.apptainer_command(req, {"FLAVOUR": "cpu", "BASE_IMAGE": "x", "GIT_COMMIT": "abc"}, tmp_path / "o.sif")
    args = [cmd[i + 1] for i, word in enumerate(cmd) if word == "--build-arg"]
    assert args == ["FLAVOUR=cpu", "GIT_COMMIT=abc", "BOOTSTRAP=oci", "BASE=/var/tmp/base-layout"]
    assert cmd[cmd.index("--bind") + 1] == f"{tmp_path}:/wheelhouse"
    assert cmd[-2:] == [str(tmp_path / "o.sif"), "containers/ctrain-standalone.def"] and "--notest" not in cmd
    plain = build.apptainer_command(_request(base="python:3.11-slim-bookworm"), {}, tmp_path / "o.sif")
    assert "BOOTSTRAP=docker" in plain and "BASE=python:3.11-slim-bookworm" in plain


# --- index credentials: a build secret, never an argument -----------------------------------------

SECRET = "S3CRET"
PRIVATE_INDEX = f"http://ci-user:{SECRET}@127.0.0.1:9/simple"


@pytest.mark.parametrize(
    ("url", "clean", "credential"),
    [
        (PRIVATE_INDEX, "http://127.0.0.1:9/simple", secrets.Credential("127.0.0.1", "ci-user", SECRET)),
        ("https://me:p%40ss%3Aw0rd@pypi.example.org/simple/", "https://pypi.example.org/simple/",
         secrets.Credential("pypi.example.org", "me", "p@ss:w0rd")),
        ("https://TOKEN@git.example.org/api/simple", "https://git.example.org/api/simple",
         secrets.Credential("git.example.org", "TOKEN", "")),
        ("https://download.pytorch.org/whl/cpu", "https://download.pytorch.org/whl/cpu", None),
        ("none", "none", None),
    ],
)
def test_index_url_split_into_url_and_credential(url: str, clean: str, credential: secrets.Credential | None) -> None:
    assert secrets.split_url(url) == (clean, credential)


def test_index_credentials_a_netrc_cannot_hold_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="image.torch_index: the user or password holds whitespace"):
        secrets.split_url("https://me:two%20words@h/simple", "image.torch_index")
    with pytest.raises(ConfigError, match="a second login for h"):
        secrets.split_urls({"a": "https://me:x@h/simple", "b": "https://you:y@h:8443/other"})
    clean, creds = secrets.split_urls({"a": "https://me:x@h/simple", "b": "https://me:x@h/other", "c": None})
    assert clean == {"a": "https://h/simple", "b": "https://h/other", "c": None} and len(creds) == 1


def test_netrc_file_is_private_and_removed_also_on_failure() -> None:
    creds = [secrets.Credential("127.0.0.1", "ci-user", SECRET), secrets.Credential("h", "TOKEN")]
    with secrets.netrc_file(creds) as path:
        assert path is not None and path.name == secrets.SECRET_ID
        assert path.read_text() == f"machine 127.0.0.1 login ci-user password {SECRET}\nmachine h login TOKEN\n"
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
        assert [p.name for p in path.parent.iterdir()] == [secrets.SECRET_ID]  # a bind shows only this
    assert not path.parent.exists()
    with pytest.raises(RuntimeError), secrets.netrc_file(creds) as failing:
        raise RuntimeError("build failed")
    assert failing is not None and not failing.parent.exists()
    with secrets.netrc_file([]) as nothing:
        assert nothing is None


def test_build_command_lines_and_definition_hold_no_credential(tmp_path: Path) -> None:
    """The index reaches the build without user:password; the netrc is mounted, never copied."""
    req = _request(torch_index=PRIVATE_INDEX)
    args, creds = build.build_args(req)
    assert args["TORCH_INDEX_URL"] == "http://127.0.0.1:9/simple"
    assert creds == [secrets.Credential("127.0.0.1", "ci-user", SECRET)]
    netrc = tmp_path / "private" / secrets.SECRET_ID
    for builder in ("buildah", "podman", "docker"):
        cmd = build._oci_command(builder, req, tmp_path / "iid", args, netrc)
        assert SECRET not in " ".join(cmd)
        assert cmd[cmd.index("--secret") + 1] == f"id=ctrain-netrc,src={netrc}"
    cmd = build.apptainer_command(req, args, tmp_path / "o.sif", netrc)
    assert SECRET not in " ".join(cmd)
    assert f"{netrc.parent}:/run/secrets:ro" in cmd
    def_args = dict(cmd[i + 1].split("=", 1) for i, word in enumerate(cmd) if word == "--build-arg")
    definition = render_definition(REPO / build.STANDALONE_DEF, def_args)  # what the SIF embeds
    assert SECRET not in definition and 'TORCH_INDEX_URL="http://127.0.0.1:9/simple"' in definition
    assert '"${APPTAINER_ROOTFS}/run/secrets"' in definition  # the bind's mount point
    no_creds = build._oci_command("buildah", _request(), tmp_path / "iid", build.build_args(_request())[0])
    assert "--secret" not in no_creds


def test_dockerfile_mounts_the_netrc_for_the_install_step_only() -> None:
    dockerfile = (REPO / build.DOCKERFILE).read_text()
    mount = f"--mount=type=secret,id={secrets.SECRET_ID},target={secrets.MOUNT_PATH}"
    runs = [block for block in dockerfile.split("\nRUN ")[1:]]
    assert [mount in run for run in runs] == [True, False]  # the deps step; not ctrain's own
    assert "install.sh deps" in runs[0]
    install = (REPO / "containers" / "install.sh").read_text()
    assert f"netrc={secrets.MOUNT_PATH}" in install and 'export NETRC="$netrc"' in install


def _fake_builder(directory: Path, name: str) -> Path:
    """A builder that records its arguments and the secret it was given, echoes the index URL
    with the password (as a tool might), and fails."""
    record = directory / "record"
    fake = directory / name
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {record}\n'
        'for arg; do case "$arg" in id=ctrain-netrc,src=*) src=${arg#id=ctrain-netrc,src=} ;; esac; done\n'
        f'stat -c "%a" "$src" >> {record}; cat "$src" >> {record}\n'
        'read -r _ host _ login _ password < "$src"\n'
        'echo "STEP 3/9: pip: 404 for http://$login:$password@$host:9/simple/torch/"\n'
        "exit 1\n"
    )
    fake.chmod(0o755)
    return record


def test_failing_build_prints_no_credential_and_leaves_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = _fake_builder(bin_dir, "buildah")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(build.tempfile, "tempdir", None)
    lines: list[str] = []
    with pytest.raises(CtrainError) as info:
        build.build(_request(builder="buildah", torch_index=PRIVATE_INDEX), emit=lines.append)
    argv, mode, netrc = record.read_text().split("\n", 2)
    assert SECRET not in argv and mode == "600" and netrc == f"machine 127.0.0.1 login ci-user password {SECRET}\n"
    printed = "\n".join(lines) + str(info.value)
    assert SECRET not in printed and "http://***:***@127.0.0.1:9/simple/torch/" in printed
    assert not list(tmp_path.glob("ctrain-secrets-*"))  # removed although the build failed


def test_a_project_without_its_dockerfile_is_named_not_a_temporary_directory(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    need(shutil.which("buildah") is not None or shutil.which("podman") is not None, "buildah or podman")
    from click.testing import CliRunner

    from ctrain.cli import main

    assert CliRunner().invoke(main, ["init", str(tmp_path / "p")]).exit_code == 0
    (tmp_path / "p" / "containers" / "Dockerfile").unlink()
    monkeypatch.chdir(tmp_path / "p")
    result = CliRunner().invoke(main, ["build", "--builder", "buildah" if shutil.which("buildah") else "podman"])
    assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"error: {tmp_path / 'p' / 'containers' / 'Dockerfile'} is missing" in result.output
    assert "ctrain init --force" in result.output and "ctrain-context-" not in result.output


def test_a_long_copy_says_how_far_it_is_and_how_fast(tmp_path: Path) -> None:
    """ui.file_progress (convert, a push to a path) and push's rsync filter: a line now and then, not
    one before and one after with minutes of nothing between."""
    import time as clock

    from ctrain import ui
    from ctrain.image import push

    target, lines = tmp_path / "image.sif", []
    with ui.file_progress(target, "push", total=4_000_000, every=0.05, emit=lines.append):
        for _ in range(4):
            with target.open("ab") as handle:
                handle.write(bytes(1_000_000))
            clock.sleep(0.2)
    assert lines and all(line.startswith("push: ") and "of 4.0 MB" in line and "/s" in line for line in lines)
    assert lines[-1].startswith("push: 4.0 MB of 4.0 MB (100%)"), lines
    shown: list[str] = []
    original, ui.info = ui.info, shown.append
    try:
        every = push._every(3600, "push: ")
        for text in ("  1,000,000  10%  50.00MB/s    0:00:01", "  2,000,000  20%  50.00MB/s    0:00:01", "sent 2 bytes"):
            every(text)
    finally:
        ui.info = original
    assert shown == ["push: 1,000,000  10%  50.00MB/s    0:00:01", "push: sent 2 bytes"]


@pytest.mark.parametrize("builder", ["buildah", "podman", "docker"])
def test_a_build_for_the_clusters_platform_asks_the_builder_for_it(builder: str, tmp_path: Path) -> None:
    """An Apple-silicon laptop builds for an amd64 cluster with --platform (image.platform)."""
    cmd = build._oci_command(builder, _request(platform="linux/amd64"), tmp_path / "iid", {})
    assert cmd[cmd.index("--platform") + 1] == "linux/amd64"
    assert "--platform" not in build._oci_command(builder, _request(), tmp_path / "iid", {})


@pytest.mark.parametrize(("platform", "builder", "error"), [
    ("amd64", "buildah", "image.platform 'amd64' is not a platform: give OS/ARCH such as linux/amd64"),
    ("linux/amd64;reboot", "buildah", "is not a platform"),
    ("linux/amd64", "apptainer", "Apptainer builds only for this machine's platform"),
])  # fmt: skip
def test_a_platform_that_cannot_be_built_is_one_error(tmp_path: Path, platform: str, builder: str, error: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from click.testing import CliRunner

    from ctrain.cli import main

    (tmp_path / "ctrain.yaml").write_text(f"image:\n  builder: {builder}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(build, "choose", lambda name: name)
    result = CliRunner().invoke(main, ["build", "--platform", platform])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and error in result.stderr, result.output
