"""``ctrain cluster init``: fill ``cluster/pcluster.yaml`` from the ``cluster:`` settings.

The template is plain YAML whose ``${name}`` placeholders name values computed here. Filling
works on the parsed tree, so values keep their types (``MaxCount: 2``, not ``"2"``). A key whose
value comes out empty is dropped (an optional setting left unset), and so is a mapping left empty.
Two choices are structural: queues switched off are removed, and an existing FSx file system
replaces the settings that would create one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from ctrain.cluster.setup import Setup, check_settings
from ctrain.errors import ConfigError
from ctrain.files import atomic_write_text, read_bounded
from ctrain.settings import MAX_SETTINGS_BYTES, load_yaml

PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
# Queue names in the template and the settings that switch them on.
QUEUE_SWITCHES = {"gpu": "gpu_queue", "cpu": "cpu_queue"}
# Settings init cannot guess; each is named in the error with the flag that sets it.
REQUIRED = {"region": "--region", "head_node_subnet": "--subnet", "scripts_s3_uri": "--scripts-s3-uri"}


def resource_name(instance_type: str) -> str:
    """A compute-resource name from an instance type (``p5.48xlarge`` -> ``p5-48xlarge``)."""
    return instance_type.lower().replace(".", "-")


def values(setup: Setup) -> dict[str, Any]:
    """Every placeholder's value; ``None`` drops the key that holds it. Checked again here, however the
    settings were made: these values reach the nodes' scripts and enroot.conf."""
    s = setup.settings
    check_settings(s)
    missing = [f"cluster.{key} ({flag})" for key, flag in REQUIRED.items() if not getattr(s, key)]
    if missing:
        raise ConfigError(
            "ctrain cluster init needs " + ", ".join(missing) + ": set them under `cluster:` in ctrain.yaml or pass "
            "the flags (scripts_s3_uri is an S3 prefix you own; `ctrain cluster up` uploads cluster/scripts there)"
        )
    uri = setup.scripts_uri or ""
    persistent = s.fsx_deployment.startswith("PERSISTENT")
    return {
        "name": s.name,
        "region": s.region,
        "os": s.os,
        "custom_ami": s.custom_ami,
        "head_node_instance_type": s.head_node_instance_type,
        "head_node_subnet": s.head_node_subnet,
        "compute_subnet": s.compute_subnet or s.head_node_subnet,
        "key_pair": s.key_pair,
        "ssh_allowed_ips": s.ssh_allowed_ips,
        "scripts_s3_uri": uri,
        "scripts_bucket": uri.removeprefix("s3://").split("/", 1)[0],
        "local_storage": s.local_storage,
        "enroot_squash_options": s.enroot_squash_options,
        "idle_minutes": s.idle_minutes,
        "capacity_type": s.capacity_type,
        "capacity_reservation": s.capacity_reservation,
        "placement_group": s.placement_group if s.placement_group is not None else not s.capacity_reservation,
        "gpu_resource_name": resource_name(s.gpu_instance_type),
        "gpu_instance_type": s.gpu_instance_type,
        "gpu_min_nodes": s.gpu_min_nodes,
        "gpu_max_nodes": s.gpu_max_nodes,
        "efa": s.efa,
        "cpu_resource_name": resource_name(s.cpu_instance_type),
        "cpu_instance_type": s.cpu_instance_type,
        "cpu_max_nodes": s.cpu_max_nodes,
        "fsx_mount": s.fsx_mount,
        "fsx_id": s.fsx_id,
        "fsx_size_gib": s.fsx_size_gib,
        "fsx_deployment": s.fsx_deployment,
        "fsx_throughput": s.fsx_throughput if persistent else None,
        "fsx_deletion_policy": s.fsx_deletion_policy,
        "log_retention_days": s.log_retention_days,
    }


def fill(node: Any, known: dict[str, Any], where: str = "") -> Any:
    """``node`` with placeholders replaced and emptied keys dropped (see the module docstring)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            value = fill(value, known, f"{where}.{key}" if where else str(key))
            if value is not None and value != {}:
                out[key] = value
        return out
    if isinstance(node, list):
        return [v for v in (fill(item, known, f"{where}[{i}]") for i, item in enumerate(node)) if v is not None]
    if not isinstance(node, str):
        return node
    for name in PLACEHOLDER.findall(node):
        if name not in known:
            raise ConfigError(f"template {where}: unknown placeholder ${{{name}}}; known: {', '.join(sorted(known))}")
    whole = PLACEHOLDER.fullmatch(node)
    if whole:
        return known[whole.group(1)]
    if any(known[name] is None for name in PLACEHOLDER.findall(node)):
        return None
    return PLACEHOLDER.sub(lambda m: str(known[m.group(1)]), node)


def build(setup: Setup) -> dict[str, Any]:
    """The filled ParallelCluster config as data."""
    s = setup.settings
    config = fill(load_yaml(setup.template), values(setup))
    scheduling = config.get("Scheduling", {})
    scheduling["SlurmQueues"] = [q for q in scheduling.get("SlurmQueues", []) if _wanted(setup, q)]
    if s.fsx_id:
        for storage in config.get("SharedStorage", []):
            if "FsxLustreSettings" in storage:
                storage["FsxLustreSettings"] = {"FileSystemId": s.fsx_id}
    config.setdefault("Tags", []).extend({"Key": k, "Value": v} for k, v in s.tags.items())
    return config


def _wanted(setup: Setup, queue: dict[str, Any]) -> bool:
    switch = QUEUE_SWITCHES.get(queue.get("Name", ""))
    return switch is None or bool(getattr(setup.settings, switch))


def render(setup: Setup) -> str:
    """The filled config as YAML, with a header saying where it came from."""
    header = (
        f"# ParallelCluster 3 config for cluster '{setup.settings.name}', written by `ctrain cluster init`\n"
        f"# from {setup.display(setup.template)}, whose comments explain each setting. To change it, edit the\n"
        "# `cluster:` section of ctrain.yaml and run `ctrain cluster init --force`, or edit this file;\n"
        "# `ctrain cluster validate` checks it. `ctrain cluster up` uploads the custom-action scripts\n"
        f"# ({setup.display(setup.scripts_dir)}/) to {setup.scripts_uri}/.\n"
    )
    body = yaml.safe_dump(build(setup), sort_keys=False, default_flow_style=False, width=100)
    body = re.sub(r"\n(?=[A-Za-z])", "\n\n", body)  # a blank line between top-level sections
    return header + "\n" + body


def write(setup: Setup, output: Path | None = None, *, force: bool = False) -> Path:
    """Write the filled config; an existing different file is kept unless ``force``."""
    path = setup.path(output) if output else setup.config_file
    text = render(setup)
    if path.exists():
        if not path.is_file():  # a directory, or a device or pipe that --force would replace
            raise ConfigError(f"{path} exists and is not a regular file: name a file for the config (-o FILE)")
        if not force and read_bounded(path, MAX_SETTINGS_BYTES, "the config file") != text.encode():
            raise ConfigError(f"{path} exists and differs from what init would write; pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return path
