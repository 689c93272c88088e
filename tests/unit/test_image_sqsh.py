"""The enroot image conventions ctrain writes into a squashfs (``ctrain.image.sqsh``)."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from ctrain.config import ConvertConfig
from ctrain.image import sqsh
from tests.plugins.image import assert_golden

# The config of the training image as buildah writes it (trimmed to what enroot reads).
IMAGE_CONFIG = {
    "architecture": "amd64",
    "config": {
        "Env": [
            "PATH=/opt/ctrain/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONUNBUFFERED=1",
            "HF_HOME=/hf_home",
        ],
        "Entrypoint": ["/opt/ctrain/venv/bin/ctrain"],
        "Cmd": ["--help"],
        "WorkingDir": "/workspace",
        "Labels": {"org.opencontainers.image.title": "ctrain", "org.opencontainers.image.version": "0.1.0"},
        "Volumes": {"/outputs": {}, "/data": {}, "/hf_home": {}},
    },
}


@pytest.mark.parametrize("name", ["environment", "rc", "rc.local", "fstab"])
def test_enroot_files_match_golden(name: str) -> None:
    assert_golden(f"enroot-{name}", sqsh.enroot_files(IMAGE_CONFIG)[f"etc/{name}"])


def test_rc_runs_entrypoint_with_arguments_or_cmd(tmp_path: Path) -> None:
    """The generated /etc/rc, run by sh as enroot does, execs entrypoint + args, else entrypoint + Cmd."""
    config = {"config": {"Entrypoint": ["/bin/echo", "it's"], "Cmd": ["default"], "WorkingDir": str(tmp_path / "w")}}
    rc = tmp_path / "rc"
    rc.write_text(sqsh.enroot_files(config)["etc/rc"])
    with_args = subprocess.run(["sh", str(rc), "a b", "c"], capture_output=True, text=True, check=True)
    assert with_args.stdout == "it's a b c\n"
    without = subprocess.run(["sh", str(rc)], capture_output=True, text=True, check=True)
    assert without.stdout == "it's default\n"
    assert (tmp_path / "w").is_dir()  # rc creates and enters WorkingDir


def test_no_entrypoint_no_cmd_starts_a_shell() -> None:
    rc = sqsh.enroot_files({"config": {}})["etc/rc"]
    assert 'cd "/" && unset OLDPWD || exit 1' in rc
    assert "exec  '/bin/sh'" in rc
    assert sqsh.enroot_files({"config": {}})["etc/fstab"] == ""


def test_configure_writes_files_empties_dev_and_fixes_permissions(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "environment").write_text("OLD=1\n")
    (rootfs / "dev" / "pts").mkdir(parents=True)
    (rootfs / "dev" / "null").write_text("")
    (rootfs / ".dockerenv").write_text("")
    locked = rootfs / "usr" / "locked"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    (locked / "f").chmod(0o000)
    locked.chmod(0o555)
    sqsh.configure(rootfs, IMAGE_CONFIG)
    assert (rootfs / "etc" / "environment").read_text() == sqsh.enroot_files(IMAGE_CONFIG)["etc/environment"]
    assert (rootfs / "workspace").is_dir()
    assert list((rootfs / "dev").iterdir()) == []
    assert not (rootfs / ".dockerenv").exists()
    assert stat.S_IMODE(locked.stat().st_mode) & 0o700 == 0o700
    assert (locked / "f").stat().st_mode & stat.S_IRUSR
    for name in ("rc", "rc.local", "fstab", "environment"):
        assert stat.S_IMODE((rootfs / "etc" / name).stat().st_mode) == 0o644


def test_squash_options_cover_every_configurable_compression() -> None:
    choices = set(get_args(get_type_hints(ConvertConfig)["compression"])) - {"auto"}
    assert choices == set(sqsh.SQUASH_OPTIONS)
    assert sqsh.SQUASH_OPTIONS["none"] == ("-noI", "-noD", "-noF", "-noX")
