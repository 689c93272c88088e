"""``ctrain cluster`` against real ParallelCluster code: its config schema offline, its CLI and
validators against an in-process AWS emulator (moto), and a pcluster CLI double for what needs a
real AWS account (creating and deleting clusters)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from ctrain.cli import main
from ctrain.cluster import base, checks
from ctrain.config import ProjectConfig
from ctrain.errors import CtrainError
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
        base.pcluster_bin(), base.pcluster_python()
    except CtrainError:
        need(False, "the pcluster CLI and library (pip install 'ctrain[aws]')")


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
    [{}, {"gpu_queue": False}, {"capacity_reservation": "cr-0123456789abcdef0", "capacity_type": "CAPACITY_BLOCK"}],
    ids=["gpu-efa", "cpu-only", "capacity-reservation"],
)
def test_shipped_config_passes_parallelclusters_schema(tmp_path: Path, settings: dict[str, Any]) -> None:
    config, _ = init(tmp_path, **settings)
    result = ctrain(config, "validate")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith("pcluster.yaml: valid (ParallelCluster schema, ctrain rules)")


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


def test_schema_check_keeps_its_dummy_credentials_to_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws(monkeypatch, tmp_path)
    config, written = init(tmp_path)
    setup = base.load(ProjectConfig(path=config), {})
    assert checks.schema_problems(written, "ctrain", REGION) == []
    assert "AWS_ACCESS_KEY_ID" not in os.environ and "AWS_ENDPOINT_URL" not in os.environ
    assert checks.ctrain_problems(setup, checks.read(written)) == []


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
    assert "valid (ParallelCluster schema, ctrain rules, ParallelCluster validators in AWS)" in result.stdout
    assert "[pcluster DeletionPolicyValidator]" in result.stdout  # a validator that ran and passed with a note
    s3 = boto3.client("s3", endpoint_url=aws_env.url)
    uploaded = s3.get_object(Bucket=aws_env.bucket, Key="ctrain/enroot-pyxis.sh")["Body"].read()
    assert uploaded == (base.SHIPPED / "scripts" / "enroot-pyxis.sh").read_bytes()


def test_missing_cluster_is_a_message_not_a_traceback(tmp_path: Path, aws_env: MotoAws) -> None:
    result = ctrain(project(tmp_path), "status")  # the real pcluster CLI asks (emulated) CloudFormation
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cluster 'ctrain' not found in {REGION}; `ctrain cluster up` creates it"
    assert "Traceback" not in result.output


# --- up / status / ssh / down with the pcluster double ------------------------------------------


def test_up_creates_waits_and_prints_the_head_node(
    tmp_path: Path, aws_env: MotoAws, pcluster_double: PclusterDouble
) -> None:
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
