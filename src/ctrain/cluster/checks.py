"""``ctrain cluster validate``: a ParallelCluster config checked offline, before anything is paid for.

Two sources, reported together: ParallelCluster's own config schema (its marshmallow
``ClusterSchema``: unknown keys, types, allowed values, required fields), run in a separate process
(``_schema_check.py``); and ctrain's rules for training clusters, which need no AWS either: EFA only
on instance types that have it, no placement group next to a capacity reservation, custom-action
scripts that exist locally so ``up`` can upload them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ctrain import proc
from ctrain.cluster import base
from ctrain.cluster.efa import EFA_INSTANCE_TYPES
from ctrain.errors import ConfigError, CtrainError, ParseError
from ctrain.settings import load_yaml

SCHEMA_CHECK = Path(__file__).with_name("_schema_check.py")
SCHEMA = "ParallelCluster schema"
CTRAIN = "ctrain"


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
        lines = "\n".join(f"  {p}" for p in problems)
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


def schema_problems(path: Path, name: str, region: str) -> list[Problem]:
    """Run ParallelCluster's ClusterSchema on ``path`` in the Python that has it."""
    out = proc.run(base.helper(SCHEMA_CHECK, path, name, region), timeout=300)
    try:
        reply = json.loads(out.stdout)
        messages = reply["errors"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ParseError("the ParallelCluster schema check's output", out.stdout + out.stderr) from None
    return [Problem("ERROR", where, message, SCHEMA) for where, message in flatten(messages or {})]


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


def efa_problems(config: dict[str, Any]) -> list[Problem]:
    """EFA switched on for an instance type that has no EFA (see :mod:`ctrain.cluster.efa`)."""
    found = []
    for qwhere, queue in _queues(config):
        for rwhere, resource in _resources(queue):
            if not (resource.get("Efa") or {}).get("Enabled"):
                continue
            types = [resource.get("InstanceType")] + [i.get("InstanceType") for i in resource.get("Instances") or []]
            for itype in filter(None, types):
                if itype not in EFA_INSTANCE_TYPES:
                    message = (
                        f"{itype} has no EFA; pick an EFA instance type (p4d.24xlarge, p5.48xlarge, "
                        "p5en.48xlarge, ...) or set Efa.Enabled to false"
                    )
                    found.append(Problem("ERROR", f"{qwhere}.{rwhere}.Efa.Enabled", message, CTRAIN))
    return found


def placement_problems(config: dict[str, Any]) -> list[Problem]:
    """A new placement group next to a capacity reservation; and EFA queues without a placement group."""
    found = []
    for qwhere, queue in _queues(config):
        group = ((queue.get("Networking") or {}).get("PlacementGroup")) or {}
        new_group = bool(group.get("Enabled")) and not (group.get("Id") or group.get("Name"))
        reserved = bool(queue.get("CapacityReservationTarget")) or any(
            r.get("CapacityReservationTarget") for _, r in _resources(queue)
        )
        efa = any((r.get("Efa") or {}).get("Enabled") for _, r in _resources(queue))
        if new_group and reserved:
            message = (
                "a new placement group conflicts with the capacity reservation (reserved instances cannot launch "
                "in it): set Enabled to false, or name the reservation's own group with PlacementGroup.Id"
            )
            found.append(Problem("ERROR", f"{qwhere}.Networking.PlacementGroup.Enabled", message, CTRAIN))
        elif efa and not group.get("Enabled") and not reserved:
            message = "EFA without a placement group: nodes may land far apart and all-reduce slows down"
            found.append(Problem("WARNING", f"{qwhere}.Networking.PlacementGroup", message, CTRAIN))
    return found


def custom_actions(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Every custom-action script URI in the config, with where it is."""
    pools = (config.get("LoginNodes") or {}).get("Pools") or []
    holders = [("HeadNode", config.get("HeadNode")), *_queues(config)]
    holders += [(f"LoginNodes.Pools[{i}]", pool) for i, pool in enumerate(pools)]
    for where, holder in holders:
        actions = (holder.get("CustomActions") or {}) if isinstance(holder, dict) else {}
        for event, action in actions.items():
            steps = (action.get("Sequence") or [action]) if isinstance(action, dict) else []
            for k, step in enumerate(steps):
                script = step.get("Script") if isinstance(step, dict) else None
                if script:
                    seq = f".Sequence[{k}]" if "Sequence" in action else ""
                    yield f"{where}.CustomActions.{event}{seq}.Script", str(script)


def _local(setup: base.Setup, uri: str) -> Path | None:
    """The local file behind a script URI under ``cluster.scripts_s3_uri``, else None."""
    prefix = setup.scripts_uri
    return setup.scripts_dir / uri[len(prefix) + 1 :] if prefix and uri.startswith(prefix + "/") else None


def local_scripts(setup: base.Setup, config: dict[str, Any]) -> dict[str, Path]:
    """The scripts the config takes from ``cluster.scripts_s3_uri``: S3 URI -> local file."""
    return {uri: local for _, uri in custom_actions(config) if (local := _local(setup, uri))}


def script_problems(setup: base.Setup, config: dict[str, Any]) -> list[Problem]:
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


def ctrain_problems(setup: base.Setup, config: dict[str, Any]) -> list[Problem]:
    return efa_problems(config) + placement_problems(config) + script_problems(setup, config)


# --- both ---------------------------------------------------------------------------------------


def read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: `ctrain cluster init` writes it")
    return load_yaml(path)


def check(setup: base.Setup, path: Path) -> list[Problem]:
    """Every problem with ``path``, ctrain's rules first; raises nothing for an invalid config."""
    config = read(path)
    try:
        region = base.region(setup, config)
    except CtrainError:
        region = "us-east-1"  # the schema needs some region; which one does not change its verdict
    return ctrain_problems(setup, config) + schema_problems(path, setup.settings.name, region)


def validate(setup: base.Setup, path: Path) -> list[Problem]:
    """:func:`check`, raising :class:`InvalidConfig` when there is an error; returns warnings."""
    problems = check(setup, path)
    if errors(problems):
        raise InvalidConfig(setup.display(path), problems)
    return problems
