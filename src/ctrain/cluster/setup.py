"""What every ``ctrain cluster`` command shares: the ``Setup`` (``cluster:`` settings with flags applied),
shipped files, the region, and where the ``pcluster`` CLI and its Python live."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctrain import proc, resources
from ctrain.config import ClusterConfig, ProjectConfig
from ctrain.errors import ConfigError, ToolNotFound
from ctrain.settings import override

TEMPLATE_NAME = "pcluster.yaml"
SCRIPTS_NAME = "scripts"


@dataclass(frozen=True)
class Setup:
    """The ``cluster:`` settings (after flags) and the directory their relative paths start from."""

    settings: ClusterConfig
    root: Path
    runtime: str = "apptainer"  # the project's slurm.runtime: what the cluster must run its jobs with

    def path(self, p: Path | str) -> Path:
        p = Path(p).expanduser()
        return p if p.is_absolute() else self.root / p

    @property
    def config_file(self) -> Path:
        """The filled ParallelCluster config that ``init`` writes and the other commands read."""
        return self.path(self.settings.config_file)

    @property
    def template(self) -> Path:
        return self.path(self.settings.template) if self.settings.template else _shipped(TEMPLATE_NAME)

    @property
    def scripts_dir(self) -> Path:
        return self.path(self.settings.scripts_dir) if self.settings.scripts_dir else _shipped(SCRIPTS_NAME)

    @property
    def scripts_uri(self) -> str | None:
        """``cluster.scripts_s3_uri`` without a trailing slash."""
        uri = self.settings.scripts_s3_uri
        return uri.rstrip("/") if uri else None

    def display(self, p: Path) -> str:
        """A path as users know it: relative to the project or to ctrain's files where possible."""
        try:
            return str(p.relative_to(self.root))
        except ValueError:
            return resources.display(p)


def _shipped(name: str) -> Path:
    """The template or scripts ctrain ships in cluster/ (cluster.template / cluster.scripts_dir replace them)."""
    return resources.path("cluster", name)


def load(project: ProjectConfig, overrides: Mapping[str, Any] | None = None) -> Setup:
    """The project's ``cluster:`` section with ``overrides`` (flags, ``--set``) applied and validated again."""
    return Setup(override(project.cluster, overrides or {}, where="cluster"), project.root, project.slurm.runtime)


def region(setup: Setup, config: Mapping[str, Any] | None = None) -> str:
    """``cluster.region``, else the config file's ``Region``, else the AWS environment's default."""
    found = setup.settings.region or (config or {}).get("Region")
    found = found or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not found:
        raise ConfigError("no AWS region: set cluster.region in ctrain.yaml, pass --region, or export AWS_REGION")
    return str(found)


def pcluster_bin() -> str:
    """The ``pcluster`` CLI: on PATH, else next to this Python (a virtual environment not activated)."""
    return proc.require("pcluster")


def pcluster_python() -> str:
    """A Python that can import ParallelCluster's library: this one, else the one the CLI runs on."""
    if importlib.util.find_spec("pcluster") is not None:
        return sys.executable
    exe = pcluster_bin()
    with open(exe, "rb") as fh:
        first = fh.readline(512)
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if words and Path(words[0]).name == "env":
        words = [found for found in [shutil.which(words[1])] if found] if len(words) > 1 else []
    if words and Path(words[0]).is_file():
        return words[0]
    raise ToolNotFound(f"cannot tell which Python runs {exe}; {proc.TOOLS['pcluster'].hint}")


def helper(script: Path, *args: str | os.PathLike[str]) -> list[str]:
    """argv running one of ctrain's standalone helper scripts with pcluster's Python.

    ``-I`` (isolated mode) keeps the script's own directory off ``sys.path``: it holds ctrain's
    ``pcluster.py``, which would otherwise shadow the ``pcluster`` package.
    """
    return [pcluster_python(), "-I", str(script), *map(str, args)]
