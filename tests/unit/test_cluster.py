"""``ctrain cluster``: the filled config (golden files), the settings, ctrain's own rules, no AWS."""

from __future__ import annotations

import dataclasses

import importlib.util
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest
import yaml
from click.testing import CliRunner

from ctrain.cli import main
from ctrain.cluster import checks, template
from ctrain.cluster import setup as cluster_setup
from ctrain.cluster.efa import EFA_INSTANCE_TYPES
from ctrain.config import CLUSTER_NAME_MAX, ClusterConfig, ProjectConfig
from ctrain.errors import ConfigError, ToolNotFound
from tests.badinput import Case, run_case
from tests.conftest import need
from tests.plugins.cluster import assert_golden

EXAMPLE = {
    "region": "us-east-1",
    "head_node_subnet": "subnet-0123456789abcdef0",
    "compute_subnet": "subnet-0fedcba9876543210",
    "key_pair": "my-key",
    "scripts_s3_uri": "s3://my-bucket/ctrain",
}


def setup_for(tmp_path: Path, **settings: Any) -> cluster_setup.Setup:
    return cluster_setup.load(ProjectConfig(path=tmp_path / "ctrain.yaml"), {**EXAMPLE, **settings})


def queues(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {q["Name"]: q for q in config["Scheduling"]["SlurmQueues"]}


def test_gpu_queue_with_efa_and_placement_group(tmp_path: Path) -> None:
    setup = setup_for(tmp_path)
    text = template.render(setup)
    assert_golden("gpu_efa.yaml", text)
    config = yaml.safe_load(text)
    gpu = queues(config)["gpu"]
    assert gpu["ComputeResources"][0]["Efa"] == {"Enabled": True}
    assert gpu["ComputeResources"][0]["InstanceType"] == "p5.48xlarge"
    assert gpu["Networking"]["PlacementGroup"] == {"Enabled": True}
    assert gpu["Networking"]["SubnetIds"] == [EXAMPLE["compute_subnet"]]
    assert gpu["CustomActions"]["OnNodeStart"]["Script"] == "s3://my-bucket/ctrain/enroot-pyxis.sh"
    assert config["HeadNode"]["CustomActions"]["OnNodeConfigured"]["Args"][0] == "/scratch"
    assert gpu["ComputeSettings"]["LocalStorage"]["EphemeralVolume"]["MountDir"] == "/scratch"
    assert set(queues(config)) == {"gpu", "cpu"}
    assert "CapacityReservationTarget" not in gpu["ComputeResources"][0]
    assert "CustomAmi" not in config["Image"]


def test_cpu_only_cluster_has_no_gpu_queue(tmp_path: Path) -> None:
    setup = setup_for(tmp_path, gpu_queue=False, cpu_max_nodes=3)
    text = template.render(setup)
    assert_golden("cpu_only.yaml", text)
    (cpu,) = yaml.safe_load(text)["Scheduling"]["SlurmQueues"]
    assert cpu["Name"] == "cpu"
    assert cpu["ComputeResources"][0]["MaxCount"] == 3
    assert "Efa" not in cpu["ComputeResources"][0]


def test_capacity_reservation_switches_the_placement_group_off(tmp_path: Path) -> None:
    setup = setup_for(
        tmp_path,
        capacity_reservation="cr-0123456789abcdef0",
        capacity_type="CAPACITY_BLOCK",
        gpu_min_nodes=4,
        gpu_max_nodes=4,
        fsx_deployment="PERSISTENT_2",
        fsx_size_gib=4800,
    )
    text = template.render(setup)
    assert_golden("capacity_reservation.yaml", text)
    config = yaml.safe_load(text)
    gpu = queues(config)["gpu"]
    assert gpu["Networking"]["PlacementGroup"] == {"Enabled": False}
    assert gpu["ComputeResources"][0]["CapacityReservationTarget"] == {"CapacityReservationId": "cr-0123456789abcdef0"}
    assert gpu["CapacityType"] == "CAPACITY_BLOCK"
    fsx = config["SharedStorage"][0]["FsxLustreSettings"]
    assert (fsx["StorageCapacity"], fsx["PerUnitStorageThroughput"]) == (4800, 250)
    assert checks.placement_problems(config) == []


def test_existing_fsx_replaces_the_settings_that_create_one(tmp_path: Path) -> None:
    config = template.build(setup_for(tmp_path, fsx_id="fs-0123456789abcdef0", tags={"team": "nlp"}))
    assert config["SharedStorage"][0]["FsxLustreSettings"] == {"FileSystemId": "fs-0123456789abcdef0"}
    assert {"Key": "team", "Value": "nlp"} in config["Tags"]


def test_init_names_every_missing_setting(tmp_path: Path) -> None:
    setup = cluster_setup.load(ProjectConfig(path=tmp_path / "ctrain.yaml"), {})
    with pytest.raises(ConfigError) as err:
        template.render(setup)
    for key, flag in template.REQUIRED.items():
        assert f"cluster.{key} ({flag})" in str(err.value)


def test_unknown_placeholder_in_a_custom_template(tmp_path: Path) -> None:
    custom = tmp_path / "mine.yaml"
    custom.write_text("Region: ${region}\nHeadNode:\n  InstanceType: ${head_instance}\n")
    with pytest.raises(ConfigError, match=r"HeadNode.InstanceType: unknown placeholder \$\{head_instance\}"):
        template.render(setup_for(tmp_path, template=str(custom)))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"name": "9lives"}, "starts with a letter"),
        ({"name": "a" * (CLUSTER_NAME_MAX + 1)}, f"at most {CLUSTER_NAME_MAX} characters"),
        ({"name": "my_cluster"}, "letters, digits and hyphens"),
        ({"fsx_size_gib": 2000}, "multiple of 2400"),
        ({"capacity_reservation": "cr-1", "placement_group": True}, "conflict"),
        ({"capacity_type": "CAPACITY_BLOCK"}, "needs cluster.capacity_reservation"),
        (
            {"capacity_type": "CAPACITY_BLOCK", "capacity_reservation": "cr-1", "gpu_max_nodes": 4},
            "gpu_min_nodes must equal gpu_max_nodes",
        ),
        ({"gpu_min_nodes": 3, "gpu_max_nodes": 2}, "gpu_min_nodes <= gpu_max_nodes"),
        ({"gpu_queue": False, "cpu_queue": False}, "at least one queue"),
        ({"scripts_s3_uri": "my-bucket/ctrain"}, "s3://BUCKET/PREFIX"),
        ({"fsx_throughput": 300}, "valid values: 125, 250, 500, 1000"),
        ({"efa": "yes"}, "must be true or false"),
    ],
)
def test_bad_cluster_settings_are_clear_errors(tmp_path: Path, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        setup_for(tmp_path, **settings)


def test_name_limit_and_oses_are_parallelclusters() -> None:
    need(importlib.util.find_spec("pcluster") is not None, "aws-parallelcluster (pip install 'ctrain-slurm[aws]')")
    from pcluster.constants import PCLUSTER_NAME_MAX_LENGTH, SUPPORTED_OSES

    assert CLUSTER_NAME_MAX == PCLUSTER_NAME_MAX_LENGTH
    assert set(get_args(get_type_hints(ClusterConfig)["os"])) == set(SUPPORTED_OSES)


def test_efa_list_knows_the_training_instances() -> None:
    assert {"p4d.24xlarge", "p5.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge"} <= EFA_INSTANCE_TYPES
    assert not {"c6i.2xlarge", "g4dn.xlarge", "m6i.2xlarge"} & EFA_INSTANCE_TYPES


def _config(**gpu_resource: Any) -> dict[str, Any]:
    resource = {"Name": "gpu", "InstanceType": "p5.48xlarge", "MinCount": 0, "MaxCount": 2, **gpu_resource}
    return {
        "HeadNode": {"CustomActions": {"OnNodeConfigured": {"Script": "s3://my-bucket/ctrain/enroot-pyxis.sh"}}},
        "Scheduling": {
            "SlurmQueues": [
                {
                    "Name": "gpu",
                    "Networking": {"SubnetIds": ["subnet-1"], "PlacementGroup": {"Enabled": True}},
                    "ComputeResources": [resource],
                    "CustomActions": {
                        "OnNodeStart": {
                            "Sequence": [
                                {"Script": "https://example.com/other.sh"},
                                {"Script": "s3://my-bucket/ctrain/missing.sh"},
                            ]
                        }
                    },
                }
            ]
        },
    }


def test_efa_rule_names_the_instance_type() -> None:
    assert checks.efa_problems(_config(Efa={"Enabled": True})) == []
    (problem,) = checks.efa_problems(_config(InstanceType="g4dn.xlarge", Efa={"Enabled": True}))
    assert problem.level == "ERROR"
    assert problem.where == "Scheduling.SlurmQueues[0].ComputeResources[0].Efa.Enabled"
    assert "g4dn.xlarge has no EFA" in problem.message
    assert checks.efa_problems(_config(InstanceType="g4dn.xlarge")) == []


KNOWN = frozenset({"p5.48xlarge", "g4dn.xlarge", "m6i.2xlarge", "c6i.2xlarge"})


def test_unknown_instance_type_is_named_with_the_closest_real_one() -> None:
    config = _config(InstanceType="p5.48xlrge", Efa={"Enabled": True})
    config["HeadNode"]["InstanceType"] = "m6i.2xlarge"
    (problem,) = checks.instance_type_problems(config, KNOWN, "1.0")
    assert problem.where == "Scheduling.SlurmQueues[0].ComputeResources[0].InstanceType"
    assert "'p5.48xlrge' is not an EC2 instance type: did you mean p5.48xlarge?" in problem.message
    assert checks.efa_problems(config, KNOWN) == []  # a misspelt type is unknown, not one without EFA
    flexible = _config(Instances=[{"InstanceType": "g4dn.xlarge"}, {"InstanceType": "zz9.huge"}])
    (problem,) = checks.instance_type_problems(flexible, KNOWN, "1.0")
    assert problem.where.endswith("ComputeResources[0].Instances[1].InstanceType")
    assert "aws ec2 describe-instance-types" in problem.message  # nothing close to suggest
    assert checks.instance_type_problems(config, frozenset(), "") == []  # no list: not checked here


def test_placement_group_rule() -> None:
    reserved = {"CapacityReservationTarget": {"CapacityReservationId": "cr-1"}}
    (problem,) = checks.placement_problems(_config(**reserved))
    assert (problem.level, problem.where) == ("ERROR", "Scheduling.SlurmQueues[0].Networking.PlacementGroup.Enabled")
    named = _config(**reserved)
    named["Scheduling"]["SlurmQueues"][0]["Networking"]["PlacementGroup"] = {"Enabled": True, "Id": "pg-1"}
    assert checks.placement_problems(named) == []  # the reservation's own group


def test_scripts_rule_checks_only_what_up_uploads(tmp_path: Path) -> None:
    setup = setup_for(tmp_path)
    config = _config()
    assert [where for where, _ in checks.custom_actions(config)] == [
        "HeadNode.CustomActions.OnNodeConfigured.Script",
        "Scheduling.SlurmQueues[0].CustomActions.OnNodeStart.Sequence[0].Script",
        "Scheduling.SlurmQueues[0].CustomActions.OnNodeStart.Sequence[1].Script",
    ]
    (problem,) = checks.script_problems(setup, config)
    assert problem.where.endswith("Sequence[1].Script")
    assert "cluster/scripts/missing.sh, which does not exist" in problem.message
    assert checks.local_scripts(setup, config)["s3://my-bucket/ctrain/enroot-pyxis.sh"].is_file()


def test_suppressed_validators_and_findings_said_once() -> None:
    name = checks.Problem("ERROR", "Scheduling.SlurmQueues[0].Name", "Invalid name 'GPU'.", "pcluster NameValidator")
    monitoring = checks.Problem(
        "WARNING", "Monitoring", "Detailed Monitoring is enabled.", "pcluster DetailedMonitoringValidator"
    )
    efa = checks.Problem("ERROR", "x.Efa.Enabled", "c6i.2xlarge has no EFA", "ctrain")
    found = [name, monitoring, efa]
    assert checks.suppressed(found, ["NameValidator"]) == [monitoring, efa]
    assert checks.suppressed(found, ["type:DetailedMonitoringValidator"]) == [name, efa]
    assert checks.suppressed(found, ["ALL"]) == [efa]  # ctrain's own rules stay
    from_aws = checks.Problem("WARNING", "", "Detailed Monitoring is enabled.", "pcluster DetailedMonitoringValidator")
    assert checks.merge(found, [from_aws]) == [name, efa, from_aws]


def test_schema_messages_flatten_to_paths() -> None:
    messages = {
        "HeadNode": {"InstanceTyp": ["Unknown field."]},
        "Scheduling": {"SlurmQueues": {"0": {"Networking": {"SubnetIds": ["Missing data for required field."]}}}},
        "_schema": ["Whole config."],
    }
    assert list(checks.flatten(messages)) == [
        ("HeadNode.InstanceTyp", "Unknown field."),
        ("Scheduling.SlurmQueues[0].Networking.SubnetIds", "Missing data for required field."),
        ("", "Whole config."),
    ]


def test_missing_pcluster_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cluster_setup.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ToolNotFound, match=r"pip install 'ctrain-slurm\[aws\]'"):
        cluster_setup.pcluster_bin()


def test_init_writes_and_keeps_a_changed_file(tmp_path: Path) -> None:
    project = tmp_path / "ctrain.yaml"
    project.write_text(yaml.safe_dump({"cluster": EXAMPLE}))
    run = CliRunner().invoke
    first = run(main, ["--config", str(project), "cluster", "init"])
    assert first.exit_code == 0, first.output
    written = tmp_path / "pcluster.yaml"
    assert first.stdout.strip() == str(written)
    assert yaml.safe_load(written.read_text())["HeadNode"]["Ssh"]["KeyName"] == "my-key"
    assert run(main, ["--config", str(project), "cluster", "init"]).exit_code == 0  # same content: fine
    changed = run(main, ["--config", str(project), "cluster", "init", "--max-nodes", "8"])
    assert changed.exit_code == 2
    assert "pass --force" in changed.stderr
    assert "MaxCount: 2" in written.read_text()
    forced = run(
        main, ["--config", str(project), "cluster", "init", "--max-nodes", "8", "--set", "gpu_min_nodes=1", "--force"]
    )
    assert forced.exit_code == 0, forced.output
    gpu = queues(yaml.safe_load(written.read_text()))["gpu"]["ComputeResources"][0]
    assert (gpu["MinCount"], gpu["MaxCount"]) == (1, 8)


def test_helpers_run_on_the_python_of_a_separate_pcluster_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pcluster in its own virtual environment: ctrain finds its Python from the CLI's shebang."""
    python = tmp_path / "venv-aws" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    python.touch(mode=0o755)
    cli = python.parent / "pcluster"
    cli.write_text(f"#!{python}\nimport sys\n")
    cli.chmod(0o755)
    monkeypatch.setenv("PATH", str(cli.parent))
    real_find_spec = cluster_setup.importlib.util.find_spec
    monkeypatch.setattr(
        cluster_setup.importlib.util, "find_spec", lambda name: None if name == "pcluster" else real_find_spec(name)
    )
    assert cluster_setup.pcluster_bin() == str(cli)
    assert cluster_setup.helper(checks.OFFLINE_CHECK, "x.yaml")[:3] == [str(python), "-I", str(checks.OFFLINE_CHECK)]
    cli.write_text("#!/usr/bin/env python3\n")  # found on PATH, as the kernel would
    assert cluster_setup.pcluster_python() == str(python)


# --- files that are no ParallelCluster config: one error each, before ParallelCluster is loaded ----

SRC = {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


def _file(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda workdir: (workdir / name).write_bytes(data)


def _validate(name: str, data: bytes, *says: str) -> Case:
    return Case(
        name, ["cluster", "validate", "pcluster.yaml"], [*says, "ctrain cluster init"], _file("pcluster.yaml", data)
    )


NOT_A_CONFIG = [
    _validate("empty", b"", "pcluster.yaml is empty"),
    _validate("only-comments", b"# Region: us-east-1\n", "pcluster.yaml is empty"),
    _validate("not-utf-8", b"Region: us-east-1\nHeadNode: \xff\xfe\n", "is not UTF-8 text", "byte 0xff"),
    _validate("yaml-list", b"- Region: us-east-1\n", "holds a YAML list, not a ParallelCluster config"),
    _validate("yaml-string", b"Region us-east-1\n", "holds a YAML string, not a ParallelCluster config"),
    _validate("invalid-yaml", b"Region: [us-east-1\n", "is not valid YAML", 'in "pcluster.yaml", line 2'),
    Case("missing", ["cluster", "validate", "nope.yaml"], ["nope.yaml does not exist", "ctrain cluster init"]),
    Case("default-missing", ["cluster", "validate"], ["pcluster.yaml does not exist", "ctrain cluster init"]),
    Case(
        "directory",
        ["cluster", "validate", "configs"],
        ["configs is a directory, not a ParallelCluster config", "ctrain cluster init"],
        lambda workdir: (workdir / "configs").mkdir(),
    ),
    Case(
        "up-with-a-directory",
        ["cluster", "up", "configs"],
        ["configs is a directory", "ctrain cluster init"],
        lambda workdir: (workdir / "configs").mkdir(),
    ),
]


@pytest.mark.parametrize("case", [replace(c, env=SRC, exit_code=2) for c in NOT_A_CONFIG], ids=lambda c: c.id)
def test_a_file_that_is_no_config_is_one_clear_error(case: Case, tmp_path: Path) -> None:
    result = run_case(case, tmp_path)
    assert "pcluster configure" not in result.stderr  # ParallelCluster's advice; ctrain users run init


def test_the_project_is_checked_against_its_cluster(tmp_path: Path) -> None:
    """A pyxis project on a cluster whose nodes do not switch enroot and pyxis on is an error; idle
    GPU nodes kept up (gpu_min_nodes) are a warning about the bill. The shipped template passes."""
    from ctrain.cluster.checks import project_problems

    pyxis = dataclasses.replace(setup_for(tmp_path), runtime="pyxis")
    shipped = yaml.safe_load(template.render(pyxis))
    assert project_problems(pyxis, shipped) == []
    config = _config()  # the queue runs other scripts, not enroot-pyxis.sh
    found = project_problems(pyxis, config)
    assert [(p.level, p.where) for p in found] == [("ERROR", "Scheduling.SlurmQueues[0].CustomActions")]
    assert "slurm.runtime: pyxis" in found[0].message and "enroot-pyxis.sh" in found[0].message
    assert project_problems(dataclasses.replace(pyxis, runtime="apptainer"), config) == []
    idle = project_problems(setup_for(tmp_path), _config(MinCount=3))
    assert [(p.level, p.where) for p in idle] == [("WARNING", "Scheduling.SlurmQueues[0].ComputeResources[0].MinCount")]
    assert "3 p5.48xlarge node(s) stay up while idle" in idle[0].message
