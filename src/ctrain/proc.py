"""The one way ctrain runs external programs.

Every external binary goes through :func:`run` or :func:`stream`: argument lists only (never a
shell), the program looked up before it is started (a missing one raises :class:`ToolNotFound`
with an install hint), and a failure raises :class:`CommandError` carrying the command and stderr.
Whatever of a command this layer shows (the command itself, streamed output lines, an error's
tail) has credentials masked (:mod:`ctrain.redact`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ctrain import install_hint
from ctrain.errors import CommandError, ToolNotFound
from ctrain.redact import redact


@dataclass(frozen=True)
class Tool:
    """An external program: the binaries that provide it (first found wins) and how to get one."""

    names: tuple[str, ...]
    hint: str


_APT = "apt-get install {}"

#: rsync's environment wherever ctrain runs it, with --protect-args: a remote path reaches the far
#: rsync as an argument, never through its login shell. rsync's own default protects it only from
#: 3.2.4 on, and not where the user's environment asks for the old passing (RSYNC_OLD_ARGS), set aside here.
RSYNC_ENV = {"RSYNC_OLD_ARGS": "0", "RSYNC_PROTECT_ARGS": "1"}
TOOLS: dict[str, Tool] = {
    "apptainer": Tool(
        ("apptainer", "singularity"),
        "install Apptainer (https://apptainer.org/docs/admin/main/installation.html); on Debian "
        "`ctrain testbed up` installs it from Debian sid; on a cluster try `module load apptainer`",
    ),
    "buildah": Tool(("buildah",), _APT.format("buildah")),
    "podman": Tool(("podman",), _APT.format("podman")),
    "docker": Tool(("docker",), "install Docker Engine (https://docs.docker.com/engine/install/)"),
    "skopeo": Tool(("skopeo",), _APT.format("skopeo")),
    "umoci": Tool(("umoci",), _APT.format("umoci")),
    "git": Tool(("git",), _APT.format("git")),
    "tar": Tool(("tar",), _APT.format("tar")),
    "mksquashfs": Tool(("mksquashfs",), _APT.format("squashfs-tools")),
    "unsquashfs": Tool(("unsquashfs",), _APT.format("squashfs-tools")),
    "debootstrap": Tool(("debootstrap",), _APT.format("debootstrap")),
    "enroot": Tool(("enroot",), "install enroot (https://github.com/NVIDIA/enroot/blob/master/doc/installation.md)"),
    "rsync": Tool(("rsync",), _APT.format("rsync")),
    "ssh": Tool(("ssh",), _APT.format("openssh-client")),
    "sbatch": Tool(("sbatch",), _APT.format("slurm-client") + ", or run on the cluster's login node"),
    "srun": Tool(("srun",), _APT.format("slurm-client") + ", or run on the cluster's login node"),
    "squeue": Tool(("squeue",), _APT.format("slurm-client") + ", or run on the cluster's login node"),
    "sacct": Tool(("sacct",), _APT.format("slurm-client") + ", or run on the cluster's login node"),
    "scancel": Tool(("scancel",), _APT.format("slurm-client") + ", or run on the cluster's login node"),
    "scontrol": Tool(("scontrol",), _APT.format("slurm-client") + ", or run on the cluster's login node"),
    "sinfo": Tool(("sinfo",), _APT.format("slurm-client") + ", or run on the cluster's login node"),
    "slurmctld": Tool(("slurmctld",), _APT.format("slurmctld")),
    "slurmd": Tool(("slurmd",), _APT.format("slurmd")),
    "munged": Tool(("munged",), _APT.format("munge")),
    "nvidia-smi": Tool(("nvidia-smi",), "install the NVIDIA driver (nvidia-smi comes with it)"),
    "pcluster": Tool(("pcluster",), f"{install_hint('aws')} (AWS ParallelCluster CLI)"),
    "apt-get": Tool(("apt-get",), "this needs a Debian or Ubuntu machine"),
    "ip": Tool(("ip",), _APT.format("iproute2")),
    "nsenter": Tool(("nsenter",), _APT.format("util-linux")),
    "unshare": Tool(("unshare",), _APT.format("util-linux")),
    "setpriv": Tool(("setpriv",), _APT.format("util-linux")),
    "useradd": Tool(("useradd",), _APT.format("passwd")),
    "hostname": Tool(("hostname",), _APT.format("hostname")),
    "dpkg-deb": Tool(("dpkg-deb",), "this needs a Debian or Ubuntu machine (dpkg)"),
    "registry": Tool(("docker-registry", "registry"), _APT.format("docker-registry")),
}


def which(tool: str) -> str | None:
    """Path of the first binary providing ``tool``, or None.

    Looks on PATH, then beside the running Python, so console scripts of a virtual environment
    that is not activated (``.venv/bin/ctrain ...``) still find their sibling tools.
    """
    spec = TOOLS.get(tool)
    here = os.path.dirname(sys.executable)
    for name in spec.names if spec else (tool,):
        path = shutil.which(name) or shutil.which(name, path=here)
        if path:
            return path
    return None


def require(tool: str) -> str:
    """Path of ``tool``, or raise :class:`ToolNotFound` saying how to install it."""
    path = which(tool)
    if path:
        return path
    spec = TOOLS.get(tool)
    names = " or ".join(f"`{n}`" for n in spec.names) if spec else f"`{tool}`"
    hint = spec.hint if spec else "install it and make sure it is on PATH"
    raise ToolNotFound(f"{names} not found on PATH: {hint}")


def _resolve(args: Sequence[str | os.PathLike[str]]) -> list[str]:
    if not args:
        raise ValueError("empty command")
    argv = [os.fspath(a) for a in args]
    if os.sep not in argv[0]:
        argv[0] = require(argv[0])
    return argv


def _env(env: Mapping[str, str] | None) -> dict[str, str] | None:
    return None if env is None else {**os.environ, **env}


def run(
    args: Sequence[str | os.PathLike[str]],
    *,
    check: bool = True,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    binary: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """Run a program to completion and capture its output (text; bytes with ``binary``).

    ``env`` adds to (does not replace) the current environment.
    """
    argv = _resolve(args)
    try:
        proc = subprocess.run(
            argv,
            check=False,
            input=input,
            capture_output=True,
            text=not binary,
            env=_env(env),
            cwd=cwd,
            timeout=timeout,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        # from None: TimeoutExpired's own message is the unmasked command line
        raise CommandError(argv, -1, f"timed out after {timeout}s\n{_text(exc.stderr)}") from None
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, _text(proc.stderr), _text(proc.stdout))
    return proc


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def stream(
    args: Sequence[str | os.PathLike[str]],
    *,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    on_line: Callable[[str], None] | None = None,
    prefix: str = "",
    tail: int = 60,
) -> int:
    """Run a long program, passing each output line (stdout and stderr merged) to ``on_line``.

    By default lines are echoed to stderr with ``prefix`` so users can follow progress. On
    failure the last ``tail`` lines go into the :class:`CommandError`. Lines have credentials
    masked before anyone sees them (a tool may echo a URL with a password).
    """
    argv = _resolve(args)
    last: deque[str] = deque(maxlen=tail)
    emit = on_line or (lambda line: print(prefix + line, file=sys.stderr, flush=True))
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        env=_env(env),
        cwd=cwd,
    ) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = redact(raw.rstrip("\n"))
            last.append(line)
            emit(line)
        code = proc.wait()
    if check and code != 0:
        raise CommandError(argv, code, "\n".join(last))
    return code
