"""Hostile input to the image commands, run for real: ``ctrain cache clear`` given a directory that
is no image cache, values that reach the image's build definition as text, outputs that would
replace files ctrain did not write (a recipe, a FIFO), and remote paths a shell on the far side
would read. The remote cases run real rsync over an ``ssh`` that hands its command to a shell on
this machine, as ssh hands it to the login shell on the other."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import ctrain
from ctrain.errors import ConfigError, CtrainError
from ctrain.image import build, push
from ctrain.image.build import BuildRequest
from tests.conftest import need

REPO = Path(__file__).resolve().parents[2]
SIF = b"#!/usr/bin/env run-singularity\n\0SIF_MAGIC0\x01" + b"\0" * 64
SQSH = b"hsqs" + b"\0" * 64
RECIPE = "model: {name: tiny}\ntraining: {max_steps: 1}\n"
# The ctrain these tests import, for the CLI run as a subprocess from another directory.
SOURCE = str(Path(ctrain.__file__).resolve().parents[1])


def ctrain_cli(cwd: Path, *args: str, env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``ctrain ARGS`` in ``cwd``, as a user runs it."""
    full = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": SOURCE, **(env or {})}
    full.pop("CTRAIN_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "ctrain", *args], cwd=cwd, env=full, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)  # fmt: skip


def one_error(result: subprocess.CompletedProcess[str], *says: str) -> str:
    """The one ``error:`` line of a refused command, which says each of ``says``."""
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and "Traceback" not in output, output
    for text in says:
        assert text in errors[0], output
    return errors[0]


def tree(root: Path) -> dict[str, tuple[str, bytes]]:
    """Every path under ``root`` with its kind and (for a file) its bytes: what must not change."""
    found: dict[str, tuple[str, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            mode = path.lstat().st_mode
            kind = "dir" if stat.S_ISDIR(mode) else "link" if stat.S_ISLNK(mode) else "fifo" if stat.S_ISFIFO(
                mode) else "file"  # fmt: skip
            found[str(path.relative_to(root))] = (kind, path.read_bytes() if kind == "file" else b"")
    return found


# --- ctrain cache clear: only the cache's entries -------------------------------------------------


def a_project(root: Path) -> Path:
    """A project's files, as `ctrain init` lays them out (the directory given by mistake)."""
    files = {"ctrain.yaml": "image: {}\n", "configs/zero2.json": "{}\n", "containers/Dockerfile": "FROM x\n",
             "docs/notes.md": "# notes\n", "recipes/demo.yaml": RECIPE, "sbatch/lib/ctrain.sh": "#!/bin/bash\n",
             "outputs/run-1/model.safetensors": "weights"}  # fmt: skip
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("how", ["--dir", "CTRAIN_IMAGE_CACHE"])
def test_cache_clear_refuses_a_directory_that_is_no_cache_and_removes_nothing(tmp_path: Path, how: str) -> None:
    project = a_project(tmp_path / "project")
    before = tree(project)
    args, env = (["--dir", str(project)], {}) if how == "--dir" else ([], {"CTRAIN_IMAGE_CACHE": str(project)})
    result = ctrain_cli(tmp_path, "cache", "clear", *args, env=env)
    one_error(result, "is not an image cache", "nothing was removed", "--dir or CTRAIN_IMAGE_CACHE")
    assert tree(project) == before  # every directory still there, and no lock file left in it


def test_cache_clear_removes_entries_and_leaves_everything_else(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ready, half = cache / "0123456789abcdef", cache / "fedcba9876543210"
    (ready / "rootfs" / "usr" / "bin").mkdir(parents=True)
    for name, text in {"complete": "", "used": "", "image": "/images/a.sif\n", "size-kib": "12\n"}.items():
        (ready / name).write_text(text)
    (ready / "rootfs" / "usr").chmod(0o555)  # as an unpacked image leaves its directories
    (half / "rootfs").mkdir(parents=True)
    (cache / "lock").write_text("")
    # Not entries: a key-named directory holding a file of someone else's, other directories and
    # files, and a key-named link to a directory outside the cache.
    (cache / "00000000aaaaaaaa").mkdir()
    (cache / "00000000aaaaaaaa" / "thesis.tex").write_text("years of work")
    a_project(cache / "project")
    (cache / "README").write_text("mine")
    outside = a_project(tmp_path / "outside")
    (cache / "1111111111111111").symlink_to(outside, target_is_directory=True)
    kept = {k: v for k, v in tree(cache).items() if not k.startswith((ready.name, half.name))}
    outside_before = tree(outside)
    result = ctrain_cli(tmp_path, "cache", "clear", "--dir", str(cache))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not ready.exists() and not half.exists()
    assert tree(cache) == kept and tree(outside) == outside_before
    for name in ("00000000aaaaaaaa", "project", "README", "1111111111111111"):
        assert f"left {name!r}: not an image cache entry" in result.stdout, result.stdout
    assert "2 removed, 0 in use, 4 left alone" in result.stderr


def test_a_cache_lock_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "0123456789abcdef" / "rootfs").mkdir(parents=True)
    os.mkfifo(cache / "lock")
    one_error(ctrain_cli(tmp_path, "cache", "clear", "--dir", str(cache), timeout=30), "lock", "not a regular file")
    assert (cache / "0123456789abcdef" / "rootfs").is_dir() and stat.S_ISFIFO((cache / "lock").lstat().st_mode)


def test_cache_clear_of_a_directory_that_does_not_exist_is_an_error_unless_it_is_the_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A mistyped --dir or CTRAIN_IMAGE_CACHE clears nothing: one error line (exit 2, as other usage
    errors), not a quiet success. The default place, where no job has unpacked an image yet, has
    nothing to clear, and says so. Nothing is made anywhere."""
    monkeypatch.delenv("CTRAIN_IMAGE_CACHE", raising=False)
    missing = tmp_path / "no-such-cache"
    result = ctrain_cli(tmp_path, "cache", "clear", "--dir", str(missing))
    assert result.returncode == 2, result
    one_error(result, f"the image cache {missing} (--dir) does not exist")
    result = ctrain_cli(tmp_path, "cache", "clear", env={"CTRAIN_IMAGE_CACHE": str(missing)})
    assert result.returncode == 2, result
    one_error(result, f"the image cache {missing} (CTRAIN_IMAGE_CACHE) does not exist")
    result = ctrain_cli(tmp_path, "cache", "clear", env={"APPTAINER_TMPDIR": str(tmp_path)})
    assert result.returncode == 0 and result.stdout == "", result
    default = tmp_path / f"ctrain-images-{os.getuid()}"
    assert result.stderr.startswith(f"nothing to clear: {default} does not exist (") and result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_the_conversion_and_cache_locks_refuse_what_is_no_lock_file(tmp_path: Path) -> None:
    """Both locks are opened by one helper (files.open_lock; how each waits differs): a link, a FIFO
    or a directory where the lock goes is one error naming that lock, and is left as it was."""
    from ctrain import files
    from ctrain.image import cache, convert

    assert convert.open_lock is files.open_lock and cache.open_lock is files.open_lock
    (tmp_path / "target").write_text("someone's")
    locks = {tmp_path / ".c.sqsh.lock": (lambda: convert._locked(tmp_path / "c.sqsh", print), "the conversion lock"),
             tmp_path / "lock": (lambda: cache._locked(tmp_path), "the image cache's lock")}  # fmt: skip
    for make, kind in ((lambda p: p.symlink_to(tmp_path / "target"), stat.S_ISLNK), (os.mkfifo, stat.S_ISFIFO),
                       (Path.mkdir, stat.S_ISDIR)):  # fmt: skip
        for lock, (take, what) in locks.items():
            make(lock)
            with pytest.raises(CtrainError, match=f"^{what} {re.escape(str(lock))} is not a regular file"):
                with take():
                    pass
            assert kind(lock.lstat().st_mode), lock
            if kind is stat.S_ISDIR:
                lock.rmdir()
            else:
                lock.unlink()
    assert (tmp_path / "target").read_text() == "someone's"
    for lock, (take, _) in locks.items():
        with take():
            assert stat.S_ISREG(lock.lstat().st_mode)
    assert not (tmp_path / ".c.sqsh.lock").exists() and (tmp_path / "lock").is_file()  # the conversion's goes


# --- values that reach the build definition ------------------------------------------------------


def _request(**kw: object) -> BuildRequest:
    defaults: dict[str, object] = {"context": REPO, "ref": "ctrain:cpu", "flavour": "cpu", "base": "localhost/base:1"}
    return BuildRequest(**{**defaults, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("index", "says"),
    [
        ("https://x.example/$(touch /tmp/ctrain-pwned)", "contains '$'"),
        ("https://x.example/`id`", "contains '`'"),
        ('https://x.example/simple"; touch /tmp/p; "', "contains '\"'"),
        ("https://x.example/a;b", "contains ';'"),
        ("https://x.example/a\\b", "contains '\\\\'"),
        ("https://x.example/a b", "contains ' '"),
        ("https://x.example/a\nb", "contains '\\n'"),
        ("ftp://x.example/simple", "is not an index URL"),
        ("https:///simple", "is not an index URL"),
        ("x.example/simple", "is not an index URL"),
    ],
)
def test_a_torch_index_that_the_definition_would_run_is_refused(index: str, says: str) -> None:
    with pytest.raises(ConfigError, match="image.torch_index") as info:
        build.build_args(_request(torch_index=index))
    assert says in str(info.value) and "http(s)" in str(info.value)
    for usable, reaches in USABLE_INDEXES.items():  # while every usable index still reaches the build
        assert build.build_args(_request(torch_index=usable))[0]["TORCH_INDEX_URL"] == reaches


USABLE_INDEXES = {
    "https://download.pytorch.org/whl/cpu": "https://download.pytorch.org/whl/cpu",
    "http://127.0.0.1:9/simple?a=1&b=%20": "http://127.0.0.1:9/simple?a=1&b=%20",
    "https://me:pa$$w;rd@pypi.example.org/simple/": "https://pypi.example.org/simple/",  # the login goes to a netrc
    "none": "none",
}


@pytest.mark.parametrize("base", ["oci:///tmp/layout\n%post\n    touch /tmp/ctrain-pwned", "library://u/c/i:1$(id)",
                                  'oci-archive:///tmp/a"b.tar'])  # fmt: skip
def test_a_base_the_definition_would_read_as_more_is_refused(tmp_path: Path, base: str) -> None:
    with pytest.raises(ConfigError, match=r"image.base \(--base\)"):
        build.build_args(_request(base=base))
    with pytest.raises(ConfigError, match=r"image.base \(--base\)"):
        build.apptainer_command(_request(base=base, builder="apptainer"), {}, tmp_path / "o.sif")


def test_a_version_from_the_build_context_is_checked_too(tmp_path: Path) -> None:
    (tmp_path / "src" / "ctrain").mkdir(parents=True)
    (tmp_path / "src" / "ctrain" / "__init__.py").write_text('__version__ = "1.0$(touch /tmp/ctrain-pwned)"\n')
    with pytest.raises(ConfigError, match="__version__ in src/ctrain/__init__.py"):
        build.build_args(_request(context=tmp_path))


def test_a_wheelhouse_apptainer_would_bind_as_more_than_one_path_is_refused(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels,/etc"
    with pytest.raises(ConfigError, match="Apptainer's --bind cannot take a path with ':', ','"):
        build.apptainer_command(_request(wheelhouse=wheels, builder="apptainer"), {}, tmp_path / "o.sif")


# --- outputs that would replace files ctrain did not write ---------------------------------------


@pytest.fixture
def sif_project(tmp_path: Path) -> Path:
    """A project whose image is a SIF the Apptainer builder made (converting it is a copy)."""
    project = tmp_path / "project"
    (project / "images").mkdir(parents=True)
    (project / "recipes").mkdir()
    (project / "ctrain.yaml").write_text("image:\n  builder: apptainer\n")
    (project / "images" / "ctrain-latest.sif").write_bytes(SIF + b"image")
    (project / "recipes" / "demo.yaml").write_text(RECIPE)
    (project / "empty.sif").write_bytes(b"")
    (project / "other.sif").write_bytes(SQSH)
    os.mkfifo(project / "pipe.sif")
    return project


@pytest.mark.parametrize(
    ("output", "says"),
    [
        ("recipes/demo.yaml", "is no container image"),
        ("pipe.sif", "is not a regular file"),
        ("empty.sif", "is an empty file"),
        ("other.sif", "is an enroot squashfs, not a SIF"),
    ],
)
def test_convert_never_writes_over_a_file_it_did_not_write(sif_project: Path, output: str, says: str) -> None:
    before = tree(sif_project)
    one_error(ctrain_cli(sif_project, "convert", "--to", "sif", "-o", output), says, "-o/--output")
    assert tree(sif_project) == before
    (sif_project / "images" / "old.sif").write_bytes(SIF + b"older")  # an older image of its kind it replaces
    result = ctrain_cli(sif_project, "convert", "--to", "sif", "-o", "images/old.sif")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (sif_project / "images" / "old.sif").read_bytes() == SIF + b"image"


@pytest.mark.parametrize(
    ("remote", "says"),
    [
        ("recipes/demo.yaml", "is no container image"),
        ("pipe.sif", "is not a regular file"),
        ("other.sif", "is an enroot squashfs, not a SIF"),
    ],
)
def test_push_never_writes_over_a_file_it_did_not_write(sif_project: Path, remote: str, says: str) -> None:
    before = tree(sif_project)
    result = ctrain_cli(sif_project, "push", "--file", "images/ctrain-latest.sif", "--remote", remote)
    one_error(result, says, "--remote")
    assert tree(sif_project) == before


def test_push_refuses_a_fifo_as_its_file_at_once(sif_project: Path) -> None:
    (sif_project / "shared").mkdir()
    result = ctrain_cli(sif_project, "push", "--file", "pipe.sif", "--remote", "shared/", timeout=30)
    one_error(result, "pipe.sif is not a regular file")
    assert not any((sif_project / "shared").iterdir())


# --- a remote over ssh: paths reach the far side as arguments -----------------------------------

FAKE_SSH = """#!/bin/sh
# ssh to this machine as ssh does it: the words after the host, joined by spaces, run by a shell.
while [ $# -gt 0 ]; do
    case $1 in
        -[oplieF]) shift 2 ;;
        -*) shift ;;
        *) shift; break ;;
    esac
done
[ "$1" = "--" ] && shift
exec sh -c "$*"
"""


@pytest.fixture
def over_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``localhost:PATH`` remotes reach this machine through a shell, with real rsync; returns a SIF."""
    need(shutil.which("rsync") is not None, "rsync")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    sif = tmp_path / "ctrain.sif"
    sif.write_bytes(SIF.ljust(128, b"\0") + os.urandom(4096))  # a header whose data section (0 bytes) fits
    return sif


def test_push_over_ssh_passes_the_remote_path_as_an_argument(over_ssh: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Even where the user's environment asks rsync for its old, shell-read arguments."""
    monkeypatch.setenv("RSYNC_OLD_ARGS", "1")
    monkeypatch.chdir(tmp_path)  # where the far side's shell runs
    marker = tmp_path / "pwned"
    shared = tmp_path / "x$(touch pwned)y"
    shared.mkdir()
    pushed = push.push_files([over_ssh], f"localhost:{shared}/", emit=lambda line: None)
    assert pushed == [f"localhost:{shared}/ctrain.sif"]
    assert (shared / "ctrain.sif").read_bytes() == over_ssh.read_bytes()
    assert not marker.exists()


@pytest.mark.parametrize("name", ["demo.yaml", "pipe.sif"])
def test_push_over_ssh_keeps_a_remote_file_it_did_not_write(over_ssh: Path, tmp_path: Path, name: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "demo.yaml").write_text(RECIPE)
    os.mkfifo(shared / "pipe.sif")
    before = tree(shared)
    with pytest.raises(CtrainError, match=f"localhost:{re.escape(str(shared / name))} (exists and is no container "
                                          "image|is not a regular file)"):  # fmt: skip
        push.push_files([over_ssh], f"localhost:{shared / name}", emit=lambda line: None)
    assert tree(shared) == before
    push.push_files([over_ssh], f"localhost:{shared}/", emit=lambda line: None)  # a new name is fine
    assert (shared / "ctrain.sif").read_bytes() == over_ssh.read_bytes()


@pytest.mark.parametrize(
    ("remote", "says"),
    [
        ("login:-oProxyCommand=touch /tmp/p", "starts with '-'"),
        ("login:/images/\n/etc", "control character"),
        ("ssh://login/images/\x1b[2J", "control character"),
        ("/shared/images\r/", "control character"),
    ],
)
def test_remote_paths_a_command_would_misread_are_refused(remote: str, says: str) -> None:
    with pytest.raises(ConfigError, match="remote") as info:
        push.Remote.parse(remote)
    assert says in str(info.value)


def _real_images(where: Path) -> dict[str, Path]:
    """A SIF made by Apptainer's own SIF tool and a squashfs by mksquashfs, each holding 256 KiB that
    does not compress: real headers, at a size a test can copy and cut."""
    need(shutil.which("apptainer") is not None and shutil.which("mksquashfs") is not None, "apptainer, mksquashfs")
    payload = where / "payload"
    payload.mkdir()
    (payload / "data").write_bytes(os.urandom(256 << 10))
    sif, sqsh = where / "demo.sif", where / "demo.sqsh"
    subprocess.run(["apptainer", "sif", "new", str(sif)], check=True, capture_output=True)
    subprocess.run(["apptainer", "sif", "add", "--datatype", "4", "--partfs", "1", "--parttype", "1", "--partarch",
                    "2", str(sif), str(payload / "data")], check=True, capture_output=True)  # fmt: skip
    subprocess.run(["mksquashfs", str(payload), str(sqsh), "-quiet", "-no-progress"], check=True, capture_output=True)
    return {"apptainer": sif, "pyxis": sqsh}


@pytest.mark.parametrize("runtime", ["apptainer", "pyxis"])
def test_an_image_cut_short_is_refused_before_it_is_queued_or_pushed(tmp_path: Path, runtime: str) -> None:
    """An interrupted copy keeps the image's first bytes, so its format still reads right; the job would
    then fail on every node, after the queue. The header says how long the image is: a SIF's data
    section, a squashfs's bytes_used. An intact image passes, one cut short is one error at submit and
    at push."""
    from ctrain.jobs import submit

    image = _real_images(tmp_path)[runtime]
    submit.check_image(str(image), runtime, tmp_path)
    assert push.check_source(image) == ("sif" if runtime == "apptainer" else "sqsh")
    size = image.stat().st_size
    with image.open("r+b") as f:
        f.truncate(size - 8192)
    with pytest.raises(ConfigError, match=rf"image {re.escape(str(image))} is cut short \({size - 8192:,} bytes where "
                                          r"its header says [\d,]+\): an interrupted copy"):  # fmt: skip
        submit.check_image(str(image), runtime, tmp_path)
    with pytest.raises(ConfigError, match=r"is cut short \(.*\): an interrupted copy or conversion; make it again"):
        push.check_source(image)
