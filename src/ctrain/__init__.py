"""ctrain: container-first training of Hugging Face models on Slurm clusters."""

from __future__ import annotations

__version__ = "0.1.0"

#: The name ctrain is installed under (``pip install ctrain-slurm``); the command and the import
#: stay ``ctrain``. The index's ``ctrain`` is another project.
DISTRIBUTION = "ctrain-slurm"


def install_hint(extras: str = "", version: str | None = None, tool: str = "pip") -> str:
    """The install command a message tells the user to run, e.g. ``pip install 'ctrain-slurm[train]'``."""
    spec = f"{DISTRIBUTION}[{extras}]" if extras else DISTRIBUTION
    if version:
        spec += f"=={version}"
    return f"{tool} install '{spec}'" if extras else f"{tool} install {spec}"
