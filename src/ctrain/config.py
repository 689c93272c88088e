"""The project config, ``ctrain.yaml``: one place for image name, registry, remote path and
cluster settings, so ``ctrain build && ctrain push`` needs no flags.

Found as ``--config PATH``, else ``$CTRAIN_CONFIG``, else ``ctrain.yaml`` in the current directory
or a parent. No file means defaults. Unknown keys are errors listing the valid ones. Each section
belongs to the module that uses it; the dataclasses live here so the whole file is validated once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ctrain.errors import ConfigError
from ctrain.files import control_problem, name_problem, shorten
from ctrain.slurm import time_seconds
from ctrain.settings import build, read_settings

CONFIG_NAME = "ctrain.yaml"


# What slurm.env, slurm.mounts may hold: variable names (none that looks like a secret: the values
# are written into the job script) and HOST:CONTAINER[:ro|rw] bind mounts.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PASS_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
# A name is a secret's when one of its _-separated words is one of these (HF_TOKEN, AWS_SECRET_ACCESS_KEY) or two
# neighbours are (WANDB_API_KEY): whole words, so TOKENIZERS_PARALLELISM and MAX_TOKENS are no secrets. A name that
# ends in one of _NOT_SECRET (HF_TOKEN_PATH) names where a secret is, not the secret.
_SECRET_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY", "ACCESSKEY", "CREDENTIAL",
                           "CREDENTIALS", "PRIVATEKEY"})  # fmt: skip
_SECRET_PAIRS = frozenset({("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY")})
_NOT_SECRET = frozenset({"PATH", "FILE", "DIR", "HOME"})
_MOUNT = re.compile(r"[^:,]+:/[^:,]*(?::(?:ro|rw))?")
# Variables bash or the dynamic loader act on (a file sourced at every bash start, options, functions,
# the trace prompt's command substitutions, libraries loaded into every program): set in the job script,
# or in the bash that resolves its settings at submit, they would run code of their own. PATH and
# LD_LIBRARY_PATH stay allowed: jobs need them, and ctrain resolves the settings without them.
_SHELL_ENV = {"ENV": "a file every POSIX shell sources", "SHELLOPTS": "bash's options",
              "PS4": "the trace prompt, expanded as shell", "IFS": "how bash splits words",
              "PROMPT_COMMAND": "a command bash runs", "CDPATH": "where cd looks",
              "GLOBIGNORE": "how bash expands file names", "BASHOPTS": "bash's options"}  # fmt: skip
_SHELL_ENV_PREFIXES = {
    "BASH_": "bash's own variables (BASH_ENV: a file bash sources at every start; BASH_FUNC_*: functions)",
    "LD_": "the dynamic loader's variables (LD_PRELOAD: a library in every program)",
}
_ENV_ALLOWED = ("LD_LIBRARY_PATH",)
# Slurm's memory sizes (--mem, --mem-per-cpu, --mem-per-gpu): megabytes, or a number with K, M, G or T, which
# may be followed by B (64GB), in either case.
_MEMORY = re.compile(r"[0-9]{1,15}(?:[KMGTkmgt][Bb]?)?")
_SIZE = "a size in megabytes, or a number with K, M, G or T (an optional B after it: 64GB)"
# The options that size a job's memory and CPUs: sbatch takes one of each group.
MEMORY_OPTIONS = ("mem", "mem-per-cpu", "mem-per-gpu")
CPU_OPTIONS = ("cpus-per-task", "cpus-per-gpu")
# sbatch's one-letter options, by their long names (sbatch --help): sbatch_args take the long form only.
SHORT_OPTIONS = {"A": "account", "b": "begin", "C": "constraint", "c": "cpus-per-task", "D": "chdir",
                 "d": "dependency", "e": "error", "G": "gpus", "H": "hold", "i": "input", "J": "job-name",
                 "k": "no-kill", "L": "licenses", "M": "clusters", "m": "distribution", "N": "nodes", "n": "ntasks",
                 "o": "output", "O": "overcommit", "p": "partition", "q": "qos", "Q": "quiet", "S": "core-spec",
                 "s": "oversubscribe", "t": "time", "W": "wait", "w": "nodelist", "x": "exclude"}  # fmt: skip
# sbatch_args options whose values ctrain reads (the world size, the CPUs per GPU, the time-limit
# warning): the value's pattern, and what it must be.
_COUNT = re.compile(r"[0-9]{1,9}")
_OPTION_VALUES: dict[str, tuple[re.Pattern[str], str]] = {
    "nodes": (re.compile(r"[0-9]{1,9}(?:-[0-9]{1,9})?"), "a number of nodes (4) or a range (2-4)"),
    "gpus-per-node": (re.compile(r"(?:[A-Za-z0-9_.-]+:)?[0-9]{1,9}"), "a number of GPUs, or TYPE:NUMBER (h100:8)"),
    "gpus": (re.compile(r"(?:[A-Za-z0-9_.-]+:)?[0-9]{1,9}"), "a number of GPUs for the job, or TYPE:NUMBER (h100:16)"),
    "gres": (re.compile(r"[A-Za-z0-9_./:-]+(?:,[A-Za-z0-9_./:-]+)*"),
             "a list of NAME[:TYPE][:COUNT] (gpu:8, gpu:h100:8)"),
    "ntasks-per-node": (_COUNT, "a number of tasks"),
    "cpus-per-task": (_COUNT, "a number of CPUs"),
    "cpus-per-gpu": (_COUNT, "a number of CPUs"),
    "mem": (_MEMORY, f"{_SIZE} (500G; 0: all of a node's memory)"),
    "mem-per-cpu": (_MEMORY, f"{_SIZE} (4G)"),
    "mem-per-gpu": (_MEMORY, f"{_SIZE} (80G)"),
}
# What an #SBATCH line's value may hold: what Slurm's names, lists, constraints, sizes and times are
# made of. Never whitespace, quotes, $, `, ;, <, >, \ or control characters: sbatch splits the line
# at whitespace, and a newline would end it and start a command of the job script.
_DIRECTIVE_VALUE = re.compile(r"[A-Za-z0-9_.,:@+%&|!()\[\]*=/~^{}-]+")
_DIRECTIVE_CHARS = "letters, digits and _.,:@+%&|!()[]*=/~^{}-"
# Options whose values may hold spaces (free text, a name, a constraint expression): their #SBATCH line writes such a
# value in double quotes, which sbatch reads as one value and removes. Never a quote inside: sbatch would end the value.
SPACED_OPTIONS = ("comment", "job-name", "constraint")
_SPACED_VALUE = re.compile(r"[A-Za-z0-9_.,:@+%&|!()\[\]*=/~^{} -]+")
_SBATCH_ARG = re.compile(r"--?([A-Za-z][A-Za-z0-9-]*)(?:=(.*))?", re.DOTALL)
# sbatch options whose value is an #SBATCH line's (slurm.KEY -> the option).
DIRECTIVE_FIELDS = {"job_name": "job-name", "partition": "partition", "account": "account", "qos": "qos",
                    "time": "time", "mem": "mem", "constraint": "constraint"}  # fmt: skip
# Paths and words that reach the job script as quoted shell (exports, arguments): any text but
# control characters, which no file name needs and which would make the script lie when shown.
_SHELL_FIELDS = ("script", "image", "deepspeed_config", "accelerate_config", "data", "hf_cache", "outputs", "recipe")
# Mounted as SRC:DST in a comma-separated list: neither separator may be in the host path.
_MOUNT_SOURCES = ("data", "hf_cache", "outputs")


def env_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a variable of slurm.env (:data:`_SHELL_ENV`), else None."""
    if name in _ENV_ALLOWED:
        return None
    if name in _SHELL_ENV:
        return f"is read by bash ({_SHELL_ENV[name]})"
    prefix = next((p for p in _SHELL_ENV_PREFIXES if name.startswith(p)), None)
    return f"is one of {_SHELL_ENV_PREFIXES[prefix]}" if prefix else None


def short_option_problem(arg: str) -> str | None:
    """Why ``arg`` (an sbatch_args entry) must be written out, with its long form; None for a long option.
    ``-N4`` would be rendered ``#SBATCH --N4`` and escape the checks of --nodes."""
    if arg.startswith("--") or not arg.startswith("-") or len(arg) < 2:
        return None
    long = SHORT_OPTIONS.get(arg[1])
    if long is None:
        return "is a short option: write its long form (sbatch --help lists them), e.g. --qos=high"
    value = arg[2:].lstrip("=")
    return f"is a short option: write the long form, --{long}{'=' + value if value else ''}"


def option_value_problem(option: str, value: str | None) -> str | None:
    """Why ``value`` is not one sbatch takes for ``option`` (those ctrain reads: :data:`_OPTION_VALUES`), else None."""
    if option not in _OPTION_VALUES:
        return None
    pattern, what = _OPTION_VALUES[option]
    if value is None:
        return f"needs a value: {what}"
    if not pattern.fullmatch(value):
        return f"is not {what}"
    if option == "gres":
        try:
            gres_gpus(value)
        except ConfigError as exc:
            return str(exc)
    return None


def gres_gpus(value: str) -> int | None:
    """GPUs per node a ``--gres`` list asks for (``gpu``, ``gpu:8``, ``gpu:h100:8``, beside other resources), as
    sbatch reads it; None when it asks for none. A ConfigError for a ``gpu`` entry sbatch would not read."""
    total = None
    for item in value.split(","):
        parts = item.removeprefix("gres/").split(":")
        if parts[0] != "gpu":
            continue
        if len(parts) == 1 or (len(parts) == 2 and not _COUNT.fullmatch(parts[1])):
            count = "1"  # gpu, gpu:TYPE: one
        else:
            count = parts[-1] if len(parts) <= 3 else ""
        if not _COUNT.fullmatch(count):
            raise ConfigError(f"--gres entry {shorten(item)!r} is not gpu[:TYPE][:COUNT] (gpu:8, gpu:h100:8)")
        total = (total or 0) + int(count)
    return total


def secret_name(name: str) -> bool:
    """Whether variable ``name`` looks like a secret's (:data:`_SECRET_WORDS`), compared word by word."""
    words = [word for word in name.upper().split("_") if word]
    if not words or words[-1] in _NOT_SECRET:
        return False
    return any(word in _SECRET_WORDS for word in words) or any(pair in _SECRET_PAIRS for pair in zip(words, words[1:]))


def sbatch_arg(arg: str) -> tuple[str, str | None] | None:
    """An sbatch_args entry as (option, value), with one pair of double quotes around the value removed as sbatch
    removes them (``--comment="my run"``); None when it is no ``--option[=value]``."""
    match = _SBATCH_ARG.fullmatch(arg)
    if not match:
        return None
    value = match[2]
    if value is not None and len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return match[1], value


def directive_problem(value: str, option: str | None = None) -> str | None:
    """Why ``value`` cannot be the value of an ``#SBATCH --OPTION=VALUE`` line, else None; spaces only for
    :data:`SPACED_OPTIONS`, which the line quotes."""
    allowed = _SPACED_VALUE if option in SPACED_OPTIONS else _DIRECTIVE_VALUE
    if allowed.fullmatch(value) and value.strip():
        return None
    if '"' in value:
        return "contains a double quote (\"), which sbatch reads as quoting: write the value without it"
    bad = next((char for char in value if not allowed.fullmatch(char)), "")
    if bad == " ":
        return f"contains a space; only {', '.join('--' + o for o in SPACED_OPTIONS)} take values with spaces"
    return f"contains {bad!r}; an sbatch option's value here may hold {_DIRECTIVE_CHARS} only" if bad else "is empty"


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
        if not self.tag or any(c in self.tag for c in " :/@") or not TAG.fullmatch(self.tag):
            raise ConfigError(
                f"image.tag {self.tag!r} must be a plain tag (up to 128 letters, digits, _ . -, not starting with . "
                "or -; no spaces, ':', '/' or '@')"
            )


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
    hang_timeout: int | None = None  # seconds without a finished step before the job's watchdog ends it
    node_check: int | None = None  # seconds without a finished step before every node is asked (0: never)
    preflight: Literal["off", "quick", "full"] | None = None  # the checks before each run's first step
    env: dict[str, str] = field(default_factory=dict)
    # More host variables the container gets (names, or NAME_* prefixes), beyond those a job needs
    # (the sbatch library's CTRAIN_PASSED_ENV); others, PYTHONPATH and conda's among them, stay out.
    pass_env: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Relations between settings that are wrong before anything is run."""
        for name, option in DIRECTIVE_FIELDS.items():
            value = getattr(self, name)
            problem = None if value is None else directive_problem(value, option)
            if problem:
                raise ConfigError(f"slurm.{name} (--{option}) {shorten(value)!r} {problem}")
        shell = [(name, getattr(self, name)) for name in _SHELL_FIELDS]
        for key, value in [*shell, *((f"mounts[{i}]", mount) for i, mount in enumerate(self.mounts))]:
            problem = None if value is None else control_problem(str(value))
            if problem:
                raise ConfigError(f"slurm.{key} {shorten(str(value))!r} {problem}")
        for name in _MOUNT_SOURCES:
            value = getattr(self, name)
            if value is not None and ("," in str(value) or ":" in str(value)):
                raise ConfigError(
                    f"slurm.{name} {shorten(str(value))!r} contains ',' or ':', which separate the container's mounts: "
                    "use a path without them (a symbolic link to it will do)"
                )
        for name in (
            "nodes",
            "gpus_per_node",
            "ntasks_per_node",
            "cpus_per_task",
            "max_requeues",
            "signal_lead",
            "hang_timeout",
            "node_check",
        ):
            value = getattr(self, name)
            least = 1 if name in ("nodes", "ntasks_per_node", "cpus_per_task") else 0
            if value is not None and value < least:
                raise ConfigError(f"slurm.{name} must be at least {least}, got {value}")
        if self.signal_lead is not None and self.signal_lead > 65535:
            raise ConfigError(f"slurm.signal_lead is {self.signal_lead}s; Slurm allows at most 65535")
        if self.time:
            try:
                time_seconds(self.time)
            except ConfigError as exc:
                raise ConfigError(f"slurm.{exc}") from None
        if self.mem is not None and not _MEMORY.fullmatch(self.mem):
            raise ConfigError(f"slurm.mem (--mem) {shorten(self.mem)!r} is not {_OPTION_VALUES['mem'][1]}")
        if self.gpus_per_node and self.ntasks_per_node:
            raise ConfigError(
                "slurm.gpus_per_node and slurm.ntasks_per_node are both set: with GPUs the scripts start one "
                "process per GPU, so leave ntasks_per_node (processes per node on CPU-only nodes) unset"
            )
        for mount in self.mounts:
            if not _MOUNT.fullmatch(mount):
                raise ConfigError(f"slurm.mounts entry {mount!r} must look like /host/dir:/container/dir[:ro]")
        for name in self.env:
            if not _ENV_NAME.fullmatch(name):
                raise ConfigError(f"slurm.env: {shorten(name)!r} is not an environment variable name")
            problem = env_name_problem(name)
            if problem:
                raise ConfigError(
                    f"slurm.env: {name} {problem}: it would run code of its own in the job and in ctrain; remove it"
                )
            if secret_name(name):
                raise ConfigError(
                    f"slurm.env: {name} looks like a secret; ctrain writes these values into the job script and its "
                    "copy in logs/. Export it in your shell instead and name it in slurm.pass_env (sbatch passes your "
                    "environment to the job; the container gets what the job needs and what pass_env names), or "
                    "log in once (`huggingface-cli login` stores the token in the mounted HF cache)"
                )
        for name in self.pass_env:
            if not _PASS_ENV.fullmatch(name):
                raise ConfigError(
                    f"slurm.pass_env: {shorten(name)!r} is not a variable name or NAME_* prefix "
                    "(e.g. MY_SETTING, MYLAB_*)"
                )
        given = {"mem": self.mem is not None, "cpus-per-task": self.cpus_per_task is not None}
        for arg in self.sbatch_args:
            parsed = sbatch_arg(arg)
            if not parsed:
                raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r} must be an sbatch option like --qos=high")
            problem = short_option_problem(arg)
            if problem:
                raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r} {problem}")
            option, value = parsed
            problem = None if value is None else directive_problem(value, option)
            if problem:
                raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r}: its value {problem}")
            problem = option_value_problem(option, value)
            if problem:
                raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r}: --{option} {problem}")
            if option == "time" and value:
                try:
                    time_seconds(value)
                except ConfigError as exc:
                    raise ConfigError(f"slurm.sbatch_args entry {shorten(arg)!r}: {exc}") from None
            given[option] = True
        for group in (MEMORY_OPTIONS, CPU_OPTIONS):
            both = [f"--{option}" for option in group if given.get(option)]
            if len(both) > 1:
                choices = ", ".join(f"--{option}" for option in group)
                raise ConfigError(
                    f"slurm: {' and '.join(both)} are both set (slurm.{group[0].replace('-', '_')}, the command line "
                    f"or slurm.sbatch_args), and sbatch takes only one of {choices}: keep one"
                )
        for name, value in self.env.items():
            problem = control_problem(value)
            if problem:
                raise ConfigError(f"slurm.env: the value of {name} {problem}: write it on one line")
        if self.job_name is not None:
            problem = name_problem(self.job_name)
            if problem:
                raise ConfigError(
                    f"the job name (slurm.job_name, --job-name) {shorten(self.job_name)!r} {problem}: it names the "
                    "job's log, logs/NAME-JOBID.out"
                )


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
