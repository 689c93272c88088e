"""Cluster profiles and the SSH runner against awkward settings and surroundings: ``~/`` in a profile,
a runtime directory that is gone, files that are no files of ctrain's."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ctrain import remote
from ctrain.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "clusters.yaml"
    path.write_text(text)
    return path


def _record(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every command ssh and rsync would run, answered with success."""
    calls: list[list[str]] = []

    def run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(remote.proc, "run", run)
    return calls


def test_a_home_relative_project_dir_is_the_same_directory_for_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``project_dir: ~/proj`` is proj under the home directory on the cluster, for mkdir, rsync and the job's
    ``cd`` alike; quoted as written, it would be a directory named ``~``."""
    path = _write(tmp_path, "clusters:\n  a: {host: login, project_dir: ~/proj}\n"
                            "  b: {host: login, project_dir: '~', images_dir: ~/img}\n"
                            "  c: {host: login, project_dir: ~/-p}\n")  # fmt: skip
    a = remote.resolve("a", path)
    assert a is not None and (a.profile.project_dir, a.images_dir) == ("proj", "proj/images")
    b = remote.resolve("b", path)
    assert b is not None and (b.profile.project_dir, b.images_dir) == (".", "img")
    c = remote.resolve("c", path)
    assert c is not None and c.profile.project_dir == "./-p"  # never read as an option
    calls = _record(monkeypatch)
    said: list[str] = []
    root = tmp_path / "project"
    root.mkdir()
    ssh = remote.Ssh(a, tmp_path)
    remote.sync_project(ssh, root, emit=said.append)
    ssh.run(["sbatch", "job.sbatch"], cwd=Path(a.profile.project_dir))
    assert calls[0][-1] == "mkdir -p -- proj"
    assert calls[1][0] == "rsync" and calls[1][-1] == "login:proj/"
    assert calls[2][-1] == "cd proj && sbatch job.sbatch"
    assert not any("~" in arg for call in calls for arg in call)
    assert said == ["cluster a: 0 project file(s) sent to ~/proj (all up to date)"]


@pytest.mark.parametrize(
    ("directory", "said"),
    [
        ("~bob/proj", "~NAME means another user's home, which ctrain does not look up: write the absolute path"),
        ('"/shared/p\\n"', "contains a control character"),
    ],
)
def test_directories_ssh_would_misread_are_named(tmp_path: Path, directory: str, said: str) -> None:
    with pytest.raises(ConfigError, match="'clusters.a.project_dir' is ") as err:
        remote.load_profiles(_write(tmp_path, f"clusters:\n  a: {{host: h, project_dir: {directory}}}\n"))
    assert said in str(err.value)


@pytest.mark.parametrize("runtime", ["gone", "file"])
def test_a_runtime_dir_that_is_gone_falls_back_to_a_private_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    """$XDG_RUNTIME_DIR left over from another session (su, sudo, a container): ssh's sockets go to a
    private directory in /tmp instead of a traceback."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / runtime))
    ssh = remote.Ssh(remote.Cluster("x", remote.Profile(host="login")))
    assert ssh.control_dir == Path(f"/tmp/ctrain-ssh-{os.getuid()}")
    info = ssh.control_dir.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def test_a_jobs_file_too_large_to_be_ctrains_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """jobs.json is read within a bound: one far larger than the newest 1000 jobs is left unread."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    remote.record_job("other", "7")
    assert "submitted from here to cluster other" in remote.elsewhere("7", None)
    padding = {str(i): ["c" * 100] for i in range(50_000)}
    remote.jobs_path().write_text(json.dumps({"7": ["other"], **padding}))
    assert remote.jobs_path().stat().st_size > remote.MAX_JOBS_BYTES
    assert remote.elsewhere("7", None) == ""


def _login_shell(monkeypatch: pytest.MonkeyPatch, home: Path, cwd: Path) -> list[str]:
    """ssh stood in for by the login shell it starts: each remote command string run by ``sh -c`` with HOME."""
    commands: list[str] = []

    def run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        commands.append(argv[-1])
        env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        return subprocess.run(["sh", "-c", argv[-1]], env=env, cwd=cwd, capture_output=True, text=True, check=False)

    monkeypatch.setattr(remote.proc, "run", run)
    return commands


@pytest.mark.parametrize("ctrain", ["~/.local/bin/ctrain", "~/my tools/$x/ctrain"])
def test_a_home_relative_ctrain_is_run_from_the_home_on_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctrain: str
) -> None:
    """``ctrain: ~/.local/bin/ctrain`` (pipx's place) runs that file under the home on the cluster, from any
    directory; quoted as written, the remote shell would look for a directory named ``~``."""
    home = tmp_path / "home"
    script = home / ctrain.removeprefix("~/")
    script.parent.mkdir(parents=True)
    script.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "ctrain, version 9.9" || echo "$@"\n')
    script.chmod(0o755)
    elsewhere = tmp_path / "project"
    elsewhere.mkdir()
    cluster = remote.resolve("a", _write(tmp_path, f"clusters:\n  a: {{host: login, ctrain: '{ctrain}'}}\n"))
    assert cluster is not None and cluster.profile.ctrain == ctrain
    commands = _login_shell(monkeypatch, home, elsewhere)
    remote.check_ctrain(remote.Ssh(cluster, tmp_path), "9.9")
    assert commands[0].startswith('"$HOME"/')
    command = remote.ctrain_command(cluster, ["submit", "a b", "$HOME"])
    done = subprocess.run(["sh", "-c", command], env={"HOME": str(home)}, cwd=elsewhere, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert done.stdout == "submit a b $HOME\n"


def test_a_ctrain_command_on_the_path_is_quoted_as_before(tmp_path: Path) -> None:
    """A command name or an absolute path is one quoted word; only a leading ``~/`` (or ``~USER/``) is the shell's."""
    def command(ctrain: str) -> str:
        return remote.ctrain_command(remote.Cluster("a", remote.Profile(host="h", ctrain=ctrain)), ["--version"])

    assert command("ctrain") == "ctrain --version"
    assert command("/opt/my env/bin/ctrain") == "'/opt/my env/bin/ctrain' --version"
    assert command("~bob/bin/ctrain") == "~bob/bin/ctrain --version"
    assert command("~$(id)/ctrain") == "'~$(id)/ctrain' --version"
    assert command("x~/ctrain") == "'x~/ctrain' --version"
