"""Fixtures for driving the testbed from "a laptop": an OpenSSH server on the testbed's login host.

The login host is the testbed's controller address on its bridge (the machine itself, where
Slurm's commands and the shared directory are); the test process reaches it over the testbed's
network, as the job user, with a key made for the session, the way a user's laptop reaches a
cluster's login node. Nothing of the system's ssh configuration is used on either side.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml

from ctrain import resources
from ctrain.testbed.plan import CONTROLLER_IP

LOGIN_ADDRESS = str(CONTROLLER_IP)
REPO = Path(__file__).resolve().parents[2]
from tests.conftest import need, need_root
from tests.plugins.image import _stop, free_port, wait_for_port


@dataclass(frozen=True)
class LoginHost:
    """sshd on ``host:port`` for ``user``; ``key`` logs in, ``known_hosts`` knows the host key.
    On ``bare_port`` the same sshd gives sessions a PATH without Slurm's commands."""

    host: str
    port: int
    bare_port: int
    user: str
    key: Path
    known_hosts: Path
    directory: Path

    def profile(self, **changes: object) -> dict[str, object]:
        """A clusters.yaml profile for this login host (``changes`` on top)."""
        profile: dict[str, object] = {
            "host": self.host, "port": self.port, "user": self.user, "identity_file": str(self.key),
            "ssh_options": ["-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes"],
        }  # fmt: skip
        profile.update(changes)
        return profile


@pytest.fixture(scope="session")
def login_host(testbed) -> Iterator[LoginHost]:
    """Debian's sshd on the testbed's controller address, a free port, for the job user only."""
    need_root()
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    need(Path(sshd).exists() and shutil.which("ssh-keygen") is not None, "openssh-server")
    # Not under pytest's root-only temporary directory: sshd reads the keys file as the user.
    directory = Path(tempfile.mkdtemp(prefix="ctrain-login-sshd-", dir="/var/tmp"))
    for key in ("host_key", "user_key", "other_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / key)], check=True)
    keys = directory / "authorized_keys"
    keys.write_text((directory / "user_key.pub").read_text())
    keys.chmod(0o644)
    os.chmod(directory, 0o755)  # sshd reads the keys file as the user
    port = free_port(LOGIN_ADDRESS)
    bare_port = free_port(LOGIN_ADDRESS)
    (directory / "sshd_config").write_text(
        f"Port {port}\nListenAddress {LOGIN_ADDRESS}\nHostKey {directory / 'host_key'}\n"
        f"PidFile {directory / 'sshd.pid'}\nAuthorizedKeysFile {keys}\nAllowUsers {testbed.user}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin no\nUsePAM yes\n"
        "StrictModes no\n"
        # A second port whose sessions have no Slurm on their PATH: a login node without it (a module not loaded).
        f"Port {bare_port}\nMatch LocalPort {bare_port}\n    SetEnv PATH=/nonexistent\n"
    )
    host_key = (directory / "host_key.pub").read_text().split()
    known = directory / "known_hosts"
    known.write_text("".join(f"[{LOGIN_ADDRESS}]:{p} {host_key[0]} {host_key[1]}\n" for p in (port, bare_port)))
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    with open(directory / "sshd.log", "wb") as log:
        server = subprocess.Popen([sshd, "-D", "-e", "-f", str(directory / "sshd_config")], stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for_port(port, server, "sshd", host=LOGIN_ADDRESS)
        pwd.getpwnam(testbed.user)
        wait_for_port(bare_port, server, "sshd", host=LOGIN_ADDRESS)
        yield LoginHost(LOGIN_ADDRESS, port, bare_port, testbed.user, directory / "user_key", known, directory)
    finally:
        _stop(server)
        shutil.rmtree(directory, ignore_errors=True)


def user_ctrain(directory: Path) -> Path:
    """ctrain as installed on the cluster, for the job user: this checkout's source and the two
    packages a login node's ctrain imports (click, PyYAML), copied where that user can read them
    (the checkout and its venv may not be), run by the system's Python."""
    launcher = directory / "bin" / "ctrain"
    if launcher.exists():  # made for an earlier test of the session
        return launcher
    python = shutil.which("python3", path="/usr/bin:/bin")
    need(python is not None, "python3 in /usr/bin (apt-get install python3)")
    lib = directory / "lib"
    shutil.copytree(REPO / "src" / "ctrain", lib / "ctrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in resources.DIRECTORIES:  # ctrain's own files, where a wheel puts them (setup.py)
        shutil.copytree(REPO / name, lib / "ctrain" / "_data" / name, ignore=shutil.ignore_patterns("__pycache__"))
    for module in (click, yaml):
        shutil.copytree(Path(module.__file__).parent, lib / module.__name__,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    launcher.parent.mkdir(mode=0o755, exist_ok=True)
    launcher.write_text(f"#!/bin/sh\nPYTHONPATH={lib} exec {python} -m ctrain \"$@\"\n")
    for path in (directory / "bin", lib, *lib.rglob("*")):
        path.chmod(0o755 if path.is_dir() or path == launcher else 0o644)
    launcher.chmod(0o755)
    return launcher
