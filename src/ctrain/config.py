"""The project config, ``ctrain.yaml``: one place for image name, registry, remote path and
cluster settings, so ``ctrain build && ctrain push`` needs no flags.

Found as ``--config PATH``, else ``$CTRAIN_CONFIG``, else ``ctrain.yaml`` in the current directory
or a parent. No file means defaults. Unknown keys are errors listing the valid ones. Each section
belongs to the module that uses it; the dataclasses live here (the ``slurm:`` section's, with the
declaration of each job setting, in :mod:`ctrain.slurmconfig`) so the whole file is validated once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ctrain.errors import ConfigError
from ctrain.jobvalues import (CPU_OPTIONS, MEMORY_OPTIONS, SHORT_OPTIONS, directive_problem,  # noqa: F401
                              env_name_problem, gres_gpus, option_value_problem, sbatch_arg, secret_name,
                              short_option_problem)  # fmt: skip
from ctrain.settings import build, read_settings
from ctrain.slurmconfig import DIRECTIVE_FIELDS, SlurmConfig  # noqa: F401

CONFIG_NAME = "ctrain.yaml"


@dataclass
class ImageConfig:
    """What ``ctrain build`` builds (docs/image.md)."""

    name: str = "ctrain"
    tag: str = "latest"
    # A ctrain checkout (containers/, src/), or a project from `ctrain init`: its containers/ with the
    # installed ctrain's source (image.build.source_context). Relative to this file.
    context: Path = Path(".")
    flavour: Literal["gpu", "cpu"] = "gpu"
    base: str | None = None  # None: the Dockerfile's NGC PyTorch image (gpu); cpu needs one (or --local-base)
    builder: Literal["auto", "docker", "podman", "buildah", "apptainer"] = "auto"
    wheelhouse: Path | None = None  # air-gapped: pip installs only from here (ctrain wheelhouse DIR fills it)
    # cpu flavour with network: the index torch's CPU build comes from; None: download.pytorch.org's
    # CPU index; "none": only what pip is configured with.
    torch_index: str | None = None
    # The cluster's platform (linux/amd64, linux/arm64): what an Apple-silicon laptop must ask for.
    # None: the builder's own, this machine's (docker, podman, buildah; Apptainer builds only that).
    platform: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"

    def validate(self) -> None:
        from ctrain.image.reference import TAG, problem

        if not self.name or any(c in self.name for c in " :@") or problem(self.name):
            why = f": {problem(self.name)}" if self.name and problem(self.name) else ""
            raise ConfigError(
                f"image.name {self.name!r} must be a plain image name (lowercase letters, digits, . _ - and /; no "
                f"spaces, ':' or '@'){why}"
            )
        if self.platform is not None and not PLATFORM.fullmatch(self.platform):
            raise ConfigError(f"image.platform {self.platform!r} is not a platform: give OS/ARCH such as linux/amd64 "
                              "or linux/arm64 (a cluster's nodes: uname -m there)", key="image.platform")  # fmt: skip
        if not self.tag or any(c in self.tag for c in " :/@") or not TAG.fullmatch(self.tag):
            raise ConfigError(
                f"image.tag {self.tag!r} must be a plain tag (up to 128 letters, digits, _ . -, not starting with . "
                "or -; no spaces, ':', '/' or '@')"
            )


#: OS/ARCH[/VARIANT] as the OCI builders take --platform.
PLATFORM = re.compile(r"linux/(?:amd64|arm64|ppc64le|s390x|riscv64|386|arm)(?:/v[5-8])?")


@dataclass
class ConvertConfig:
    """What ``ctrain convert`` writes."""

    to: Literal["sif", "sqsh"] | None = None  # None: what slurm.runtime runs (ProjectConfig.image_format)
    # auto: gzip for SIF (Apptainer's default, readable everywhere), zstd for enroot squashfs.
    compression: Literal["auto", "none", "lzo", "gzip", "zstd", "xz", "lz4"] = "auto"
    output_dir: Path = Path("images")


@dataclass
class PushConfig:
    """Where ``ctrain push`` puts images; each one set is pushed to."""

    registry: str | None = None  # OCI registry and namespace, e.g. ghcr.io/me: pushes NAME:TAG there
    oras: str | None = None  # oras://host/ns/name:tag: the SIF, through apptainer push
    remote: str | None = None  # [user@]host:/shared/images/ or a local path: .sif/.sqsh over rsync+ssh
    ssh_options: list[str] = field(default_factory=list)  # extra ssh arguments, e.g. ["-i", "~/.ssh/hpc"]
    tls_verify: bool | None = None  # None: verify, except for loopback registries (as Docker does)


# ParallelCluster's own limit (pcluster.constants.PCLUSTER_NAME_MAX_LENGTH; a unit test keeps them equal).
CLUSTER_NAME_MAX = 60
_CLUSTER_NAME = re.compile(r"[a-zA-Z][a-zA-Z0-9-]*")
_S3_URI = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?")


@dataclass
class ClusterConfig:
    """What ``ctrain cluster init`` fills into the ParallelCluster template (docs/cluster.md)."""

    name: str = "ctrain"
    region: str | None = None
    config_file: Path = Path("pcluster.yaml")
    template: Path | None = None
    scripts_dir: Path | None = None
    scripts_s3_uri: str | None = None
    os: Literal["alinux2023", "ubuntu2204", "ubuntu2404", "rhel8", "rocky8", "rhel9", "rocky9"] = "ubuntu2204"
    custom_ami: str | None = None
    key_pair: str | None = None
    ssh_key: Path | None = None
    ssh_allowed_ips: str | None = None
    head_node_subnet: str | None = None
    compute_subnet: str | None = None
    head_node_instance_type: str = "m6i.2xlarge"
    gpu_queue: bool = True
    gpu_instance_type: str = "p5.48xlarge"
    gpu_min_nodes: int = 0
    gpu_max_nodes: int = 2
    efa: bool = True
    placement_group: bool | None = None
    capacity_type: Literal["ONDEMAND", "SPOT", "CAPACITY_BLOCK"] = "ONDEMAND"
    capacity_reservation: str | None = None
    cpu_queue: bool = True
    cpu_instance_type: str = "c6i.2xlarge"
    cpu_max_nodes: int = 2
    fsx_id: str | None = None
    fsx_size_gib: int = 1200
    fsx_deployment: Literal["SCRATCH_2", "PERSISTENT_2"] = "SCRATCH_2"
    fsx_throughput: Literal[125, 250, 500, 1000] = 250
    fsx_deletion_policy: Literal["Delete", "Retain"] = "Delete"
    fsx_mount: str = "/fsx"
    local_storage: str = "/scratch"
    enroot_squash_options: str = "-noI -noD -noF -noX -no-duplicates"
    idle_minutes: int = 10
    log_retention_days: int = 14
    tags: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Checks that need no AWS and no ParallelCluster install."""
        if not _CLUSTER_NAME.fullmatch(self.name) or len(self.name) > CLUSTER_NAME_MAX:
            raise ConfigError(
                f"cluster.name {self.name!r}: a cluster name starts with a letter, holds only letters, digits and "
                f"hyphens, and has at most {CLUSTER_NAME_MAX} characters"
            )
        if self.capacity_reservation and self.placement_group:
            raise ConfigError(
                "cluster.placement_group and cluster.capacity_reservation conflict (EC2 launches reserved capacity "
                "outside a new placement group): remove placement_group, it defaults to off with a reservation"
            )
        if self.capacity_type == "CAPACITY_BLOCK" and not self.capacity_reservation:
            raise ConfigError("cluster.capacity_type CAPACITY_BLOCK needs cluster.capacity_reservation (cr-...)")
        if not 0 <= self.gpu_min_nodes <= self.gpu_max_nodes or self.gpu_max_nodes < 1:
            raise ConfigError("cluster: need 0 <= gpu_min_nodes <= gpu_max_nodes and gpu_max_nodes >= 1")
        if self.gpu_queue and self.capacity_type == "CAPACITY_BLOCK" and self.gpu_min_nodes != self.gpu_max_nodes:
            raise ConfigError(
                "cluster.capacity_type CAPACITY_BLOCK: ParallelCluster runs a Capacity Block's nodes for its whole "
                "term, so gpu_min_nodes must equal gpu_max_nodes: set both to the block's instance count"
            )
        if self.cpu_max_nodes < 1:
            raise ConfigError("cluster.cpu_max_nodes must be at least 1")
        if not (self.gpu_queue or self.cpu_queue):
            raise ConfigError("cluster: gpu_queue and cpu_queue are both off; a cluster needs at least one queue")
        if self.fsx_size_gib != _FSX_FIRST_STEP_GIB and (self.fsx_size_gib <= 0 or self.fsx_size_gib % _FSX_STEP_GIB):
            raise ConfigError(
                f"cluster.fsx_size_gib {self.fsx_size_gib}: FSx for Lustre (SSD) sizes are {_FSX_FIRST_STEP_GIB} GiB "
                f"or a multiple of {_FSX_STEP_GIB} GiB"
            )
        if self.scripts_s3_uri is not None and not _S3_URI.fullmatch(self.scripts_s3_uri):
            raise ConfigError(
                f"cluster.scripts_s3_uri {self.scripts_s3_uri!r} must look like s3://BUCKET/PREFIX "
                "(a bucket you own; `ctrain cluster up` uploads the custom-action scripts there)"
            )


# FSx for Lustre SSD capacity steps (https://docs.aws.amazon.com/fsx/latest/LustreGuide/managing-storage-capacity.html).
_FSX_FIRST_STEP_GIB = 1200
_FSX_STEP_GIB = 2400


@dataclass
class ReportConfig:
    """``ctrain report JOB``: the account of a job's time (docs/reliability.md, goodput)."""

    gpu_hour_price: float | None = None  # what one GPU-hour costs: the report adds the job's cost

    def __post_init__(self) -> None:
        if self.gpu_hour_price is not None and not (0 <= self.gpu_hour_price < 1e6):
            raise ConfigError(f"report.gpu_hour_price: {self.gpu_hour_price} is not a price per GPU-hour (0 or more)")


@dataclass
class ProjectConfig:
    """The whole ``ctrain.yaml``."""

    image: ImageConfig = field(default_factory=ImageConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    push: PushConfig = field(default_factory=PushConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    #: Hub repositories every job of the project needs (ORG/NAME, datasets/ORG/NAME, NAME@REVISION):
    #: `ctrain fetch` with no names fetches them, `ctrain submit` refuses a job while one is not cached.
    fetch: list[str] = field(default_factory=list)
    path: Path | None = field(default=None, compare=False)

    @property
    def image_format(self) -> str:
        """What ``ctrain convert`` writes: ``convert.to``, else the runtime's format (Apptainer a SIF,
        pyxis an enroot squashfs), so that ``slurm.runtime`` alone switches a project to pyxis."""
        return self.convert.to or ("sqsh" if self.slurm.runtime == "pyxis" else "sif")

    @property
    def root(self) -> Path:
        """Directory that relative paths in the config are relative to."""
        return self.path.parent if self.path else Path.cwd()

    def resolve(self, p: Path | str) -> Path:
        """A config path made absolute against the config file's directory."""
        p = Path(p).expanduser()
        return p if p.is_absolute() else self.root / p


def find_config(start: Path | None = None) -> Path | None:
    """``$CTRAIN_CONFIG``, else the nearest ``ctrain.yaml`` from ``start`` upwards. Anything by that name
    counts (a directory, a device, a link to nothing): skipping it would run on defaults without a word,
    so :func:`load_config` refuses it instead."""
    env = os.environ.get("CTRAIN_CONFIG")
    if env:
        path = Path(env)
        if not path.is_file():
            raise ConfigError(f"CTRAIN_CONFIG points at {path}, which is not a file")
        return path
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / CONFIG_NAME
        if os.path.lexists(candidate):
            return candidate
    return None


def load_config(path: Path | None = None) -> ProjectConfig:
    """Load and validate the project config (defaults when there is none). Only a regular file is one:
    its directory becomes the project root (``--config /dev/null`` would make it /dev)."""
    path = path or find_config()
    if path is None:
        return ProjectConfig()
    if path.is_dir():
        raise ConfigError(f"the project config {path} is a directory: name its ctrain.yaml")
    if not path.exists():
        broken = " (a symbolic link to nothing)" if path.is_symlink() else ""
        raise ConfigError(f"the project config {path} does not exist{broken}: fix or remove it")
    if not path.is_file():
        raise ConfigError(
            f"the project config {path} is not a regular file (a device, pipe or socket): name a ctrain.yaml"
        )
    source = read_settings(path)
    if "path" in source.data:
        raise ConfigError(f"{path} line {source.line('path')}: 'path' is not a setting")
    config = build(ProjectConfig, source)
    config.path = path.resolve()
    return config
