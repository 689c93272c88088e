"""The project config, ``ctrain.yaml``: one place for image name, registry, remote path and
cluster settings, so ``ctrain build && ctrain push`` needs no flags.

Found as ``--config PATH``, else ``$CTRAIN_CONFIG``, else ``ctrain.yaml`` in the current directory
or a parent. No file means defaults. Unknown keys are errors listing the valid ones. Each section
belongs to the module that uses it; the dataclasses live here so the whole file is validated once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ctrain.errors import ConfigError
from ctrain.settings import from_mapping, load_yaml

CONFIG_NAME = "ctrain.yaml"


@dataclass
class ImageConfig:
    """What ``ctrain build`` builds."""

    name: str = "ctrain"
    tag: str = "latest"
    flavour: Literal["gpu", "cpu"] = "gpu"
    base: str | None = None
    builder: Literal["auto", "docker", "podman", "buildah", "apptainer"] = "auto"
    wheelhouse: Path | None = None


@dataclass
class ConvertConfig:
    """What ``ctrain convert`` writes."""

    to: Literal["sif", "sqsh"] = "sif"
    compression: Literal["none", "lzo", "gzip", "zstd", "xz", "lz4"] = "zstd"
    output_dir: Path = Path("images")


@dataclass
class PushConfig:
    """Where ``ctrain push`` puts images."""

    registry: str | None = None
    oras: str | None = None
    remote: str | None = None


@dataclass
class SlurmConfig:
    """How ``ctrain submit`` runs training through the scripts in ``sbatch/`` (docs/sbatch.md).

    Unset values keep the script's own defaults, so ``sbatch sbatch/NAME.sbatch`` and ``ctrain submit``
    agree; set values become ``#SBATCH`` lines and ``CTRAIN_*`` variables of the submitted script.
    """

    runtime: Literal["apptainer", "pyxis"] = "apptainer"
    script: str | None = None  # a name in sbatch/ or a path; default: RUNTIME or RUNTIME_multinode
    recipe: Path | None = None  # used when the command line names none
    # sbatch options
    job_name: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    ntasks_per_node: int | None = None  # processes per node on nodes without GPUs
    cpus_per_task: int | None = None
    mem: str | None = None
    exclusive: bool = False
    constraint: str | None = None
    signal_lead: int | None = None  # seconds before the time limit that USR1 warns the job
    sbatch_args: list[str] = field(default_factory=list)
    # CTRAIN_* settings of the scripts
    image: str | None = None
    launcher: Literal["torchrun", "accelerate", "deepspeed"] | None = None
    deepspeed_config: Path | None = None
    accelerate_config: Path | None = None
    data: Path | None = None
    hf_cache: Path | None = None
    outputs: Path | None = None
    mounts: list[str] = field(default_factory=list)
    mount_home: bool | None = None
    efa: bool | None = None
    max_requeues: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        from ctrain.submit import check_slurm_config

        check_slurm_config(self)


@dataclass
class ProjectConfig:
    """The whole ``ctrain.yaml``."""

    image: ImageConfig = field(default_factory=ImageConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    push: PushConfig = field(default_factory=PushConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    path: Path | None = field(default=None, compare=False)

    @property
    def root(self) -> Path:
        """Directory that relative paths in the config are relative to."""
        return self.path.parent if self.path else Path.cwd()

    def resolve(self, p: Path | str) -> Path:
        """A config path made absolute against the config file's directory."""
        p = Path(p).expanduser()
        return p if p.is_absolute() else self.root / p


def find_config(start: Path | None = None) -> Path | None:
    """``$CTRAIN_CONFIG``, else the nearest ``ctrain.yaml`` from ``start`` upwards."""
    env = os.environ.get("CTRAIN_CONFIG")
    if env:
        path = Path(env)
        if not path.is_file():
            raise ConfigError(f"CTRAIN_CONFIG points at {path}, which is not a file")
        return path
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / CONFIG_NAME
        if candidate.is_file():
            return candidate
    return None


def load_config(path: Path | None = None) -> ProjectConfig:
    """Load and validate the project config (defaults when there is none)."""
    path = path or find_config()
    if path is None:
        return ProjectConfig()
    data = load_yaml(path)
    if "path" in data:
        raise ConfigError(f"{path}: 'path' is not a setting")
    try:
        config = from_mapping(ProjectConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    config.path = path.resolve()
    return config
