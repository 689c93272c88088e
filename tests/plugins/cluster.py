"""Fixtures for ``ctrain cluster`` tests: an in-process AWS emulator (moto) and a pcluster CLI double.

moto runs as a server on 127.0.0.1 in this process; the real ``pcluster`` CLI and ctrain's helpers
reach it through ``AWS_ENDPOINT_URL``, with dummy credentials set only for the test that asks.
The pcluster double stands in where nothing real can run (creating a cluster needs AWS): it records
the argv ctrain sends and answers with JSON in the shapes of ParallelCluster's published API
(checked against pcluster's own OpenAPI spec), so tests reach exactly that boundary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import golden_files
from tests.conftest import need

REGION = "us-east-1"
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@dataclass(frozen=True)
class MotoAws:
    """A moto server on loopback, seeded like a real account ready for ParallelCluster."""

    url: str
    vpc: str
    head_subnet: str
    compute_subnet: str
    key_pair: str
    ami: str
    bucket: str

    def env(self) -> dict[str, str]:
        return {**DUMMY_CREDENTIALS, "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": self.url}


@pytest.fixture(scope="session")
def moto_aws() -> Iterator[MotoAws]:
    need(
        importlib.util.find_spec("boto3") is not None and importlib.util.find_spec("moto") is not None,
        "boto3 and moto (pip install 'ctrain-slurm[aws,test]')",
    )
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    session = boto3.Session(region_name=REGION, **{k.lower(): v for k, v in DUMMY_CREDENTIALS.items()})
    ec2 = session.client("ec2", endpoint_url=url)
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    for attribute in ("EnableDnsSupport", "EnableDnsHostnames"):
        ec2.modify_vpc_attribute(VpcId=vpc, **{attribute: {"Value": True}})
    subnets = [
        ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.0.{i}.0/24", AvailabilityZone=f"{REGION}a")["Subnet"]["SubnetId"]
        for i in range(2)
    ]
    ec2.create_key_pair(KeyName="ctrain-test")
    builder = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    ami = ec2.create_image(InstanceId=builder, Name="ctrain-test-pcluster-ami")["ImageId"]
    session.client("s3", endpoint_url=url).create_bucket(Bucket="ctrain-test-scripts")
    try:
        yield MotoAws(url, vpc, subnets[0], subnets[1], "ctrain-test", ami, "ctrain-test-scripts")
    finally:
        server.stop()


@pytest.fixture
def aws_env(moto_aws: MotoAws, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> MotoAws:
    """This test's environment points every AWS SDK at moto, with dummy credentials."""
    isolate_aws(monkeypatch, tmp_path)
    for key, value in moto_aws.env().items():
        monkeypatch.setenv(key, value)
    return moto_aws


def isolate_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials from the machine: no AWS variables, no ~/.aws, no instance metadata."""
    for key in AWS_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HOME", str(tmp_path))


# --- golden files ------------------------------------------------------------------------------

def assert_golden(name: str, text: str) -> None:
    """``text`` equals tests/golden/cluster/NAME."""
    golden_files.assert_golden("cluster", name, text)


# --- the pcluster CLI double --------------------------------------------------------------------

_DOUBLE = '''#!{python}
"""Test double for the pcluster CLI (tests/plugins/cluster.py): records argv, replays JSON replies."""
import json, os, sys
plan_path = os.environ["CTRAIN_PCLUSTER_DOUBLE"]
with open(plan_path) as fh:
    plan = json.load(fh)
command = sys.argv[1] if len(sys.argv) > 1 else ""
plan["calls"].append({{"argv": sys.argv[1:], "region_env": os.environ.get("AWS_DEFAULT_REGION")}})
queue = plan["replies"].get(command) or [{{"code": 2, "body": {{"message": "the double has no reply for " + command}}}}]
reply = queue.pop(0) if len(queue) > 1 else queue[0]
with open(plan_path, "w") as fh:
    json.dump(plan, fh)
if reply["body"] is not None:
    print(json.dumps(reply["body"], indent=2))
sys.exit(reply["code"])
'''


def openapi_schema(name: str) -> dict[str, Any]:
    """A response shape from ParallelCluster's own OpenAPI spec, as a JSON schema."""
    import yaml
    from pcluster.api import openapi

    spec = yaml.safe_load(Path(openapi.__file__).with_name("openapi.yaml").read_text())
    return {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}


@dataclass
class PclusterDouble:
    """Stands in for the ``pcluster`` CLI: queue replies per command, then read the calls."""

    plan: Path
    replies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def reply(self, command: str, code: int, body: dict[str, Any] | None, shape: str | None) -> None:
        """Queue a reply; ``shape`` names the OpenAPI response schema the body must satisfy."""
        if shape is not None:
            import jsonschema

            jsonschema.Draft7Validator(openapi_schema(shape)).validate(body)
        self.replies.setdefault(command, []).append({"code": code, "body": body})
        self._save([])

    def _save(self, calls: list[dict[str, Any]]) -> None:
        self.plan.write_text(json.dumps({"replies": self.replies, "calls": calls}))

    def calls(self, command: str | None = None) -> list[list[str]]:
        recorded = json.loads(self.plan.read_text())["calls"]
        return [c["argv"] for c in recorded if command is None or c["argv"][:1] == [command]]

    def region_env(self) -> list[str | None]:
        return [c["region_env"] for c in json.loads(self.plan.read_text())["calls"]]


@pytest.fixture
def pcluster_double(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PclusterDouble:
    """A ``pcluster`` double first on PATH (ctrain's helpers still use the real pcluster library)."""
    bindir = tmp_path / "double-bin"
    bindir.mkdir()
    exe = bindir / "pcluster"
    exe.write_text(_DOUBLE.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    double = PclusterDouble(tmp_path / "pcluster-double.json")
    double._save([])
    monkeypatch.setenv("CTRAIN_PCLUSTER_DOUBLE", str(double.plan))
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return double


# Bodies in the shapes of ParallelCluster's API (the double checks them against the OpenAPI spec).
STACK_ARN = f"arn:aws:cloudformation:{REGION}:123456789012:stack/ctrain/0a1b2c3d"


def cluster_summary(name: str, status: str, stack_status: str) -> dict[str, Any]:
    return {
        "clusterName": name,
        "region": REGION,
        "version": "3.16.1",
        "cloudformationStackArn": STACK_ARN,
        "cloudformationStackStatus": stack_status,
        "clusterStatus": status,
        "scheduler": {"type": "slurm"},
    }


def described(
    name: str, status: str, stack_status: str, fleet: str = "UNKNOWN", head: str | None = None
) -> dict[str, Any]:
    body = {
        "clusterName": name,
        "region": REGION,
        "version": "3.16.1",
        "cloudFormationStackStatus": stack_status,
        "cloudformationStackArn": STACK_ARN,
        "clusterStatus": status,
        "computeFleetStatus": fleet,
        "clusterConfiguration": {"url": "https://parallelcluster-0a1b-v1-do-not-delete.s3.amazonaws.com/config"},
        "creationTime": "2026-01-05T10:00:00.000Z",
        "lastUpdatedTime": "2026-01-05T10:00:00.000Z",
        "tags": [{"key": "parallelcluster:version", "value": "3.16.1"}],
        "scheduler": {"type": "slurm"},
    }
    if head:
        body["headNode"] = {
            "instanceId": "i-0123456789abcdef0",
            "instanceType": "m6i.2xlarge",
            "launchTime": "2026-01-05T10:03:00.000Z",
            "privateIpAddress": "10.0.0.12",
            "publicIpAddress": "54.0.0.12",
            "state": head,
        }
    return body


def not_found(name: str) -> dict[str, Any]:
    return {"message": f"Cluster '{name}' does not exist or belongs to an incompatible ParallelCluster major version."}


def stack_event(logical: str, kind: str, status: str, reason: str | None = None) -> dict[str, Any]:
    event = {
        "stackId": STACK_ARN,
        "stackName": "ctrain",
        "eventId": f"{logical}-{status}",
        "logicalResourceId": logical,
        "physicalResourceId": f"{logical.lower()}-0a1b",
        "resourceType": kind,
        "resourceStatus": status,
        "timestamp": "2026-01-05T10:30:00.000Z",
    }
    return {**event, "resourceStatusReason": reason} if reason else event


def compute_node(instance_id: str, queue: str, instance_type: str, state: str) -> dict[str, Any]:
    return {
        "instanceId": instance_id,
        "instanceType": instance_type,
        "launchTime": "2026-01-05T11:00:00.000Z",
        "nodeType": "ComputeNode",
        "privateIpAddress": "10.0.1.5",
        "queueName": queue,
        "state": state,
    }
