"""``ctrain wheelhouse DIR``: download every wheel the image installs, on a connected machine, so
``ctrain build --wheelhouse DIR`` runs with no network (air-gapped build hosts).

Runs with the current Python: make the wheelhouse with the Python version the image has (3.11 for
the Debian bookworm base, the NGC image's own for the GPU flavour).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ctrain import proc, resources, ui
from ctrain.errors import CtrainError
from ctrain.files import creatable_dir_problem, make_dirs

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
            "with torch (pip install 'ctrain[train]', or .venv from scripts/setup.sh)"
        )
    make_dirs(directory, "give a wheelhouse directory you can write")
    pip = [python, "-m", "pip"]
    index = ["--extra-index-url", torch_index] if torch_index else []
    ui.info(f"wheelhouse: building deepspeed into {directory}")
    proc.stream(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-c", constraints, "-w", directory, "deepspeed"],
        prefix="wheelhouse: ",
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
    )
    return sorted(directory.glob("*.whl"))
