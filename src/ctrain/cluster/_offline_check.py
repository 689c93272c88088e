"""Check ParallelCluster configs offline with ParallelCluster's own code: its config schema, then
every one of its validators that can decide without AWS.

Usage: python _offline_check.py CLUSTER_NAME REGION CONFIG.yaml [CONFIG.yaml ...]

``ctrain cluster validate`` runs this with the Python that has aws-parallelcluster installed, as a
separate process, because loading the schema needs a region and some credentials to exist: dummy
ones are set here, in this process only, so they never reach ctrain or a real AWS call. Every
network connection and name lookup is refused here, so a validator that reaches for AWS (or any URL)
fails at once; its verdict is left out and its type listed under ``needs_aws``, for
``pcluster create-cluster --dryrun`` (``ctrain cluster validate --aws``) to decide against the
account. It imports ParallelCluster and botocore, never ctrain.

Validators run with the arguments ParallelCluster registers them with. Most parts of the config
register theirs from config values alone, so their own ``_register_validators`` runs. The cluster,
its queues and their compute resources look up AWS (instance type data, subnet zones, AMIs) while
registering, so their registrations that need only the config are repeated here, following
pcluster/config/cluster_config.py.

Prints one JSON object: {"version": pcluster's version, "botocore": botocore's version,
"instance_types": [every EC2 instance type in botocore's EC2 model], "configs": [per CONFIG, in order:
{"errors": marshmallow messages or null, "validators": [{"where", "level", "type", "message"}],
"needs_aws": [validator types]}]}.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections import defaultdict
from collections.abc import Iterator
from importlib.resources import files
from typing import Any

_OFFLINE = {
    "AWS_ACCESS_KEY_ID": "offline-schema-check",
    "AWS_SECRET_ACCESS_KEY": "offline-schema-check",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    "AWS_MAX_ATTEMPTS": "1",
}
_DROP = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ROLE_ARN")

# Model attributes whose config key is not their name in PascalCase.
_KEYS = {
    "queues": "SlurmQueues",
    "settings": "SlurmSettings",
    "data_repository_associations": "FsxLustreSettings.DataRepositoryAssociations",
}
# The key that every validator a part registers is about.
_PART_FIELD = {"SlurmScheduling": "SlurmQueues"}
# The one key a validator of a whole part of the config is about.
_FIELD = {
    "NameValidator": "Name",
    "SharedStorageNameValidator": "Name",
    "SharedStorageMountDirValidator": "MountDir",
    "SharedFileCacheNotHomeValidator": "MountDir",
}

Run = tuple[str, type, dict[str, Any]]


class _Network:
    """Refuses every connection and name lookup, and remembers that something tried."""

    tried = False

    @classmethod
    def refuse(cls, *args: object, **kwargs: object) -> Any:
        cls.tried = True
        raise OSError("no network in ctrain's offline check")

    @classmethod
    def close(cls) -> None:
        socket.getaddrinfo = cls.refuse  # type: ignore[assignment]
        socket.socket.connect = cls.refuse  # type: ignore[method-assign]
        socket.socket.connect_ex = cls.refuse  # type: ignore[method-assign]


def _walk(resource: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """Every part of the loaded config with its key path (``Scheduling.SlurmQueues[0]``)."""
    from pcluster.config.common import Resource
    from pcluster.utils import to_pascal_case

    yield where, resource
    for attr, value in vars(resource).items():
        if attr.startswith("_"):
            continue
        key = _KEYS.get(attr) or to_pascal_case(attr)
        path = f"{where}.{key}" if where else key
        if isinstance(value, Resource):
            yield from _walk(value, path)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, Resource):
                    yield from _walk(item, f"{path}[{i}]")


def _registered(where: str, resource: Any) -> list[Run]:
    """The validators a part registers itself; up to the first argument that needs AWS, if any."""
    from pcluster.validators.common import ValidatorContext

    resource._validators.clear()
    try:
        resource._register_validators(ValidatorContext())
    except Exception:  # noqa: BLE001, S110 - an argument needed AWS: what was registered before it stands
        pass
    runs = []
    for validator, args in resource._validators:
        field = _PART_FIELD.get(type(resource).__name__) or _FIELD.get(validator.__name__)
        runs.append((f"{where}.{field}" if field else where, validator, args))
    return runs


def _root_volume(runs: list[Run], where: str, volume: Any) -> None:
    """The size rules of a root volume; without a Size it takes the AMI's, which needs AWS."""
    from pcluster.validators.ebs_validators import EbsVolumeIopsValidator, EbsVolumeTypeSizeValidator

    if volume.size is None:
        return
    runs.append((where, EbsVolumeTypeSizeValidator, {"volume_type": volume.volume_type, "volume_size": volume.size}))
    args = {"volume_type": volume.volume_type, "volume_size": volume.size, "volume_iops": volume.iops}
    runs.append((where, EbsVolumeIopsValidator, args))


def _storage(config: Any) -> list[Run]:
    """BaseClusterConfig._register_storage_validators and _validate_mount_dirs, without AWS."""
    from pcluster.config.cluster_config import (
        ExistingFileCache,
        ExistingFsxOntap,
        ExistingFsxOpenZfs,
        SharedEbs,
        SharedEfs,
        SharedFsxLustre,
    )
    from pcluster.constants import MAX_EBS_COUNT, MAX_EXISTING_STORAGE_COUNT, MAX_NEW_STORAGE_COUNT, Feature
    from pcluster.validators.cluster_validators import (
        DuplicateMountDirValidator,
        DuplicateNameValidator,
        ManagedFsxMultiAzValidator,
        NumberOfStorageValidator,
        OverlappingMountDirValidator,
        SharedEbsPerformanceBottleNeckValidator,
        SharedStorageMountDirValidator,
        SharedStorageNameValidator,
    )
    from pcluster.validators.feature_validators import FeatureRegionValidator

    storages = config.shared_storage or []
    if not storages:
        return []
    runs: list[Run] = [
        (
            "SharedStorage",
            DuplicateNameValidator,
            {"name_list": [s.name for s in storages], "resource_name": "Shared Storage"},
        ),
        (
            "SharedStorage",
            DuplicateNameValidator,
            {"name_list": config.existing_storage_id_list, "resource_name": "Shared Storage IDs"},
        ),
    ]
    features = {
        ExistingFsxOpenZfs: Feature.FSX_OPENZFS,
        ExistingFsxOntap: Feature.FSX_ONTAP,
        ExistingFileCache: Feature.FILE_CACHE,
    }
    new: defaultdict[str, int] = defaultdict(int)
    existing: defaultdict[str, int] = defaultdict(int)
    ebs = 0
    for i, storage in enumerate(storages):
        where = f"SharedStorage[{i}]"
        runs.append((f"{where}.Name", SharedStorageNameValidator, {"name": storage.name}))
        runs.append((f"{where}.MountDir", SharedStorageMountDirValidator, {"mount_dir": storage.mount_dir}))
        if isinstance(storage, SharedFsxLustre):
            (existing if storage.file_system_id else new)["fsx"] += 1
            runs.append((where, FeatureRegionValidator, {"feature": Feature.FSX_LUSTRE, "region": config.region}))
        elif type(storage) in features:
            existing["fsx"] += 1
            runs.append((where, FeatureRegionValidator, {"feature": features[type(storage)], "region": config.region}))
        elif isinstance(storage, SharedEbs):
            if storage.raid:
                new["raid"] += 1
            else:
                ebs += 1
        elif isinstance(storage, SharedEfs):
            (existing if storage.file_system_id else new)["efs"] += 1
    for kind in ("EFS", "FSx", "RAID"):
        for age, count, most in (
            ("new", new, MAX_NEW_STORAGE_COUNT),
            ("existing", existing, MAX_EXISTING_STORAGE_COUNT),
        ):
            args = {
                "storage_type": f"{age} {kind}",
                "max_number": most.get(kind.lower()),
                "storage_count": count[kind.lower()],
            }
            runs.append(("SharedStorage", NumberOfStorageValidator, args))
    runs.append(
        (
            "SharedStorage",
            NumberOfStorageValidator,
            {"storage_type": "EBS", "max_number": MAX_EBS_COUNT, "storage_count": ebs},
        )
    )
    # Ephemeral volumes count only on instance types with instance store (AWS data): shared ones here.
    mounts = config.shared_storage_name_mount_dir_tuple_list
    runs.append(
        (
            "SharedStorage",
            DuplicateMountDirValidator,
            {"shared_storage_name_mount_dir_tuple_list": mounts, "local_mount_dir_instance_types_dict": {}},
        )
    )
    runs.append(
        (
            "SharedStorage",
            OverlappingMountDirValidator,
            {"shared_mount_dir_list": [d for _, d in mounts], "local_mount_dir_list": []},
        )
    )
    runs.append(
        (
            "SharedStorage",
            ManagedFsxMultiAzValidator,
            {"compute_subnet_ids": config.compute_subnet_ids, "new_storage_count": new},
        )
    )
    if any(isinstance(s, SharedEbs) for s in storages):
        nodes = sum(cr.max_count for q in config.scheduling.queues for cr in q.compute_resources)
        runs.append(("SharedStorage", SharedEbsPerformanceBottleNeckValidator, {"total_max_compute_nodes": nodes}))
    return runs


def _queue(config: Any, where: str, queue: Any) -> list[Run]:
    """BaseQueue, _CommonQueue and SlurmQueue registrations, and SlurmClusterConfig's per compute
    resource, without AWS."""
    from pcluster.config.cluster_config import SlurmComputeResource
    from pcluster.constants import MAX_COMPUTE_RESOURCES_PER_QUEUE
    from pcluster.validators.cluster_validators import (
        ComputeResourceSizeValidator,
        DuplicateNameValidator,
        EfaMultiAzValidator,
        EfaPlacementGroupValidator,
        MaxCountValidator,
        NameValidator,
    )
    from pcluster.validators.ec2_validators import PlacementGroupCapacityTypeValidator
    from pcluster.validators.networking_validators import (
        MultiAzPlacementGroupValidator,
        QueueSubnetsValidator,
        SingleInstanceTypeSubnetValidator,
    )
    from pcluster.validators.slurm_settings_validator import (
        SLURM_SETTINGS_DENY_LIST,
        CustomSlurmSettingLevel,
        CustomSlurmSettingsValidator,
        SlurmNodePrioritiesWarningValidator,
    )
    from pcluster.validators.tags_validators import ComputeResourceTagsValidator

    resources = queue.compute_resources
    subnets = queue.networking.subnet_ids
    # ParallelCluster rejects two subnets of one zone in a queue (QueueSubnetsValidator, with AWS), so
    # in a config it accepts, more than one subnet means more than one Availability Zone.
    multi_az = len(set(subnets)) > 1
    runs: list[Run] = [
        (f"{where}.Name", NameValidator, {"name": queue.name}),
        (
            f"{where}.ComputeResources",
            DuplicateNameValidator,
            {"name_list": [cr.name for cr in resources], "resource_name": "Compute resource"},
        ),
        (
            f"{where}.ComputeResources",
            MaxCountValidator,
            {
                "resources_length": len(resources),
                "max_length": MAX_COMPUTE_RESOURCES_PER_QUEUE,
                "resource_name": "ComputeResources per Queue",
            },
        ),
        # Duplicate subnets only: which zone a subnet is in needs AWS.
        (
            f"{where}.Networking.SubnetIds",
            QueueSubnetsValidator,
            {"queue_name": queue.name, "subnet_ids": subnets, "az_subnet_ids_mapping": {}},
        ),
        (
            f"{where}.ComputeResources",
            SlurmNodePrioritiesWarningValidator,
            {"queue_name": queue.name, "compute_resources": resources},
        ),
    ]
    if any(isinstance(cr, SlurmComputeResource) for cr in resources):
        args = {"queue_name": queue.name, "subnet_ids": subnets}
        runs.append((f"{where}.Networking.SubnetIds", SingleInstanceTypeSubnetValidator, args))
    if queue.custom_slurm_settings:
        args = {
            "custom_settings": [queue.custom_slurm_settings],
            "deny_list": SLURM_SETTINGS_DENY_LIST["Queue"]["Global"],
            "settings_level": CustomSlurmSettingLevel.QUEUE,
        }
        runs.append((f"{where}.CustomSlurmSettings", CustomSlurmSettingsValidator, args))
    _root_volume(
        runs, f"{where}.ComputeSettings.LocalStorage.RootVolume", queue.compute_settings.local_storage.root_volume
    )
    for j, cr in enumerate(resources):
        here = f"{where}.ComputeResources[{j}]"
        chosen = queue.get_chosen_placement_group_setting_for_compute_resource(cr)
        group = f"{here if not cr.networking.placement_group.implied else where}.Networking.PlacementGroup"
        key = queue.get_placement_group_settings_for_compute_resource(cr).get("key")
        runs += [
            (f"{here}.Name", NameValidator, {"name": cr.name}),
            (
                here,
                ComputeResourceSizeValidator,
                {"min_count": cr.min_count, "max_count": cr.max_count, "capacity_type": queue.capacity_type},
            ),
            (
                f"{here}.Efa.Enabled",
                EfaMultiAzValidator,
                {
                    "queue_name": queue.name,
                    "multi_az_enabled": multi_az,
                    "compute_resource_name": cr.name,
                    "compute_resource_efa_enabled": cr.efa.enabled,
                },
            ),
            (
                group,
                MultiAzPlacementGroupValidator,
                {
                    "multi_az_enabled": multi_az,
                    "placement_group_enabled": chosen.enabled_or_assigned,
                    "compute_resource_name": cr.name,
                    "queue_name": queue.name,
                },
            ),
            (
                group,
                EfaPlacementGroupValidator,
                {
                    "efa_enabled": cr.efa.enabled,
                    "placement_group_key": key,
                    "placement_group_disabled": chosen.enabled is False,
                    "multi_az_enabled": multi_az,
                    "capacity_type": queue.capacity_type,
                    "queue_name": queue.name,
                },
            ),
            (
                group,
                PlacementGroupCapacityTypeValidator,
                {"capacity_type": queue.capacity_type, "placement_group_enabled": key is not None},
            ),
            (
                f"{here}.Tags",
                ComputeResourceTagsValidator,
                {
                    "queue_name": queue.name,
                    "compute_resource_name": cr.name,
                    "cluster_tags": config.get_tags(),
                    "queue_tags": queue.get_tags(),
                    "compute_resource_tags": cr.get_tags(),
                },
            ),
        ]
        if cr.custom_slurm_settings:
            args = {
                "custom_settings": [cr.custom_slurm_settings],
                "deny_list": SLURM_SETTINGS_DENY_LIST["ComputeResource"]["Global"],
                "settings_level": CustomSlurmSettingLevel.COMPUTE_RESOURCE,
            }
            runs.append((f"{here}.CustomSlurmSettings", CustomSlurmSettingsValidator, args))
    return runs


def _cluster(config: Any) -> list[Run]:
    """BaseClusterConfig and SlurmClusterConfig registrations, without AWS."""
    from pcluster.constants import MAX_NUMBER_OF_LOGIN_NODE_POOLS
    from pcluster.validators.cluster_validators import (
        ClusterNameValidator,
        IntelHpcOsValidator,
        MaxCountValidator,
        MixedSecurityGroupOverwriteValidator,
        RegionValidator,
        SchedulerValidator,
    )

    runs: list[Run] = []
    if config.config_region:
        runs.append(("Region", RegionValidator, {"region": config.config_region}))
    runs.append(("cluster.name", ClusterNameValidator, {"name": config.cluster_name, "scheduling": config.scheduling}))
    runs.append(("Scheduling.Scheduler", SchedulerValidator, {"scheduler": config.scheduling.scheduler}))
    _root_volume(runs, "HeadNode.LocalStorage.RootVolume", config.head_node.local_storage.root_volume)
    intel = getattr(config.additional_packages, "intel_software", None)
    if intel and intel.intel_hpc_platform:
        runs.append(("AdditionalPackages.IntelSoftware", IntelHpcOsValidator, {"os": config.image.os}))
    runs += _storage(config)
    runs.append(
        (
            "HeadNode.Networking.SecurityGroups",
            MixedSecurityGroupOverwriteValidator,
            {
                "head_node_security_groups": config.head_node.networking.security_groups,
                "queues": config.scheduling.queues,
            },
        )
    )
    if config.login_nodes:
        args = {
            "resources_length": len(config.login_nodes.pools),
            "max_length": MAX_NUMBER_OF_LOGIN_NODE_POOLS,
            "resource_name": "LoginNodePools",
        }
        runs.append(("LoginNodes.Pools", MaxCountValidator, args))
    for i, queue in enumerate(config.scheduling.queues):
        runs += _queue(config, f"Scheduling.SlurmQueues[{i}]", queue)
    return runs


def _execute(runs: list[Run]) -> tuple[list[dict[str, str]], set[str]]:
    """Each validator's failures, and the types that needed the network (their verdicts left out)."""
    from pcluster.validators.common import AsyncValidator, FailureLevel, ValidationResult

    found: list[dict[str, str]] = []
    needs_aws: set[str] = set()
    for where, validator, args in runs:
        name = validator.__name__.removeprefix("AsyncTimed")
        if issubclass(validator, AsyncValidator):  # they fetch URLs (S3, HTTPS)
            needs_aws.add(name)
            continue
        _Network.tried = False
        try:
            failures = validator().execute(**args)
        except Exception as exc:  # noqa: BLE001 - reported as ParallelCluster reports a validator that fails
            failures = [ValidationResult(str(exc), FailureLevel.ERROR, name)]
        if _Network.tried:
            needs_aws.add(name)
            continue
        found += [{"where": where, "level": f.level.name, "type": name, "message": f.message} for f in failures]
    return found, needs_aws


def check(text: str, name: str) -> dict[str, Any]:
    """The schema's messages, or the offline validators' findings when the schema accepts it."""
    from marshmallow import ValidationError
    from pcluster.config.cluster_config import SlurmClusterConfig, SlurmQueue, _BaseSlurmComputeResource
    from pcluster.models.common import parse_config
    from pcluster.schemas.cluster_schema import ClusterSchema

    try:
        config = ClusterSchema(cluster_name=name).load(parse_config(text))
    except ValidationError as exc:
        return {"errors": exc.messages, "validators": [], "needs_aws": []}
    except Exception as exc:  # noqa: BLE001 - pcluster turns any load failure into "Invalid cluster configuration"
        return {"errors": {"_schema": [f"{type(exc).__name__}: {exc}"]}, "validators": [], "needs_aws": []}
    if not isinstance(config, SlurmClusterConfig):
        return {"errors": None, "validators": [], "needs_aws": []}
    try:
        runs = _cluster(config)
        for where, part in _walk(config):
            if not isinstance(part, (SlurmClusterConfig, SlurmQueue, _BaseSlurmComputeResource)):
                runs += _registered(where, part)
    except Exception as exc:  # noqa: BLE001 - a config this check does not foresee: say so, block nothing
        message = (
            f"ParallelCluster's validators could not run offline ({type(exc).__name__}: {exc}); "
            "`ctrain cluster validate --aws` runs them"
        )
        return {"errors": None, "validators": [_skipped(message)], "needs_aws": []}
    found, needs_aws = _execute(runs)
    return {"errors": None, "validators": found, "needs_aws": sorted(needs_aws)}


def _skipped(message: str) -> dict[str, str]:
    return {"where": "", "level": "WARNING", "type": "offline check", "message": message}


def main(argv: list[str]) -> int:
    name, region, *paths = argv[1:]
    for key in _DROP:
        os.environ.pop(key, None)
    os.environ.update(_OFFLINE, AWS_DEFAULT_REGION=region)
    _Network.close()

    import botocore
    import botocore.session
    from pcluster import utils

    # ParallelCluster's region list as shipped in its package, which it falls back to without S3.
    regions = (files("pcluster") / "resources" / "supported-regions").read_text(encoding="utf-8")
    utils.retrieve_supported_regions.cache = regions.split("\n")  # type: ignore[attr-defined]
    ec2 = botocore.session.get_session().get_service_model("ec2")
    configs = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            configs.append(check(fh.read(), name))
    reply = {
        "version": utils.get_installed_version(),
        "botocore": botocore.__version__,
        "instance_types": sorted(ec2.shape_for("InstanceType").enum),
        "configs": configs,
    }
    print(json.dumps(reply, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
