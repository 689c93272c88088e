"""``ctrain wheelhouse DIR``: download every wheel the image installs, on a connected machine, so
``ctrain build --wheelhouse DIR`` runs with no network (air-gapped build hosts).

Runs with the current Python: make the wheelhouse with the Python version the image has (3.11 for
the Debian bookworm base, the NGC image's own for the GPU flavour).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

from ctrain import install_hint, proc, resources, ui
from ctrain.errors import CtrainError
from ctrain.files import creatable_dir_problem, make_dirs
from ctrain.image import secrets

CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def fill(
    directory: Path, context: Path, *, torch_index: str | None = CPU_TORCH_INDEX, python: str = sys.executable
) -> list[Path]:
    """Download the pinned wheels into ``directory``; returns the wheels it holds afterwards.

    ``torch_index``: an extra index for torch (the CPU build by default); None uses only what pip
    is configured with. deepspeed is published as a source archive whose build imports torch, so
    it is built into a wheel here, against the torch of ``python``.
    """
    pins = context / "containers" if (context / "containers" / "constraints.txt").is_file() else None
    constraints = (pins or resources.path("containers")) / "constraints.txt"
    requirements = (pins or resources.path("containers")) / "requirements.txt"
    problem = creatable_dir_problem(directory.absolute())
    if problem:
        raise CtrainError(f"cannot fill the wheelhouse {directory}: {problem}: give a directory you can write")
    if python == sys.executable and importlib.util.find_spec("torch") is None:
        raise CtrainError(
            "making a wheelhouse builds deepspeed, whose build imports torch: run this from an environment "
            f"with torch ({install_hint('train')}, or .venv from scripts/setup.sh)"
        )
    with index_access(torch_index) as (index, env):
        make_dirs(directory, "give a wheelhouse directory you can write")
        _download(directory, constraints, requirements, [python, "-m", "pip"], index, env)
    return sorted(directory.glob("*.whl"))


@contextlib.contextmanager
def index_access(torch_index: str | None) -> Iterator[tuple[list[str], dict[str, str] | None]]:
    """pip's options for the extra index, and the environment that logs pip in to it.

    A login in the URL (``https://USER:TOKEN@host/simple``) goes into a private netrc that exists
    while pip runs (pip reads it through ``NETRC``), never onto pip's command line, where ``ps``
    and the process table of a shared login node would show it to every user.
    """
    if not torch_index:
        yield [], None
        return
    url, credential = secrets.split_url(torch_index, "image.torch_index")
    with secrets.netrc_file([credential] if credential else []) as netrc:
        yield ["--extra-index-url", url], ({"NETRC": str(netrc)} if netrc else None)


def _download(
    directory: Path, constraints: Path, requirements: Path, pip: list[str], index: list[str],
    env: dict[str, str] | None,
) -> None:  # fmt: skip
    ui.info(f"wheelhouse: building deepspeed into {directory}")
    # --find-links: a wheel of the pinned deepspeed already there is kept, not built again.
    proc.stream(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--find-links", directory, "-c", constraints, "-w",
         directory, "deepspeed"],  # fmt: skip
        prefix="wheelhouse: ",
        env=env,
    )
    ui.info(f"wheelhouse: downloading the pinned stack into {directory}")
    proc.stream(
        [
            *pip,
            "download",
            "--only-binary=:all:",
            "--find-links",
            directory,
            *index,
            "-c",
            constraints,
            "-r",
            requirements,
            "-d",
            directory,
        ],
        prefix="wheelhouse: ",
        env=env,
    )
