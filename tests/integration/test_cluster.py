"""``ctrain cluster`` against real ParallelCluster code: its config schema offline, its CLI and
validators against an in-process AWS emulator (moto), and a pcluster CLI double for what needs a
real AWS account (creating and deleting clusters)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from ctrain import remote, resources
from ctrain.cli import main
from ctrain.cluster import checks
from ctrain.cluster import setup as cluster_setup
from ctrain.config import ProjectConfig
from ctrain.errors import CtrainError
from tests.badinput import Case, run_case
from tests.conftest import need
from tests.plugins.cluster import (
    REGION,
    MotoAws,
    PclusterDouble,
    cluster_summary,
    compute_node,
    described,
    isolate_aws,
    not_found,
    stack_event,
)

pytestmark = pytest.mark.integration

EXAMPLE = {
    "region": REGION,
    "head_node_subnet": "subnet-0123456789abcdef0",
    "key_pair": "my-key",
    "scripts_s3_uri": "s3://my-bucket/ctrain",
}
# ParallelCluster validators that fail only because moto does not emulate what they call:
EMULATOR_LIMITS = {
    # moto's DescribeKeyPairs reply lacks KeyType, which the validator reads ("'KeyType'").
    "KeyPairValidator",
    # both launch the instances with DryRun=True to test the launch template; moto answers that
    # request with "The request must contain the parameter ebs" instead of DryRunOperation.
    "HeadNodeLaunchTemplateValidator",
    "ComputeResourceLaunchTemplateValidator",
}


@pytest.fixture(autouse=True)
def _pcluster_installed() -> None:
    try:
        cluster_setup.pcluster_bin(), cluster_setup.pcluster_python()
    except CtrainError:
        need(False, "the pcluster CLI and library (pip install 'ctrain-slurm[aws]')")


def project(tmp_path: Path, **settings: Any) -> Path:
    path = tmp_path / "ctrain.yaml"
    path.write_text(yaml.safe_dump({"cluster": {**EXAMPLE, **settings}}))
    return path


def ctrain(config: Path, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, ["--config", str(config), "cluster", *args], input=input)


def init(tmp_path: Path, **settings: Any) -> tuple[Path, Path]:
    config = project(tmp_path, **settings)
    result = ctrain(config, "init")
    assert result.exit_code == 0, result.output
    return config, Path(result.stdout.strip())


# --- ParallelCluster's schema, offline ----------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"gpu_queue": False},
        {
            "capacity_reservation": "cr-0123456789abcdef0",
            "capacity_type": "CAPACITY_BLOCK",
            "gpu_min_nodes": 2,
            "gpu_max_nodes": 2,
        },
    ],
    ids=["gpu-efa", "cpu-only", "capacity-reservation"],
)
def test_shipped_config_passes_parallelclusters_schema(tmp_path: Path, settings: dict[str, Any]) -> None:
    config, _ = init(tmp_path, **settings)
    result = ctrain(config, "validate")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(
        "pcluster.yaml: valid (ParallelCluster schema and offline validators, ctrain rules)"
    )


def _edit(path: Path, change: Any) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _queue(data: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return data["Scheduling"]["SlurmQueues"][i]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["HeadNode"].update(InstanceTyp="m6i.2xlarge"), "HeadNode.InstanceTyp: Unknown field."),
        (
            lambda d: _queue(d)["ComputeResources"][0].update(MaxCount="two"),
            "Scheduling.SlurmQueues[0].ComputeResources[0].MaxCount: Not a valid integer.",
        ),
        (lambda d: d["Image"].update(Os="debian12"), "Image.Os: Must be one of: alinux2023"),
        (
            lambda d: _queue(d)["Networking"].pop("SubnetIds"),
            "Scheduling.SlurmQueues[0].Networking.SubnetIds: Missing data for required field.",
        ),
    ],
    ids=["unknown-key", "wrong-type", "bad-enum", "missing-subnets"],
)
def test_schema_messages_reach_the_user(tmp_path: Path, change: Any, expected: str) -> None:
    config, written = init(tmp_path)
    _edit(written, change)
    result = ctrain(config, "validate")
    assert result.exit_code == 2, result.output
    assert "pcluster.yaml is not a valid ParallelCluster config" in result.stderr
    assert expected in result.stderr
    assert "[ParallelCluster schema]" in result.stderr
    assert "Traceback" not in result.output


def test_ctrain_rules_and_schema_report_together(tmp_path: Path) -> None:
    config, written = init(tmp_path)

    def break_it(d: dict[str, Any]) -> None:
        _queue(d, 1)["ComputeResources"][0]["Efa"] = {"Enabled": True}
        _queue(d)["ComputeResources"][0]["CapacityReservationTarget"] = {"CapacityReservationId": "cr-1"}
        d["HeadNode"]["Dcv"] = {"Enabled": "sometimes"}

    _edit(written, break_it)
    result = ctrain(config, "validate")
    assert result.exit_code == 2
    assert "c6i.2xlarge has no EFA" in result.stderr
    assert "PlacementGroup.Enabled: a new placement group conflicts with the capacity reservation" in result.stderr
    assert "HeadNode.Dcv.Enabled: Not a valid boolean." in result.stderr


def test_offline_check_keeps_its_dummy_credentials_to_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws(monkeypatch, tmp_path)
    config, written = init(tmp_path)
    setup = cluster_setup.load(ProjectConfig(path=config), {})
    (found,) = checks.offline([written], "ctrain", REGION)
    assert checks.errors(found.problems) == []
    assert "AWS_ACCESS_KEY_ID" not in os.environ and "AWS_ENDPOINT_URL" not in os.environ
    assert checks.ctrain_problems(setup, checks.read(written), found) == []


# --- ParallelCluster's validators offline: hostile configs derived from the golden ones ----------

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "cluster"
GOLDENS = ("gpu_efa", "cpu_only", "capacity_reservation")


@dataclass(frozen=True)
class Hostile:
    """A golden config with one mistake: the key path its error names and what the error says."""

    id: str
    golden: str
    change: Callable[[dict[str, Any]], Any]
    where: str
    says: str
    not_says: str = ""


def _resource(data: dict[str, Any], i: int = 0, j: int = 0) -> dict[str, Any]:
    return _queue(data, i)["ComputeResources"][j]


def _second_fsx(data: dict[str, Any]) -> None:
    data["SharedStorage"].append({**data["SharedStorage"][0], "Name": "fsx2", "MountDir": "/fsx2"})


Q0, CR00 = "Scheduling.SlurmQueues[0]", "Scheduling.SlurmQueues[0].ComputeResources[0]"
HOSTILE = [
    Hostile(
        "queue-name-uppercase",
        "gpu_efa",
        lambda d: _queue(d).update(Name="GPU"),
        f"{Q0}.Name",
        "Invalid name 'GPU'. Name must begin with a letter and only contain lowercase letters, digits and hyphens.",
    ),
    Hostile(
        "queue-name-36-chars",
        "cpu_only",
        lambda d: _queue(d).update(Name="a" * 36),
        f"{Q0}.Name",
        f"Invalid name '{'a' * 36}'. Name can be at most 25 chars long.",
    ),
    Hostile(
        "queue-named-default",
        "cpu_only",
        lambda d: _queue(d).update(Name="default"),
        f"{Q0}.Name",
        "It is forbidden to use 'default' as a name.",
    ),
    Hostile(
        "queue-names-twice",
        "gpu_efa",
        lambda d: _queue(d, 1).update(Name="gpu"),
        "Scheduling.SlurmQueues",
        "Queue name gpu must be unique.",
    ),
    Hostile(
        "compute-resource-name-underscore",
        "gpu_efa",
        lambda d: _resource(d).update(Name="p5_48xlarge"),
        f"{CR00}.Name",
        "Invalid name 'p5_48xlarge'.",
    ),
    Hostile(
        "min-count-above-max-count",
        "gpu_efa",
        lambda d: _resource(d).update(MinCount=3),
        CR00,
        "Max count must be greater than or equal to min count.",
    ),
    Hostile(
        "capacity-block-min-below-max",
        "capacity_reservation",
        lambda d: _resource(d).update(MinCount=2),
        CR00,
        "Max count must be set to the same value of min count when using Capacity Block reservation.",
    ),
    Hostile(
        "misspelt-instance-type-without-efa",
        "gpu_efa",
        lambda d: _resource(d, 1).update(InstanceType="c6i.2xlarg"),
        "Scheduling.SlurmQueues[1].ComputeResources[0].InstanceType",
        "'c6i.2xlarg' is not an EC2 instance type: did you mean c6i.2xlarge?",
    ),
    Hostile(
        "misspelt-efa-instance-type",
        "gpu_efa",
        lambda d: _resource(d).update(InstanceType="p5.48xlrge"),
        f"{CR00}.InstanceType",
        "'p5.48xlrge' is not an EC2 instance type: did you mean p5.48xlarge?",
        not_says="has no EFA",
    ),
    Hostile(
        "misspelt-head-node-type",
        "cpu_only",
        lambda d: d["HeadNode"].update(InstanceType="m6i.2xlarg"),
        "HeadNode.InstanceType",
        "did you mean m6i.2xlarge?",
    ),
    Hostile(
        "efa-on-an-instance-without-efa",
        "gpu_efa",
        lambda d: _resource(d, 1).update(Efa={"Enabled": True}),
        "Scheduling.SlurmQueues[1].ComputeResources[0].Efa.Enabled",
        "c6i.2xlarge has no EFA",
    ),
    Hostile(
        "efa-without-a-placement-group-setting",
        "gpu_efa",
        lambda d: _queue(d)["Networking"].pop("PlacementGroup"),
        f"{Q0}.Networking.PlacementGroup",
        "The placement group for EFA-enabled compute resources in queue 'gpu' must be explicit.",
    ),
    Hostile(
        "subnet-twice",
        "cpu_only",
        lambda d: _queue(d)["Networking"]["SubnetIds"].append("subnet-0fedcba9876543210"),
        f"{Q0}.Networking.SubnetIds",
        "The following Subnet Ids are specified multiple times",
    ),
    Hostile(
        "efa-across-availability-zones",
        "gpu_efa",
        lambda d: _queue(d)["Networking"]["SubnetIds"].append("subnet-0123456789abcdef0"),
        f"{CR00}.Efa.Enabled",
        "EFA is not supported across Availability zones.",
    ),
    Hostile(
        "reserved-mount-dir",
        "gpu_efa",
        lambda d: d["SharedStorage"][0].update(MountDir="/opt"),
        "SharedStorage[0].MountDir",
        "The shared storage mount directory /opt is reserved. Please use another directory",
    ),
    Hostile(
        "storage-name-31-chars",
        "gpu_efa",
        lambda d: d["SharedStorage"][0].update(Name="f" * 31),
        "SharedStorage[0].Name",
        "Name can be at most 30 chars long.",
    ),
    Hostile(
        "fsx-capacity-off-its-steps",
        "gpu_efa",
        lambda d: d["SharedStorage"][0]["FsxLustreSettings"].update(StorageCapacity=2000),
        "SharedStorage[0]",
        "Capacity for FSx SCRATCH_2 file systems is 1,200 GB or increments of 2,400 GB.",
    ),
    Hostile("two-new-fsx", "gpu_efa", _second_fsx, "SharedStorage", "Too many new FSx shared storage"),
    Hostile(
        "io1-root-volume-too-small",
        "gpu_efa",
        lambda d: d["HeadNode"]["LocalStorage"]["RootVolume"].update(VolumeType="io1", Size=2),
        "HeadNode.LocalStorage.RootVolume",
        "The size of io1 volumes must be at least 4 GiB.",
    ),
    Hostile(
        "region-parallelcluster-lacks",
        "cpu_only",
        lambda d: d.update(Region="us-east-7"),
        "Region",
        "Region 'us-east-7' is not yet officially supported by ParallelCluster",
    ),
    Hostile(
        "slurm-setting-parallelcluster-owns",
        "cpu_only",
        lambda d: _queue(d).update(CustomSlurmSettings={"PartitionName": "other"}),
        f"{Q0}.CustomSlurmSettings",
        "PartitionName",
    ),
]


Verdicts = dict[str, tuple[list[checks.Problem], checks.Offline]]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> Verdicts:
    """Every golden and hostile config through ParallelCluster's offline check (one process for all,
    as loading ParallelCluster takes most of the time) and ctrain's rules, as `validate` does."""
    try:
        cluster_setup.pcluster_python()
    except CtrainError:
        need(False, "the pcluster CLI and library (pip install 'ctrain-slurm[aws]')")
    root = tmp_path_factory.mktemp("hostile")
    setup = cluster_setup.load(ProjectConfig(path=root / "ctrain.yaml"), EXAMPLE)
    configs = {name: yaml.safe_load((GOLDEN / f"{name}.yaml").read_text()) for name in GOLDENS}
    for case in HOSTILE:
        configs[case.id] = data = yaml.safe_load((GOLDEN / f"{case.golden}.yaml").read_text())
        case.change(data)
    paths = []
    for name, data in configs.items():
        paths.append(root / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(data, sort_keys=False))
    found = checks.offline(paths, "ctrain", REGION)
    return {
        name: (checks.ctrain_problems(setup, data, result) + result.problems, result)
        for (name, data), result in zip(configs.items(), found)
    }


@pytest.mark.parametrize("golden", GOLDENS)
def test_golden_configs_pass_parallelclusters_offline_validators(verdicts: Verdicts, golden: str) -> None:
    problems, offline = verdicts[golden]
    assert checks.errors(problems) == []
    assert "pcluster DetailedMonitoringValidator" in {p.source for p in problems}  # they ran: this one has a say
    # Left to AWS, without a network call: the instance types offered in the region, the scripts' URLs.
    assert {"InstanceTypeValidator", "UrlValidator"} <= set(offline.needs_aws)


@pytest.mark.parametrize("case", HOSTILE, ids=lambda c: c.id)
def test_hostile_config_is_rejected_naming_where_and_why(verdicts: Verdicts, case: Hostile) -> None:
    problems = checks.errors(verdicts[case.id][0])
    report = "\n".join(map(str, problems))
    assert any(p.where == case.where and case.says in p.message for p in problems), report
    if case.not_says:
        assert case.not_says not in report


def _golden_with(golden: str, change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def write(workdir: Path) -> None:
        data = yaml.safe_load((GOLDEN / f"{golden}.yaml").read_text())
        change(data)
        (workdir / "pcluster.yaml").write_text(yaml.safe_dump(data, sort_keys=False))

    return write


def _cli(case: Hostile, command: str = "validate") -> Case:
    says = [f"{case.where}: {case.says}", "pcluster.yaml is not a valid ParallelCluster config"]
    setup = _golden_with(case.golden, case.change)
    # Loading ParallelCluster takes about 2 s; the limit leaves room for a busy CI machine.
    return Case(f"{command}-{case.id}", ["cluster", command, "pcluster.yaml"], says, setup)


SRC = {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
BY_ID = {case.id: case for case in HOSTILE}
CLI_CASES = [
    _cli(BY_ID["queue-name-uppercase"]),
    _cli(BY_ID["min-count-above-max-count"]),
    _cli(BY_ID["misspelt-instance-type-without-efa"]),
    _cli(BY_ID["misspelt-efa-instance-type"]),
    _cli(BY_ID["queue-names-twice"], "up"),  # refused before any AWS call: no credentials here
]


@pytest.mark.parametrize("case", [replace(c, env=SRC, exit_code=2) for c in CLI_CASES], ids=lambda c: c.id)
def test_cluster_command_refuses_a_hostile_config_in_one_error(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate_aws(monkeypatch, tmp_path)
    result = run_case(case, tmp_path / "work")
    assert "has no EFA" not in result.stderr


# --- ParallelCluster's CLI and validators against moto ------------------------------------------


def test_dry_run_runs_parallelclusters_validators(tmp_path: Path, aws_env: MotoAws) -> None:
    import boto3

    need(shutil.which("node") is not None, "Node.js for pcluster's CDK (scripts/setup.sh installs the cluster group)")

    config, _ = init(
        tmp_path,
        head_node_subnet=aws_env.head_subnet,
        compute_subnet=aws_env.compute_subnet,
        key_pair=aws_env.key_pair,
        custom_ami=aws_env.ami,
        scripts_s3_uri=f"s3://{aws_env.bucket}/ctrain",
    )
    # Unsuppressed, the emulator's gaps are the only errors.
    blocked = ctrain(config, "validate", "--aws")
    assert blocked.exit_code == 2, blocked.output
    failed = {
        line.rsplit("[pcluster ", 1)[1].rstrip("]") for line in blocked.stderr.splitlines() if "  error: " in line
    }
    assert failed == EMULATOR_LIMITS
    suppress = [arg for name in sorted(EMULATOR_LIMITS) for arg in ("--suppress-validator", name)]
    result = ctrain(config, "validate", "--aws", *suppress)
    assert result.exit_code == 0, result.output
    checked = "ParallelCluster schema and offline validators, ctrain rules, ParallelCluster validators in AWS"
    assert f"valid ({checked})" in result.stdout
    assert "[pcluster DeletionPolicyValidator]" in result.stdout  # a validator that ran and passed with a note
    s3 = boto3.client("s3", endpoint_url=aws_env.url)
    uploaded = s3.get_object(Bucket=aws_env.bucket, Key="ctrain/enroot-pyxis.sh")["Body"].read()
    assert uploaded == resources.path("cluster", "scripts", "enroot-pyxis.sh").read_bytes()


def test_missing_cluster_is_a_message_not_a_traceback(tmp_path: Path, aws_env: MotoAws) -> None:
    result = ctrain(project(tmp_path), "status")  # the real pcluster CLI asks (emulated) CloudFormation
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cluster 'ctrain' not found in {REGION}; `ctrain cluster up` creates it"
    assert "Traceback" not in result.output


# --- up / status / ssh / down with the pcluster double ------------------------------------------


def test_up_creates_waits_and_prints_the_head_node(
    tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    clusters = tmp_path / "config" / "clusters.yaml"
    monkeypatch.setenv(remote.PROFILES_ENV, str(clusters))
    config, written = init(tmp_path, scripts_s3_uri=f"s3://{aws_env.bucket}/ctrain")
    double = pcluster_double
    double.reply("describe-cluster", 1, not_found("ctrain"), "NotFoundExceptionResponseContent")
    for status, head in [
        ("CREATE_IN_PROGRESS", None),
        ("CREATE_IN_PROGRESS", "pending"),
        ("CREATE_IN_PROGRESS", "running"),
    ]:
        double.reply(
            "describe-cluster",
            0,
            described("ctrain", status, "CREATE_IN_PROGRESS", head=head),
            "DescribeClusterResponseContent",
        )
    double.reply(
        "describe-cluster",
        0,
        described("ctrain", "CREATE_COMPLETE", "CREATE_COMPLETE", "RUNNING", "running"),
        "DescribeClusterResponseContent",
    )
    warning = {"level": "WARNING", "type": "DetailedMonitoringValidator", "message": "Detailed Monitoring is enabled."}
    double.reply(
        "create-cluster",
        0,
        {
            "cluster": cluster_summary("ctrain", "CREATE_IN_PROGRESS", "CREATE_IN_PROGRESS"),
            "validationMessages": [warning],
        },
        "CreateClusterResponseContent",
    )
    result = ctrain(config, "up", "--poll", "0")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "cluster 'ctrain' is ready: head node 54.0.0.12"
    assert double.calls("create-cluster") == [
        [
            "create-cluster",
            "--cluster-name",
            "ctrain",
            "--cluster-configuration",
            str(written),
            "--region",
            REGION,
        ]
    ]
    assert "warning: Detailed Monitoring is enabled. [pcluster DetailedMonitoringValidator]" in result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert [line.split("] ", 1)[1] for line in progress] == [
        "CREATE_IN_PROGRESS (CloudFormation CREATE_IN_PROGRESS; head node not started)",
        "CREATE_IN_PROGRESS (CloudFormation CREATE_IN_PROGRESS; head node pending)",
        "CREATE_IN_PROGRESS (CloudFormation CREATE_IN_PROGRESS; head node running)",
        "CREATE_COMPLETE (CloudFormation CREATE_COMPLETE; head node running)",
    ]
    assert f"uploaded s3://{aws_env.bucket}/ctrain/enroot-pyxis.sh" in result.stderr
    # A profile for the head node: the laptop's `--cluster ctrain` reaches it (ctrain.remote).
    assert f"cluster profile 'ctrain' in {clusters}" in result.stderr
    found = remote.resolve("ctrain")
    assert found is not None and found.profile == remote.Profile(
        host="54.0.0.12", user="ubuntu", project_dir=f"/fsx/ubuntu/{config.parent.name}", runtime="pyxis")  # fmt: skip
    again = ctrain(config, "up")  # already up: no second create
    assert again.exit_code == 0 and len(double.calls("create-cluster")) == 1


def test_up_failure_prints_the_failed_stack_events(
    tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble
) -> None:
    config, _ = init(tmp_path, scripts_s3_uri=f"s3://{aws_env.bucket}/ctrain")
    double = pcluster_double
    double.reply("describe-cluster", 1, not_found("ctrain"), "NotFoundExceptionResponseContent")
    failed = described("ctrain", "CREATE_FAILED", "ROLLBACK_IN_PROGRESS")
    failed["failures"] = [{"failureCode": "HeadNodeBootstrapFailure", "failureReason": "Cluster creation timed out."}]
    double.reply("describe-cluster", 0, failed, "DescribeClusterResponseContent")
    double.reply(
        "create-cluster",
        0,
        {"cluster": cluster_summary("ctrain", "CREATE_IN_PROGRESS", "CREATE_IN_PROGRESS")},
        "CreateClusterResponseContent",
    )
    events = [  # newest first, as CloudFormation lists them
        stack_event("ComputeFleet", "AWS::CloudFormation::Stack", "CREATE_FAILED", "Resource creation cancelled"),
        stack_event(
            "HeadNodeWaitCondition",
            "AWS::CloudFormation::WaitCondition",
            "CREATE_FAILED",
            "Failed to receive 1 resource signal(s) within the specified duration",
        ),
        stack_event("HeadNode", "AWS::EC2::Instance", "CREATE_COMPLETE"),
        stack_event("FSx", "AWS::FSx::FileSystem", "CREATE_FAILED", "Storage capacity is not available in this AZ"),
    ]
    double.reply("get-cluster-stack-events", 0, {"events": events}, "GetClusterStackEventsResponseContent")
    result = ctrain(config, "up", "--poll", "0")
    assert result.exit_code == 1
    assert "cluster 'ctrain' is CREATE_FAILED (CloudFormation ROLLBACK_IN_PROGRESS)" in result.stderr
    assert "HeadNodeBootstrapFailure: Cluster creation timed out." in result.stderr
    fsx = result.stderr.index("FSx (AWS::FSx::FileSystem) CREATE_FAILED: Storage capacity is not available in this AZ")
    wait = result.stderr.index("HeadNodeWaitCondition (AWS::CloudFormation::WaitCondition) CREATE_FAILED: Failed to")
    assert fsx < wait  # oldest first: the first failure is what broke the rest
    assert "Resource creation cancelled" not in result.stderr
    assert double.calls("get-cluster-stack-events") == [
        ["get-cluster-stack-events", "--cluster-name", "ctrain", "--region", REGION]
    ]


def test_up_passes_parallelclusters_config_errors_through(
    tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble
) -> None:
    config, _ = init(tmp_path, scripts_s3_uri=f"s3://{aws_env.bucket}/ctrain")
    pcluster_double.reply("describe-cluster", 1, not_found("ctrain"), "NotFoundExceptionResponseContent")
    error = {
        "level": "ERROR",
        "type": "InstanceTypeValidator",
        "message": "The instance type 'p5.48xlarge' is not supported.",
    }
    pcluster_double.reply(
        "create-cluster",
        1,
        {"message": "Invalid cluster configuration.", "configurationValidationErrors": [error]},
        "CreateClusterBadRequestExceptionResponseContent",
    )
    result = ctrain(config, "up", "--poll", "0")
    assert result.exit_code == 2
    assert "error: The instance type 'p5.48xlarge' is not supported. [pcluster InstanceTypeValidator]" in result.stderr


def test_status_shows_state_head_node_and_fleet(
    tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble
) -> None:
    config = project(tmp_path)
    pcluster_double.reply(
        "describe-cluster",
        0,
        described("ctrain", "CREATE_COMPLETE", "CREATE_COMPLETE", "RUNNING", "running"),
        "DescribeClusterResponseContent",
    )
    instances = [compute_node(f"i-0{n}", "gpu", "p5.48xlarge", "running") for n in "ab"]
    instances.append(compute_node("i-0c", "gpu", "p5.48xlarge", "pending"))
    pcluster_double.reply(
        "describe-cluster-instances", 0, {"instances": instances}, "DescribeClusterInstancesResponseContent"
    )
    result = ctrain(config, "status")
    assert result.exit_code == 0, result.output
    keys = ("cluster", "state", "head node", "compute fleet", "compute nodes")
    lines = {
        key: line[len(key) :].strip()
        for line in result.stdout.splitlines()
        for key in keys
        if line.startswith(key + " ")
    }
    assert lines["state"] == "CREATE_COMPLETE (CloudFormation CREATE_COMPLETE)"
    assert lines["head node"] == "54.0.0.12 (private 10.0.0.12), running, m6i.2xlarge"
    assert lines["compute fleet"] == "RUNNING"
    assert lines["compute nodes"] == "gpu: 1 pending p5.48xlarge; gpu: 2 running p5.48xlarge"
    assert pcluster_double.calls("describe-cluster-instances") == [
        ["describe-cluster-instances", "--cluster-name", "ctrain", "--node-type", "ComputeNode", "--region", REGION]
    ]


def test_down_asks_then_waits_until_gone(tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble) -> None:
    config, _ = init(tmp_path)
    double = pcluster_double
    complete = described("ctrain", "CREATE_COMPLETE", "CREATE_COMPLETE", "RUNNING", "running")
    double.reply("describe-cluster", 0, complete, "DescribeClusterResponseContent")
    refused = ctrain(config, "down", input="n\n")
    assert refused.exit_code == 1
    assert "the FSx file system at /fsx and ALL data on it" in refused.stderr
    assert "not confirmed; nothing deleted" in refused.stderr
    assert double.calls("delete-cluster") == []

    double.reply(
        "describe-cluster",
        0,
        described("ctrain", "DELETE_IN_PROGRESS", "DELETE_IN_PROGRESS", "STOPPED", "shutting-down"),
        "DescribeClusterResponseContent",
    )
    double.reply("describe-cluster", 1, not_found("ctrain"), "NotFoundExceptionResponseContent")
    double.reply(
        "delete-cluster",
        0,
        {"cluster": cluster_summary("ctrain", "DELETE_IN_PROGRESS", "DELETE_IN_PROGRESS")},
        "DeleteClusterResponseContent",
    )
    result = ctrain(config, "down", "--poll", "0", input="y\n")
    assert result.exit_code == 0, result.output
    assert double.calls("delete-cluster") == [["delete-cluster", "--cluster-name", "ctrain", "--region", REGION]]
    assert "cluster 'ctrain' is gone" in result.stderr
    assert result.stdout.strip().endswith("cluster 'ctrain' deleted")


def test_down_failure_prints_the_failed_stack_events(
    tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble
) -> None:
    config = project(tmp_path)
    double = pcluster_double
    double.reply(
        "describe-cluster",
        0,
        described("ctrain", "CREATE_COMPLETE", "CREATE_COMPLETE", "RUNNING", "running"),
        "DescribeClusterResponseContent",
    )
    double.reply(
        "describe-cluster",
        0,
        described("ctrain", "DELETE_FAILED", "DELETE_FAILED", "STOPPED"),
        "DescribeClusterResponseContent",
    )
    double.reply(
        "delete-cluster",
        0,
        {"cluster": cluster_summary("ctrain", "DELETE_IN_PROGRESS", "DELETE_IN_PROGRESS")},
        "DeleteClusterResponseContent",
    )
    event = stack_event("FSx", "AWS::FSx::FileSystem", "DELETE_FAILED", "File system has active data repository tasks")
    double.reply("get-cluster-stack-events", 0, {"events": [event]}, "GetClusterStackEventsResponseContent")
    result = ctrain(config, "down", "--yes", "--poll", "0")
    assert result.exit_code == 1
    assert "FSx (AWS::FSx::FileSystem) DELETE_FAILED: File system has active data repository tasks" in result.stderr


def test_unexpected_reply_shape_is_a_parse_error_with_the_raw_text(
    tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble
) -> None:
    config = project(tmp_path)
    off_spec = {"clusterName": "ctrain", "status": "RUNNING"}  # not the documented shape: no clusterStatus
    pcluster_double.reply("describe-cluster", 0, off_spec, None)
    result = ctrain(config, "status")
    assert result.exit_code == 1
    assert "could not parse `pcluster describe-cluster` output (no clusterStatus)" in result.stderr
    assert '"status": "RUNNING"' in result.stderr


def test_missing_credentials_stop_before_pcluster_is_called(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pcluster_double: PclusterDouble
) -> None:
    isolate_aws(monkeypatch, tmp_path)
    config, _ = init(tmp_path)
    for command in (["status"], ["up"]):
        result = ctrain(config, *command)
        assert result.exit_code == 3, (command, result.output)
        assert "no AWS credentials found" in result.stderr and "aws configure" in result.stderr
    assert pcluster_double.calls() == []


def test_down_of_a_missing_cluster_deletes_nothing(
    tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble
) -> None:
    pcluster_double.reply("describe-cluster", 1, not_found("ctrain"), "NotFoundExceptionResponseContent")
    result = ctrain(project(tmp_path), "down", "--yes")
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cluster 'ctrain' not found in {REGION}; nothing to delete"
    assert pcluster_double.calls("delete-cluster") == []


def test_ssh_execs_pcluster_ssh(tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble) -> None:
    config = project(tmp_path)
    key = tmp_path / ".ssh" / "my-key.pem"  # HOME is tmp_path: the key pair's default file
    key.parent.mkdir()
    key.write_text("not a real key")
    pcluster_double.reply("ssh", 0, None, None)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "ctrain", "--config", str(config), "cluster", "ssh", "--", "-L", "8888:localhost:8888"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert pcluster_double.calls() == [["ssh", "--cluster-name", "ctrain", "-i", str(key), "-L", "8888:localhost:8888"]]
    assert pcluster_double.region_env() == [REGION]
