"""Bad input that reaches the real image tools: a conversion into a full disk or a read-only
directory, builds from a base that cannot be pulled or cannot run, pushes to a registry that is not
there. Each ends in one ``error:`` line with nothing left behind (tests/badinput.py), and a failed
build leaves the builder's store as it found it: the same working containers, the same dangling
images.

The image converted and pushed is a tiny one made here with buildah (a 3 MB file, no shell), which
also serves as a base that has nothing to run the Dockerfile's steps with. It lives in a
containers-storage of these tests' own (CONTAINERS_STORAGE_CONF), so builds elsewhere on the machine
neither disturb the before-and-after comparison nor get disturbed by it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from tests.badinput import Case, run_case
from tests.conftest import need, need_root
from tests.plugins.image import REPO

pytestmark = [pytest.mark.integration]

TINY = "localhost/ctrain-badinput:tiny"


@pytest.fixture(scope="module")
def store_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment that points buildah, podman and skopeo at a store of these tests' own."""
    need_root()
    need(shutil.which("buildah") is not None and shutil.which("skopeo") is not None, "buildah and skopeo")
    root = tmp_path_factory.mktemp("storage")
    conf = root / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{root / "graph"}"\nrunroot = "{root / "run"}"\n')
    return {"CONTAINERS_STORAGE_CONF": str(conf)}


def _buildah(env: dict[str, str], *args: str) -> str:
    return subprocess.run(["buildah", *args], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout  # fmt: skip


@pytest.fixture(scope="module")
def tiny_image(store_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 3 MB image with no shell in it, in the tests' own store."""
    blob = tmp_path_factory.mktemp("tiny") / "blob"
    blob.write_bytes(os.urandom(3 << 20))
    container = _buildah(store_env, "from", "scratch").strip()
    try:
        _buildah(store_env, "copy", container, str(blob), "/blob")
        _buildah(store_env, "commit", "--quiet", container, TINY)
    finally:
        _buildah(store_env, "rm", container)
    return TINY


def project(yaml: str = "", *dirs: str) -> object:
    def setup(root: Path) -> None:
        (root / "ctrain.yaml").write_text(f"image:\n  context: {REPO}\n  builder: buildah\n  flavour: cpu\n{yaml}")
        for name in dirs:
            (root / name).mkdir(parents=True)

    return setup


def store_state(env: dict[str, str]) -> tuple[list[str], list[str]]:
    """What a failed build must not change: buildah's working containers and dangling images (IDs;
    the tables say "3 seconds ago", which changes by itself)."""
    containers = _buildah(env, "containers", "--quiet", "--notruncate").split()
    dangling = _buildah(env, "images", "--filter", "dangling=true", "--quiet", "--no-trunc").split()
    return sorted(containers), sorted(dangling)


def conversions(tiny: str, env: dict[str, str]) -> list[Case]:
    cases = [
        Case("convert-full-disk", ["convert", "--image", tiny, "--to", "sqsh", "-o", "full/ctrain.sqsh"],
             ["not enough free space", "free some space", "-o/--output"], project("", "full"),
             full_disk=["full"], exit_code=1),  # fmt: skip
        Case("convert-sif-full-disk", ["convert", "--image", tiny, "--to", "sif", "-o", "full/ctrain.sif"],
             ["not enough free space"], project("", "full"), full_disk=["full"]),  # fmt: skip
        Case("convert-full-output-dir", ["convert", "--image", tiny, "--to", "sqsh"], ["not enough free space"],
             project("convert:\n  output_dir: full/images\n", "full"), full_disk=["full"]),  # fmt: skip
        Case("convert-read-only-output-dir", ["convert", "--image", tiny, "--to", "sqsh"],
             ["not writable", "convert.output_dir"], project("convert:\n  output_dir: ro\n", "ro"),
             read_only=["ro"]),  # fmt: skip
        Case("convert-output-dir-under-read-only", ["convert", "--image", tiny, "--to", "sqsh"],
             ["cannot create", "read-only file system", "convert.output_dir"],
             project("convert:\n  output_dir: ro/images\n", "ro"), read_only=["ro"]),  # fmt: skip
        Case("convert-not-built", ["convert", "--image", "localhost/ctrain-badinput-never-built:1"],
             ["not found", "ctrain build"], project()),  # fmt: skip
        Case("push-unreachable-registry", ["push", "--image", tiny, "--registry", "127.0.0.1:1/team"],
             ["cannot reach the registry 127.0.0.1:1", "--registry"], project()),  # fmt: skip
        Case("push-remote-read-only-before-converting", ["push", "--image", tiny, "--to", "sqsh", "--remote", "ro/"],
             ["not writable"], project("", "ro"), read_only=["ro"]),  # fmt: skip
    ]
    return [replace(case, env=env) for case in cases]


@pytest.mark.parametrize("index", range(8), ids=[c.id for c in conversions(TINY, {})])
def test_bad_conversion_or_push(index: int, tiny_image: str, store_env: dict[str, str], tmp_path: Path) -> None:
    need(shutil.which("unshare") is not None and shutil.which("umoci") is not None, "unshare and umoci")
    run_case(conversions(tiny_image, store_env)[index], tmp_path / "project")


def builds(tiny: str, env: dict[str, str]) -> list[Case]:
    cases = [
        Case("build-unreachable-base", ["build", "--base", "127.0.0.1:1/team/base:1"],
             ["base image 127.0.0.1:1/team/base:1 could not be pulled", "--local-base"], project()),  # fmt: skip
        Case("build-base-not-here", ["build", "--base", "localhost/ctrain-badinput-no-such-base:1"],
             ["could not be pulled", "--local-base"], project()),  # fmt: skip
        Case("build-base-cannot-run-steps", ["build", "--base", tiny], ["the build failed at step", "--base"],
             project(), hang_seconds=360),  # fmt: skip
    ]
    return [replace(case, env=env) for case in cases]


@pytest.mark.parametrize("index", range(3), ids=[c.id for c in builds(TINY, {})])
def test_failed_build_leaves_the_store_as_it_was(index: int, tiny_image: str, store_env: dict[str, str],
                                                  tmp_path: Path) -> None:  # fmt: skip
    before = store_state(store_env)
    run_case(builds(tiny_image, store_env)[index], tmp_path / "project")
    assert store_state(store_env) == before


def test_push_to_an_unreachable_oras_registry_is_one_line(tiny_sif: Path) -> None:
    """Real `apptainer push` of a real SIF to a loopback port where nothing listens, and to an
    address it cannot parse: one line each, saying what to check."""
    from click.testing import CliRunner

    from ctrain.cli import main

    for url, said in (("oras://127.0.0.1:9/team/tiny:1", "error: cannot reach the registry 127.0.0.1:9 ("),
                      ("oras://127.0.0.1:1/x:1", "error: apptainer push to oras://127.0.0.1:1/x:1 failed: ")):  # fmt: skip
        result = CliRunner().invoke(main, ["push", "--oras", url, "--file", str(tiny_sif)])
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code != 0 and len(errors) == 1 and errors[0].startswith(said), result.output
        assert "--oras (push.oras)" in errors[0] or "failed:" in errors[0], result.output
