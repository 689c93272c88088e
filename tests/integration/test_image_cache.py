"""The node-local image cache with real Apptainer, as the job user, without Slurm: the library's
per-node script (CTRAIN_IMAGE_PREPARE) and `ctrain cache`. The testbed runs it inside jobs
(tests/integration/test_sbatch.py: reuse across jobs, eviction, a held entry kept)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain.cli import main
from ctrain.image import cache as image_cache
from tests.plugins.image import as_user

pytestmark = pytest.mark.integration

LIB = Path(__file__).resolve().parents[2] / "sbatch" / "lib" / "ctrain.sh"


def library(user: str, code: str, *args: str | Path, check: bool = False) -> subprocess.CompletedProcess[str]:
    """``code`` run by bash as ``user`` after sourcing the sbatch library, with ``args`` as "$@"."""
    return as_user(user, ["bash", "-c", f"source {LIB}; {code}", "ctrain-test", *map(str, args)], check=check)


def prepare(user: str, cache: Path, image: Path, limit_gib: int = 50) -> subprocess.CompletedProcess[str]:
    """One node's preparation, as ctrain_image_cache runs it on every node of a job."""
    return library(user, 'sh -c "$CTRAIN_IMAGE_PREPARE" ctrain-on-node "$@"', cache, image,
                   key(user, image), limit_gib)  # fmt: skip


def key(user: str, image: Path) -> str:
    return library(user, 'ctrain_image_key "$1"', image, check=True).stdout.strip()


def test_key_follows_the_image_file_not_its_path(image_user: str, tiny_sif: Path, user_tmp: Path) -> None:
    copy = user_tmp / "copy.sif"
    as_user(image_user, ["cp", tiny_sif, copy])
    assert re.fullmatch(r"[0-9a-f]{16}", key(image_user, tiny_sif))
    assert key(image_user, copy) == key(image_user, tiny_sif)
    as_user(image_user, ["sh", "-c", f"printf x >>{copy}"])  # a changed file is a new entry
    assert key(image_user, copy) != key(image_user, tiny_sif)
    assert key(image_user, user_tmp / "missing.sif") == "unread"


def test_two_jobs_on_a_node_unpack_once_and_a_later_one_reuses_it(image_user: str, tiny_sif: Path,
                                                                  user_tmp: Path) -> None:  # fmt: skip
    cache = user_tmp / "cache"
    both = [subprocess.Popen(["runuser", "-u", image_user, "--", "bash", "-c",
                              f'source {LIB}; sh -c "$CTRAIN_IMAGE_PREPARE" x "$@"', "x", str(cache), str(tiny_sif),
                              key(image_user, tiny_sif), "50"], stdout=subprocess.PIPE, text=True, cwd="/")
            for _ in range(2)]  # fmt: skip
    outputs = [process.communicate(timeout=120)[0] for process in both]
    assert [process.returncode for process in both] == [0, 0], outputs
    assert sum(" unpacked " in out for out in outputs) == 1, outputs
    assert sum(" the image is cached in " in out for out in outputs) == 1, outputs
    entry = cache / key(image_user, tiny_sif)
    assert (entry / "rootfs" / "etc" / "hello").read_text() == "hello\n"
    assert (entry / "image").read_text() == f"{tiny_sif}\n"
    later = prepare(image_user, cache, tiny_sif)
    assert later.returncode == 0 and f"the image is cached in {entry}" in later.stdout, later
    # The container runs the unpacked copy.
    ran = as_user(image_user, ["apptainer", "exec", "--no-home", entry / "rootfs", "sh", "-c", "read x </etc/hello; echo $x"])
    assert ran.stdout == "hello\n", ran


def test_an_image_that_does_not_unpack_leaves_no_entry(image_user: str, user_tmp: Path) -> None:
    bad = user_tmp / "bad.sif"
    bad.write_bytes(b"not a SIF\n" * 100)
    bad.chmod(0o644)
    result = prepare(image_user, user_tmp / "cache", bad)
    assert result.returncode == 1
    assert re.search(rf"^ctrain: \S+: could not unpack {re.escape(str(bad))} into ", result.stderr, re.M), result.stderr
    assert list((user_tmp / "cache").iterdir()) == [user_tmp / "cache" / "lock"]


def test_cache_clear_keeps_what_a_running_task_holds(image_user: str, tiny_sif: Path, user_tmp: Path) -> None:
    cache = user_tmp / "cache"
    assert prepare(image_user, cache, tiny_sif).returncode == 0
    entry = cache / key(image_user, tiny_sif)
    half = cache / "0123456789abcdef"
    (half / "rootfs").mkdir(parents=True)
    # A task as the library starts it: the hold, then the container (a shell in the image that
    # waits for input that never comes).
    task = subprocess.Popen(["runuser", "-u", image_user, "--", "bash", "-c",
                             f'source {LIB}; exec sh -c "$CTRAIN_IMAGE_HOLD" ctrain-image "$@"', "x", str(entry),
                             "apptainer", "exec", "--no-home", str(entry / "rootfs"), "sh", "-c", "read x"],
                            cwd="/", stdin=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        deadline = 50
        while not image_cache.entries(cache)[-1].in_use and deadline:
            subprocess.run(["sleep", "0.2"], check=True)
            deadline -= 1
        listed = {entry.key: entry for entry in image_cache.entries(cache)}
        assert listed[entry.name].in_use and listed[entry.name].complete, listed
        assert not listed[half.name].complete
        cleared = CliRunner().invoke(main, ["cache", "clear", "--dir", str(cache)])
        assert cleared.exit_code == 0, cleared.output
        assert f"removed {half.name}" in cleared.output
        assert f"kept {entry.name}: in use by a running job" in cleared.output
        assert (entry / "rootfs" / "etc" / "hello").is_file() and not half.exists()
    finally:
        os.killpg(task.pid, signal.SIGKILL)  # the task and its container, as Slurm ends a step
        task.wait()
        while subprocess.run(["pgrep", "-s", str(task.pid)], capture_output=True).returncode == 0:
            subprocess.run(["sleep", "0.1"], check=True)
    cleared = CliRunner().invoke(main, ["cache", "clear", "--dir", str(cache)])
    assert f"removed {entry.name} ({tiny_sif})" in cleared.output and not entry.exists(), cleared.output


def test_a_task_whose_entry_is_gone_says_so(image_user: str, user_tmp: Path) -> None:
    result = library(image_user, 'sh -c "$CTRAIN_IMAGE_HOLD" ctrain-image "$@"', user_tmp / "gone", "true")
    assert result.returncode == 1
    assert f"the cached image {user_tmp / 'gone'} is gone (removed while the job started); submit again" in result.stderr


def test_default_directory_is_the_librarys(image_user: str) -> None:
    """`ctrain cache` looks where the sbatch library puts the cache, for each way of setting it."""
    for env in ({}, {"TMPDIR": "/scratch/t"}, {"APPTAINER_TMPDIR": "/a", "TMPDIR": "/t"}, {"CTRAIN_IMAGE_CACHE": "/c"}):
        exported = "".join(f"export {name}={value}; " for name, value in env.items())
        shown = library("root", f'{exported}ctrain_settings apptainer; echo "$CTRAIN_IMAGE_CACHE"',
                        check=True).stdout.strip()  # fmt: skip
        assert shown == str(image_cache.default_dir(env)), env
