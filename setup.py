"""Build hook: map the repository's top-level data directories into the wheel as ``ctrain/_data/``.

They stay where users read and run them (``sbatch sbatch/pyxis_multinode.sbatch`` from a checkout);
the wheel gets a copy made at build time, so there is one copy of the truth. Directories that are
absent (the image's build context has only ``src/``) are skipped. ``ctrain.resources`` finds them.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DATA = ("sbatch", "containers", "cluster", "configs", "recipes", "docs")
# The build description itself: `ctrain build` from an installed ctrain stages it with the source.
DATA_FILES = ("pyproject.toml",)
HERE = Path(__file__).resolve().parent


class BuildPyWithData(build_py):
    """``build_py`` that also copies DATA into ``build/lib/ctrain/_data/`` (not for editable installs,
    which read the checkout in place)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "ctrain" / "_data"
        for name in DATA:
            source = HERE / name
            if source.is_dir():
                shutil.rmtree(target / name, ignore_errors=True)
                shutil.copytree(source, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in DATA_FILES:
            if (HERE / name).is_file():
                shutil.copy2(HERE / name, target / name)


setup(cmdclass={"build_py": BuildPyWithData})
