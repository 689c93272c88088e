"""Where ctrain finds its own files: the sbatch scripts and library, the container definitions and
pins, the ParallelCluster template and node scripts, the DeepSpeed/accelerate configs and the recipes.

The repository's top-level ``sbatch/``, ``containers/``, ``cluster/``, ``configs/`` and ``recipes/``
are the one copy of these files. A wheel carries them in ``ctrain/_data/`` (``setup.py`` copies them
there at build time); a checkout (editable install, ``PYTHONPATH=src``) reads them in place. This
module is the only place that knows either layout: every other module asks :func:`path`.
"""

from __future__ import annotations

from pathlib import Path

from ctrain import install_hint
from ctrain.errors import CtrainError

# The top-level directories that ship with ctrain (setup.py's DATA lists the same; a unit test checks).
DIRECTORIES = ("sbatch", "containers", "cluster", "configs", "recipes", "docs")
_PACKAGE = Path(__file__).resolve().parent
_INSTALLED = _PACKAGE / "_data"
_CHECKOUT = _PACKAGE.parents[1]  # src/ctrain -> the repository root


def root() -> Path:
    """The directory holding ctrain's files: the installed package data, else the checkout."""
    if (_INSTALLED / "sbatch").is_dir():
        return _INSTALLED
    if is_checkout():
        return _CHECKOUT
    raise CtrainError(
        f"ctrain's own files (sbatch/, containers/, ...) are missing: neither {_INSTALLED} nor a checkout around "
        f"{_PACKAGE} has them; reinstall ctrain from a wheel ({install_hint()}) or run it from a git checkout"
    )


def is_checkout() -> bool:
    """True when ctrain runs from its source tree (the top-level directories beside src/)."""
    return (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "sbatch").is_dir()


def path(*parts: str) -> Path:
    """One of ctrain's files or directories, e.g. ``path("sbatch", "lib", "ctrain.sh")``."""
    if not parts or parts[0] not in DIRECTORIES:
        raise ValueError(f"ctrain ships only {', '.join(DIRECTORIES)}; asked for {'/'.join(parts)!r}")
    found = root().joinpath(*parts)
    if not found.exists():
        raise CtrainError(f"{found} is missing from this ctrain install: reinstall ctrain")
    return found


def pyproject() -> Path:
    """ctrain's ``pyproject.toml``: what an image build installs ctrain with (``ctrain.image.build.source_context``)."""
    found = root() / "pyproject.toml"
    if not found.is_file():
        raise CtrainError(f"{found} is missing from this ctrain install: reinstall ctrain")
    return found


def package_dir() -> Path:
    """The ``ctrain`` package directory this process runs (installed, or ``src/ctrain`` of a checkout)."""
    return _PACKAGE


def files(directory: str) -> list[Path]:
    """Every file under one shipped directory, relative to :func:`root`, sorted (no caches)."""
    top = path(directory)
    base = root()
    return sorted(
        p.relative_to(base)
        for p in top.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def display(p: Path) -> str:
    """A path as users know it: relative to ctrain's file root (``cluster/pcluster.yaml``) where it is inside."""
    try:
        return str(p.relative_to(root()))
    except (ValueError, CtrainError):
        return str(p)
