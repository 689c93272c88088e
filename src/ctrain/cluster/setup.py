"""What every ``ctrain cluster`` command shares: the ``Setup`` (``cluster:`` settings with flags applied),
shipped files, the region, and where the ``pcluster`` CLI and its Python live."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ctrain import proc, resources
from ctrain.config import ClusterConfig, ProjectConfig
from ctrain.errors import ConfigError, ToolNotFound
from ctrain.files import control_problem, shorten
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


# --- the values that reach the nodes -------------------------------------------------------------
#
# Settings end up in the ParallelCluster config, as arguments of the node script and, from there, in
# /etc/enroot/enroot.conf, whose values enroot runs through `eval echo` on every node, every time it
# runs. So each one is held to the form AWS or the tool gives it, with no character a shell reads
# (quotes, $, `, ;, |, &, <, >, newlines...): a value that is refused here never reaches a node.

#: An absolute path of plain names: a mount point on the nodes.
MOUNT_PATH = re.compile(r"(?:/[A-Za-z0-9._-]+)+/?")
_FLAG_OR_WORD = r"(?:-[A-Za-z0-9_-]+|[A-Za-z0-9][A-Za-z0-9._,]*)"
#: mksquashfs options: flags (``-noI``, ``-comp``) and their plain arguments (``zstd``, ``3``, ``1M``).
SQUASH_OPTIONS = re.compile(rf"{_FLAG_OR_WORD}(?: +{_FLAG_OR_WORD})*")
_AWS_ID = "[0-9a-f]{8}|[0-9a-f]{17}"


@dataclass(frozen=True)
class Rule:
    """The form one setting's value must have, and those words for the error."""

    pattern: re.Pattern[str]
    form: str

    def problem(self, value: object) -> str | None:
        """Why ``value`` does not have the form, else None."""
        if isinstance(value, str) and self.pattern.fullmatch(value):
            return None
        return f"{_shown(value)} is not allowed: {self.form}"


def _shown(value: object) -> str:
    return repr(shorten(value)) if isinstance(value, str) else repr(value)


_PATH_FORM = "an absolute path of letters, digits, '.', '_', '-' and '/' (e.g. {example})"
_TYPE = Rule(re.compile(r"[a-z][a-z0-9-]*\.[a-z0-9-]+"), "an EC2 instance type such as p5.48xlarge")
_SUBNET = Rule(re.compile(f"subnet-(?:{_AWS_ID})"), "a subnet ID: subnet- and 8 or 17 hex digits")
#: Each setting that reaches the config, a node or a command, and the form it must have.
RULES: dict[str, Rule] = {
    "region": Rule(re.compile(r"[a-z]{2}(?:-[a-z]+)+-[0-9]+"), "an AWS region such as us-east-1"),
    "head_node_subnet": _SUBNET,
    "compute_subnet": _SUBNET,
    # AWS takes any printable ASCII; the name only reaches YAML (dumped) and argv, never a shell. It is also
    # the local ~/.ssh/NAME.pem, so no '/' (no path out of ~/.ssh) and no leading '.' or '-'.
    "key_pair": Rule(
        re.compile(r"[\x20-\x2c\x30-\x7e][\x20-\x2e\x30-\x7e]{0,254}"),
        "an EC2 key pair name of 1 to 255 printable ASCII characters (letters, digits, spaces, punctuation) "
        "without '/', not starting with '.' or '-'",
    ),
    "custom_ami": Rule(re.compile(f"ami-(?:{_AWS_ID})"), "an AMI ID: ami- and 8 or 17 hex digits"),
    "head_node_instance_type": _TYPE,
    "gpu_instance_type": _TYPE,
    "cpu_instance_type": _TYPE,
    "capacity_reservation": Rule(
        re.compile(f"cr-(?:{_AWS_ID})"), "a capacity reservation ID: cr- and 8 or 17 hex digits"
    ),
    "fsx_id": Rule(re.compile(f"fs-(?:{_AWS_ID})"), "an FSx file system ID: fs- and 8 or 17 hex digits"),
    "fsx_mount": Rule(MOUNT_PATH, _PATH_FORM.format(example="/fsx")),
    "local_storage": Rule(MOUNT_PATH, _PATH_FORM.format(example="/scratch")),
    "enroot_squash_options": Rule(
        SQUASH_OPTIONS,
        "mksquashfs options separated by spaces: flags such as -noI or -comp and plain arguments such as zstd "
        "or 3 (letters, digits, '.', '_', ',')",
    ),
    "scripts_s3_uri": Rule(
        re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](?:/[A-Za-z0-9._/-]*)?"),
        "s3://BUCKET/PREFIX, the prefix of letters, digits, '.', '_', '-' and '/'",
    ),
}
_PREFIX_LIST = re.compile(r"pl-[0-9a-f]{8}|pl-[0-9a-f]{17}")
# AWS tags: letters (any script), digits, spaces and _ . : / = + - @.
_TAG = re.compile(r"[\w .:/=+@-]*")
_TAG_FORM = "letters, digits, spaces and '_', '.', ':', '/', '=', '+', '-', '@'"


def allowed_ips_problem(value: object) -> str | None:
    """Why ``value`` is not an IPv4 CIDR range (``203.0.113.0/24``) or a prefix list (``pl-...``), else None."""
    if isinstance(value, str) and (_PREFIX_LIST.fullmatch(value) or _cidr(value)):
        return None
    return f"{_shown(value)} is not allowed: an IPv4 range in CIDR form (203.0.113.0/24) or a prefix list ID (pl-...)"


def _cidr(value: str) -> bool:
    if not re.fullmatch(r"[0-9./]+", value) or "/" not in value:
        return False
    try:
        ipaddress.IPv4Network(value, strict=False)
    except ValueError:
        return False
    return True


def settings_problems(settings: ClusterConfig) -> list[tuple[str, str]]:
    """(setting, why) for every ``cluster:`` value that could carry more than its own meaning to a node, a
    command or a file another program reads; empty when all are as AWS and the tools write them."""
    found = []
    for key, rule in RULES.items():
        value = getattr(settings, key)
        if value is not None and (problem := rule.problem(value)):
            found.append((key, problem))
    if settings.ssh_allowed_ips is not None and (problem := allowed_ips_problem(settings.ssh_allowed_ips)):
        found.append(("ssh_allowed_ips", problem))
    for key, value in settings.tags.items():
        for part, text, most in (("key", key, 128), ("value", value, 256)):
            if not isinstance(text, str) or not _TAG.fullmatch(text) or len(text) > most or not str(key).strip():
                found.append((f"tags.{shorten(str(key))}", f"the tag {part} {_shown(text)} is not allowed: at most "
                                                           f"{most} {_TAG_FORM}"))  # fmt: skip
    # Paths on this machine: any name, but no control character (they are named in the config's header).
    for f in fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, Path) and (problem := control_problem(str(value))):
            found.append((f.name, f"{_shown(str(value))} {problem}"))
    return found


def check_settings(settings: ClusterConfig) -> None:
    """One ConfigError naming the first setting :func:`settings_problems` refuses, and its allowed form."""
    for key, problem in settings_problems(settings):
        raise ConfigError(f"cluster.{key}: {problem}", key=f"cluster.{key}")


def load(project: ProjectConfig, overrides: Mapping[str, Any] | None = None) -> Setup:
    """The project's ``cluster:`` section with ``overrides`` (flags, ``--set``) applied and validated again,
    every value that reaches the nodes checked against :data:`RULES` (from ctrain.yaml or a flag alike)."""
    settings = override(project.cluster, overrides or {}, where="cluster")
    check_settings(settings)
    return Setup(settings, project.root, project.slurm.runtime)


def region(setup: Setup, config: Mapping[str, Any] | None = None) -> str:
    """``cluster.region``, else the config file's ``Region``, else the AWS environment's default; each
    checked, since the region reaches ``pcluster`` and its environment."""
    sources = [("cluster.region", setup.settings.region), ("the config's Region", (config or {}).get("Region")),
               ("$AWS_REGION", os.environ.get("AWS_REGION")),
               ("$AWS_DEFAULT_REGION", os.environ.get("AWS_DEFAULT_REGION"))]  # fmt: skip
    for where, found in sources:
        if found:
            problem = RULES["region"].problem(found)
            if problem:
                raise ConfigError(f"{where}: {problem}")
            return str(found)
    raise ConfigError("no AWS region: set cluster.region in ctrain.yaml, pass --region, or export AWS_REGION")


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
