"""``ctrain cluster validate``: a ParallelCluster config checked offline, before anything is paid for.

Two sources, reported together. ParallelCluster's own code, run in a separate process
(``_offline_check.py``): its config schema (its marshmallow ``ClusterSchema``: unknown keys, types,
allowed values, required fields), then each of its validators that can decide without AWS (names,
counts, sizes, placement groups, storage). And ctrain's rules, which need no AWS either: instance
types that exist (botocore's EC2 model lists them), EFA only on instance types that have it, no
placement group next to a capacity reservation, custom-action scripts that exist locally so ``up``
can upload them.
"""

from __future__ import annotations

import difflib
import io
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ctrain import proc
from ctrain.cluster import setup as cluster_setup
from ctrain.cluster.efa import EFA_INSTANCE_TYPES
from ctrain.errors import ConfigError, CtrainError, ParseError
from ctrain.files import read_bounded
from ctrain.settings import MAX_SETTINGS_BYTES, bounded

OFFLINE_CHECK = Path(__file__).with_name("_offline_check.py")
SCHEMA = "ParallelCluster schema"
PCLUSTER = "pcluster"  # a validator's findings are "pcluster <its type>", offline or from AWS
CTRAIN = "ctrain"
INIT = "`ctrain cluster init` writes one"


@dataclass(frozen=True)
class Problem:
    """One finding: where in the config (dotted path), what, and who says so."""

    level: Literal["ERROR", "WARNING", "INFO"]
    where: str
    message: str
    source: str

    def __str__(self) -> str:
        where = f"{self.where}: " if self.where else ""
        return f"{self.level.lower()}: {where}{self.message} [{self.source}]"


class InvalidConfig(ConfigError):
    """The config has errors; the message lists every problem found."""

    def __init__(self, path: Path | str, problems: list[Problem]) -> None:
        self.problems = problems
        order = {"ERROR": 0, "WARNING": 1, "INFO": 2}
        lines = "\n".join(f"  {p}" for p in sorted(problems, key=lambda p: order[p.level]))
        super().__init__(f"{path} is not a valid ParallelCluster config:\n{lines}")


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.level == "ERROR"]


# --- ParallelCluster's schema -------------------------------------------------------------------


def flatten(messages: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """Marshmallow's nested messages as (dotted path, message); list indices become ``[i]``."""
    if isinstance(messages, dict):
        for key, value in messages.items():
            key = str(key)
            if key in ("_schema", "_yaml"):
                child = where
            elif key.isdigit():
                child = f"{where}[{key}]"
            else:
                child = f"{where}.{key}" if where else key
            yield from flatten(value, child)
    elif isinstance(messages, list):
        for item in messages:
            yield from flatten(item, where)
    else:
        yield where, str(messages)


@dataclass(frozen=True)
class Offline:
    """What ParallelCluster's code says about one config without AWS, and what it could not say."""

    problems: list[Problem]
    needs_aws: tuple[str, ...] = ()
    instance_types: frozenset[str] = field(default_factory=frozenset)
    botocore: str = ""


def _offline(reply: dict[str, Any], result: dict[str, Any]) -> Offline:
    problems = [Problem("ERROR", where, message, SCHEMA) for where, message in flatten(result["errors"] or {})]
    for found in result["validators"]:
        level = found["level"] if found["level"] in ("ERROR", "WARNING", "INFO") else "ERROR"
        message = str(found["message"]).removeprefix("Error: ")
        problems.append(Problem(level, str(found["where"]), message, f"{PCLUSTER} {found['type']}"))
    return Offline(problems, tuple(result["needs_aws"]), frozenset(reply["instance_types"]), str(reply["botocore"]))


def offline(paths: Sequence[Path], name: str, region: str) -> list[Offline]:
    """Run ParallelCluster's schema and offline validators on each of ``paths`` in the Python that
    has them (one process for all: loading ParallelCluster takes most of the time)."""
    out = proc.run(cluster_setup.helper(OFFLINE_CHECK, name, region, *paths), timeout=300)
    try:
        reply = json.loads(out.stdout)
        results = [_offline(reply, result) for result in reply["configs"]]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ParseError("the ParallelCluster offline check's output", out.stdout + out.stderr) from None
    if len(results) != len(paths):
        raise ParseError("the ParallelCluster offline check's output", out.stdout)
    return results


# --- ctrain's rules -----------------------------------------------------------------------------


def _queues(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    queues = (config.get("Scheduling") or {}).get("SlurmQueues") or []
    for i, queue in enumerate(queues):
        if isinstance(queue, dict):
            yield f"Scheduling.SlurmQueues[{i}]", queue


def _resources(queue: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for j, resource in enumerate(queue.get("ComputeResources") or []):
        if isinstance(resource, dict):
            yield f"ComputeResources[{j}]", resource


def instance_types(config: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every instance type the config names (as written: the schema checks the types), with where."""
    head = config.get("HeadNode")
    if isinstance(head, dict):
        yield "HeadNode.InstanceType", head.get("InstanceType")
    for qwhere, queue in _queues(config):
        for rwhere, resource in _resources(queue):
            yield f"{qwhere}.{rwhere}.InstanceType", resource.get("InstanceType")
            for k, instance in enumerate(resource.get("Instances") or []):
                if isinstance(instance, dict):
                    yield f"{qwhere}.{rwhere}.Instances[{k}].InstanceType", instance.get("InstanceType")
    login = config.get("LoginNodes")
    for i, pool in enumerate((login.get("Pools") if isinstance(login, dict) else None) or []):
        if isinstance(pool, dict):
            yield f"LoginNodes.Pools[{i}].InstanceType", pool.get("InstanceType")


def instance_type_problems(config: dict[str, Any], known: frozenset[str], botocore: str) -> list[Problem]:
    """Instance types EC2 does not have, e.g. misspelt; ``known`` is botocore's list (empty: unchecked)."""
    found = []
    for where, itype in instance_types(config):
        if not known or not isinstance(itype, str) or itype in known:
            continue
        close = difflib.get_close_matches(itype, known, n=1)
        fix = f"did you mean {close[0]}?" if close else "`aws ec2 describe-instance-types` lists them"
        message = (
            f"'{itype}' is not an EC2 instance type: {fix} (checked against the {len(known)} types botocore "
            f"{botocore} knows; a newer type needs a newer botocore)"
        )
        found.append(Problem("ERROR", where, message, CTRAIN))
    return found


def efa_problems(config: dict[str, Any], known: frozenset[str] = frozenset()) -> list[Problem]:
    """EFA switched on for an instance type that has no EFA (see :mod:`ctrain.cluster.efa`); types
    outside ``known`` are left to :func:`instance_type_problems`."""
    found = []
    for qwhere, queue in _queues(config):
        for rwhere, resource in _resources(queue):
            if not (resource.get("Efa") or {}).get("Enabled"):
                continue
            types = [resource.get("InstanceType")] + [i.get("InstanceType") for i in resource.get("Instances") or []]
            for itype in filter(None, types):
                if itype not in EFA_INSTANCE_TYPES and (not known or itype in known):
                    message = (
                        f"{itype} has no EFA; pick an EFA instance type (p4d.24xlarge, p5.48xlarge, "
                        "p5en.48xlarge, ...) or set Efa.Enabled to false"
                    )
                    found.append(Problem("ERROR", f"{qwhere}.{rwhere}.Efa.Enabled", message, CTRAIN))
    return found


def placement_problems(config: dict[str, Any]) -> list[Problem]:
    """A new placement group next to a capacity reservation (ParallelCluster's own offline
    EfaPlacementGroupValidator covers EFA without a placement group)."""
    found = []
    for qwhere, queue in _queues(config):
        group = ((queue.get("Networking") or {}).get("PlacementGroup")) or {}
        new_group = bool(group.get("Enabled")) and not (group.get("Id") or group.get("Name"))
        reserved = bool(queue.get("CapacityReservationTarget")) or any(
            r.get("CapacityReservationTarget") for _, r in _resources(queue)
        )
        if new_group and reserved:
            message = (
                "a new placement group conflicts with the capacity reservation (reserved instances cannot launch "
                "in it): set Enabled to false, or name the reservation's own group with PlacementGroup.Id"
            )
            found.append(Problem("ERROR", f"{qwhere}.Networking.PlacementGroup.Enabled", message, CTRAIN))
    return found


def _action_steps(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every custom-action step that names a script (``Script``, ``Args``), with where it is."""
    login = config.get("LoginNodes")
    pools = (login.get("Pools") if isinstance(login, dict) else None) or []
    holders = [("HeadNode", config.get("HeadNode")), *_queues(config)]
    holders += [(f"LoginNodes.Pools[{i}]", pool) for i, pool in enumerate(pools)]
    for where, holder in holders:
        actions = (holder.get("CustomActions") or {}) if isinstance(holder, dict) else {}
        for event, action in actions.items() if isinstance(actions, dict) else ():
            steps = (action.get("Sequence") or [action]) if isinstance(action, dict) else []
            for k, step in enumerate(steps):
                if isinstance(step, dict) and step.get("Script"):
                    seq = f".Sequence[{k}]" if "Sequence" in action else ""
                    yield f"{where}.CustomActions.{event}{seq}", step


def custom_actions(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Every custom-action script URI in the config, with where it is."""
    for where, step in _action_steps(config):
        yield f"{where}.Script", str(step["Script"])


def _local(setup: cluster_setup.Setup, uri: str) -> Path | None:
    """The local file behind a script URI under ``cluster.scripts_s3_uri``, else None."""
    prefix = setup.scripts_uri
    return setup.scripts_dir / uri[len(prefix) + 1 :] if prefix and uri.startswith(prefix + "/") else None


def local_scripts(setup: cluster_setup.Setup, config: dict[str, Any]) -> dict[str, Path]:
    """The scripts the config takes from ``cluster.scripts_s3_uri``: S3 URI -> local file."""
    return {uri: local for _, uri in custom_actions(config) if (local := _local(setup, uri))}


def script_problems(setup: cluster_setup.Setup, config: dict[str, Any]) -> list[Problem]:
    """Scripts under ``cluster.scripts_s3_uri`` must exist locally: ``up`` uploads them from there."""
    found = []
    for where, uri in custom_actions(config):
        local = _local(setup, uri)
        if local and not local.is_file():
            message = (
                f"{uri} comes from {setup.display(local)}, which does not exist "
                f"(`ctrain cluster up` uploads {setup.display(setup.scripts_dir)}/ to {setup.scripts_uri}/)"
            )
            found.append(Problem("ERROR", where, message, CTRAIN))
    return found


#: The node script that switches enroot and pyxis on (cluster/scripts/); ParallelCluster's AMIs have
#: both, off.
PYXIS_SCRIPT = "enroot-pyxis.sh"


def project_problems(setup: cluster_setup.Setup, config: dict[str, Any]) -> list[Problem]:
    """The project against its cluster: a pyxis project needs enroot and pyxis switched on in every
    queue that runs its jobs; GPU nodes kept running while idle (MinCount) cost money by the hour."""
    found = []
    if setup.runtime == "pyxis":
        switched_on = {at.split(".CustomActions", 1)[0] for at, uri in custom_actions(config)
                       if uri.rsplit("/", 1)[-1] == PYXIS_SCRIPT}  # fmt: skip
        for where in ["HeadNode", *(where for where, _ in _queues(config))]:
            if where not in switched_on:
                found.append(Problem(
                    "ERROR", f"{where}.CustomActions",
                    f"the project runs its jobs with pyxis (slurm.runtime: pyxis), and these nodes do not run "
                    f"{PYXIS_SCRIPT}, which switches enroot and pyxis on: keep the custom actions of "
                    "cluster/pcluster.yaml, or set slurm.runtime: apptainer", CTRAIN,
                ))  # fmt: skip
    for qwhere, queue in _queues(config):
        for rwhere, resource in _resources(queue):
            count = resource.get("MinCount") or 0
            itype = resource.get("InstanceType") or ""
            if isinstance(count, int) and count > 0 and itype.startswith(("p", "g", "trn")):
                found.append(Problem(
                    "WARNING", f"{qwhere}.{rwhere}.MinCount",
                    f"{count} {itype} node(s) stay up while idle and are billed by the hour: set gpu_min_nodes: 0 "
                    "(nodes start when a job asks, in minutes) unless you mean to keep them", CTRAIN,
                ))  # fmt: skip
    return found


def _get(config: Any, *keys: str | int) -> Any:
    """``config[k1][k2]...``, or None where a part is missing or of another kind."""
    for key in keys:
        if isinstance(key, int):
            config = config[key] if isinstance(config, list) and key < len(config) else None
        else:
            config = config.get(key) if isinstance(config, dict) else None
    return config


# A MountDir as ParallelCluster takes it (the leading '/' optional), of plain names only.
_MOUNT_DIR = cluster_setup.Rule(
    re.compile(r"/?[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*/?"), "a path of letters, digits, '.', '_', '-' and '/'"
)


def value_problems(config: dict[str, Any]) -> list[Problem]:
    """The values that reach the nodes' shell and their enroot.conf (which enroot runs through `eval
    echo`), and those ctrain passes to commands, held to the forms of :data:`ctrain.cluster.setup.RULES`:
    the same rules as ``ctrain cluster init``, for a config written or edited by hand."""
    rules = cluster_setup.RULES
    values: list[tuple[str, Any, cluster_setup.Rule]] = [
        ("Region", config.get("Region"), rules["region"]),
        ("HeadNode.Networking.SubnetId", _get(config, "HeadNode", "Networking", "SubnetId"), rules["head_node_subnet"]),
        ("HeadNode.Ssh.KeyName", _get(config, "HeadNode", "Ssh", "KeyName"), rules["key_pair"]),
        ("HeadNode.LocalStorage.EphemeralVolume.MountDir",
         _get(config, "HeadNode", "LocalStorage", "EphemeralVolume", "MountDir"), _MOUNT_DIR),
    ]  # fmt: skip
    for qwhere, queue in _queues(config):
        subnets = _get(queue, "Networking", "SubnetIds")
        for j, subnet in enumerate(subnets if isinstance(subnets, list) else []):
            values.append((f"{qwhere}.Networking.SubnetIds[{j}]", subnet, rules["compute_subnet"]))
        mount = _get(queue, "ComputeSettings", "LocalStorage", "EphemeralVolume", "MountDir")
        values.append((f"{qwhere}.ComputeSettings.LocalStorage.EphemeralVolume.MountDir", mount, _MOUNT_DIR))
    storages = config.get("SharedStorage")
    for i, storage in enumerate(storages if isinstance(storages, list) else []):
        values.append((f"SharedStorage[{i}].MountDir", _get(storage, "MountDir"), _MOUNT_DIR))
    found = []
    for where, step in _action_steps(config):
        if str(step["Script"]).rsplit("/", 1)[-1] != PYXIS_SCRIPT:
            continue
        args = step.get("Args")
        if isinstance(args, list) and len(args) == 2:
            values.append((f"{where}.Args[0]", args[0], rules["local_storage"]))
            values.append((f"{where}.Args[1]", args[1], rules["enroot_squash_options"]))
        else:
            said = f"{len(args)} of them" if isinstance(args, list) else "none" if args is None else repr(args)
            found.append(Problem("ERROR", f"{where}.Args", f"{PYXIS_SCRIPT} takes two Args, LOCAL_STORAGE (an absolute "
                                 f"path) and SQUASH_OPTIONS (mksquashfs options); found {said}", CTRAIN))  # fmt: skip
    for where, value, rule in values:
        if value is not None and (problem := rule.problem(value)):
            found.append(Problem("ERROR", where, problem, CTRAIN))
    return found


def ctrain_problems(setup: cluster_setup.Setup, config: dict[str, Any], offline: Offline | None = None) -> list[Problem]:
    """ctrain's rules; instance types are checked against the list ``offline`` brings from botocore."""
    known = offline.instance_types if offline else frozenset()
    types = instance_type_problems(config, known, offline.botocore) if offline else []
    return (value_problems(config) + types + efa_problems(config, known) + placement_problems(config)
            + script_problems(setup, config) + project_problems(setup, config))  # fmt: skip


# --- both ---------------------------------------------------------------------------------------

_KINDS = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}


def read(path: Path) -> dict[str, Any]:
    """The config file as a mapping, or one error that says what is wrong with the file."""
    if path.is_dir():
        raise ConfigError(
            f"{path} is a directory, not a ParallelCluster config: name the file (`ctrain cluster init` writes "
            "pcluster.yaml)"
        )
    if not path.exists():
        raise ConfigError(f"{path} does not exist: `ctrain cluster init` writes it")
    data = read_bounded(path, MAX_SETTINGS_BYTES, "ParallelCluster config")  # a FIFO or /dev/zero is refused
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}), so not a ParallelCluster "
            f"config, which is YAML: {INIT}"
        ) from None
    stream = io.StringIO(text)
    stream.name = path.name  # PyYAML names it in its messages
    try:
        loader = yaml.SafeLoader(stream)  # its reader refuses control characters at once
        try:
            node = loader.get_single_node()
            bounded(node, str(path))  # aliases expanded and nesting within bounds, before building the values
            config = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except RecursionError:
        raise ConfigError(f"{path} is nested too deep to be a ParallelCluster config: {INIT}") from None
    except yaml.YAMLError as exc:
        detail = "\n".join(f"  {line}" for line in str(exc).splitlines())
        raise ConfigError(f"{path} is not valid YAML (fix it, or {INIT}):\n{detail}") from None
    if config is None:
        raise ConfigError(
            f"{path} is empty; a ParallelCluster config has Region, Image, HeadNode, Scheduling, ...: {INIT}"
        )
    if not isinstance(config, dict):
        kind = _KINDS.get(type(config), type(config).__name__)
        raise ConfigError(
            f"{path} holds a YAML {kind}, not a ParallelCluster config (a mapping: Region, Image, HeadNode, "
            f"Scheduling, ...): {INIT}"
        )
    return config


def check(setup: cluster_setup.Setup, path: Path) -> list[Problem]:
    """Every problem with ``path``, ctrain's rules first; raises nothing for an invalid config."""
    config = read(path)
    try:
        region = cluster_setup.region(setup, config)
    except CtrainError:
        region = "us-east-1"  # the schema needs some region; which one does not change its verdict
    (found,) = offline([path], setup.settings.name, region)
    return ctrain_problems(setup, config, found) + found.problems


def suppressed(problems: list[Problem], suppress: Sequence[str]) -> list[Problem]:
    """Without the findings of ParallelCluster validators named in ``suppress`` (``ALL``: every one),
    as ``pcluster --suppress-validators`` leaves them out."""
    names = {v.removeprefix("type:") for v in suppress}
    return [
        p
        for p in problems
        if not (p.source.startswith(f"{PCLUSTER} ") and ("ALL" in names or p.source.split(" ", 1)[1] in names))
    ]


def merge(offline: list[Problem], aws: list[Problem]) -> list[Problem]:
    """Offline findings and those from AWS, each validator's message once."""
    seen = {(p.source, p.message) for p in aws}
    return [p for p in offline if (p.source, p.message) not in seen] + aws


def validate(setup: cluster_setup.Setup, path: Path, suppress: Sequence[str] = ()) -> list[Problem]:
    """:func:`check`, raising :class:`InvalidConfig` when there is an error; returns warnings."""
    problems = suppressed(check(setup, path), suppress)
    if errors(problems):
        raise InvalidConfig(setup.display(path), problems)
    return problems
