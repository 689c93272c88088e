"""``ctrain cluster`` against hostile values: nothing a setting holds may run on a node.

The node script writes two settings into /etc/enroot/enroot.conf, and enroot runs every value there
through `eval echo` each time it runs; others reach the ParallelCluster config and ``pcluster``'s
command line. Each is refused, with its name and allowed form, at ``init``, at ``validate`` (a config
edited by hand) and by the node script itself.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from ctrain import resources
from ctrain.cluster import checks, template
from ctrain.cluster import setup as cluster_setup
from ctrain.config import ProjectConfig
from ctrain.errors import ConfigError
from tests.badinput import Case, run_case

EXAMPLE = {
    "region": "us-east-1",
    "head_node_subnet": "subnet-0123456789abcdef0",
    "key_pair": "my-key",
    "scripts_s3_uri": "s3://my-bucket/ctrain",
}
INIT = ["cluster", "init", "--region", "us-east-1", "--subnet", "subnet-0123456789abcdef0", "--key-pair", "k",
        "--scripts-s3-uri", "s3://bucket/x", "-o", "pc.yaml"]  # fmt: skip
SCRIPT = resources.path("cluster", "scripts", "enroot-pyxis.sh")


def setup_for(tmp_path: Path, **settings: Any) -> cluster_setup.Setup:
    return cluster_setup.load(ProjectConfig(path=tmp_path / "ctrain.yaml"), {**EXAMPLE, **settings})


HOSTILE = [
    ("enroot_squash_options", "-noI $(touch /tmp/PWN)", "mksquashfs options"),
    ("enroot_squash_options", "-noI; touch /tmp/PWN", "mksquashfs options"),
    ("enroot_squash_options", "-noI `id`", "mksquashfs options"),
    ("enroot_squash_options", "-noI\nENROOT_RESTRICT_DEV no", "mksquashfs options"),
    ("enroot_squash_options", "-noI ${HOME}", "mksquashfs options"),
    ("fsx_mount", "/fsx;id", "an absolute path of letters"),
    ("fsx_mount", "/fsx$(id)", "an absolute path of letters"),
    ("local_storage", "/scratch $(id)", "an absolute path of letters"),
    ("local_storage", "/scratch\nENROOT_MOUNT_HOME yes", "an absolute path of letters"),
    ("local_storage", "scratch", "an absolute path of letters"),
    ("region", "us-east-1;id", "an AWS region such as us-east-1"),
    ("region", "$(id)", "an AWS region"),
    ("head_node_subnet", "subnet-0123456789abcdef0;id", "subnet- and 8 or 17 hex digits"),
    ("compute_subnet", "subnet-$(id)", "subnet- and 8 or 17 hex digits"),
    ("key_pair", "k/../../.bashrc", "without '/'"),
    ("key_pair", "../k", "without '/', not starting with '.' or '-'"),
    ("key_pair", "k\nid", "printable ASCII"),
    ("key_pair", "cl\u00e9", "printable ASCII"),
    ("key_pair", "k" * 256, "1 to 255 printable ASCII"),
    ("key_pair", "", "1 to 255 printable ASCII"),
    ("key_pair", "-k", "not starting with '.' or '-'"),
    ("custom_ami", "ami-0123456789abcdef0 x", "ami- and 8 or 17 hex digits"),
    ("ssh_allowed_ips", "0.0.0.0/0;id", "CIDR form"),
    ("capacity_reservation", "cr-$(id)", "cr- and 8 or 17 hex digits"),
    ("fsx_id", "fs-0123456789abcdef0\nx", "fs- and 8 or 17 hex digits"),
    ("gpu_instance_type", "p5.48xlarge;id", "an EC2 instance type"),
    ("scripts_s3_uri", "s3://my-bucket/x$(id)", "s3://BUCKET/PREFIX"),
    ("scripts_s3_uri", "s3://my-bucket/x\r# y", "s3://BUCKET/PREFIX"),
    ("tags", {"team": "nlp\nRegion: x"}, "tag value"),
]


@pytest.mark.parametrize(("key", "value", "form"), HOSTILE, ids=lambda v: repr(v)[:30])
def test_values_that_could_run_on_the_nodes_are_refused(tmp_path: Path, key: str, value: Any, form: str) -> None:
    """Each setting that reaches a script, enroot.conf or the config: refused with its name and form."""
    with pytest.raises(ConfigError) as err:
        setup_for(tmp_path, **{key: value})
    message = str(err.value)
    assert message.startswith(f"cluster.{key}") and form in message, message


def test_plain_values_still_pass(tmp_path: Path) -> None:
    """What AWS and mksquashfs write passes; the squash options are checked on what ``init`` writes too."""
    setup = setup_for(tmp_path, enroot_squash_options="-comp zstd -Xcompression-level 3 -b 1M -no-duplicates",
                      key_pair="team.key_2024@lab", ssh_allowed_ips="203.0.113.0/24", fsx_mount="/fsx/",
                      custom_ami="ami-0123456789abcdef0", tags={"cost-center": "ml/research:1"})  # fmt: skip
    config = template.build(setup)
    assert config["HeadNode"]["CustomActions"]["OnNodeConfigured"]["Args"][1].startswith("-comp zstd")
    assert checks.value_problems(config) == []
    # A Setup made without load() (a caller building its own) is checked where the values are filled in.
    hostile = replace(setup, settings=replace(setup.settings, enroot_squash_options="-noI $(id)"))
    with pytest.raises(ConfigError, match="cluster.enroot_squash_options"):
        template.render(hostile)


def test_region_from_the_config_or_environment_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The region reaches ``pcluster --region`` and its environment, from wherever it comes."""
    setup = setup_for(tmp_path, region=None)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    assert cluster_setup.region(setup, {"Region": "eu-west-1"}) == "eu-west-1"
    with pytest.raises(ConfigError, match=r"the config's Region: 'us-east-1 --profile x' is not allowed"):
        cluster_setup.region(setup, {"Region": "us-east-1 --profile x"})
    monkeypatch.setenv("AWS_REGION", "$(id)")
    with pytest.raises(ConfigError, match=r"\$AWS_REGION: '\$\(id\)' is not allowed: an AWS region"):
        cluster_setup.region(setup)


def test_a_hand_edited_config_is_checked_like_init(tmp_path: Path) -> None:
    """``cluster validate`` holds a config edited by hand to the same forms, with where each value is."""
    config = yaml.safe_load(template.render(setup_for(tmp_path)))
    config["Region"] = "us-east-1;id"
    config["HeadNode"]["Ssh"]["KeyName"] = "../k"
    config["HeadNode"]["CustomActions"]["OnNodeConfigured"]["Args"] = ["/scratch", "-noI $(touch /tmp/PWN)"]
    gpu = config["Scheduling"]["SlurmQueues"][0]
    gpu["CustomActions"]["OnNodeStart"] = {"Script": "s3://my-bucket/ctrain/enroot-pyxis.sh", "Args": ["/scratch"]}
    gpu["Networking"]["SubnetIds"] = ["subnet-0123456789abcdef0`id`"]
    gpu["ComputeSettings"]["LocalStorage"]["EphemeralVolume"]["MountDir"] = "/scratch\nENROOT_RESTRICT_DEV no"
    config["SharedStorage"][0]["MountDir"] = "/fsx;reboot"
    found = {p.where: p.message for p in checks.value_problems(config)}
    assert set(found) == {
        "Region",
        "HeadNode.Ssh.KeyName",
        "HeadNode.CustomActions.OnNodeConfigured.Args[1]",
        "Scheduling.SlurmQueues[0].CustomActions.OnNodeStart.Args",
        "Scheduling.SlurmQueues[0].Networking.SubnetIds[0]",
        "Scheduling.SlurmQueues[0].ComputeSettings.LocalStorage.EphemeralVolume.MountDir",
        "SharedStorage[0].MountDir",
    }, found
    assert "mksquashfs options" in found["HeadNode.CustomActions.OnNodeConfigured.Args[1]"]
    assert "takes two Args" in found["Scheduling.SlurmQueues[0].CustomActions.OnNodeStart.Args"]
    problems = checks.ctrain_problems(setup_for(tmp_path), config)
    assert all(p.level == "ERROR" and p.source == "ctrain" for p in problems if p.where in found)


@pytest.mark.parametrize("name", ["my key", "john's-key", "k$(id);`x` \\ \"q\"", "~k", "k" * 255])
def test_key_pair_names_aws_takes_pass_and_stay_one_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          name: str) -> None:  # fmt: skip
    """AWS allows any printable ASCII in a key pair name: a space or a quote is no reason to refuse one. The name
    reaches the config as one YAML value and ``pcluster ssh`` as the path ~/.ssh/NAME.pem, inside ~/.ssh."""
    from ctrain.cluster import pcluster

    setup = setup_for(tmp_path, key_pair=name)
    text = template.render(setup)
    config = yaml.safe_load(text)
    assert config["HeadNode"]["Ssh"]["KeyName"] == name
    assert checks.value_problems(config) == []
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    if len(name) + 4 > 255:  # longer than a file name can be with .pem: there is no such key here
        assert pcluster._ssh_key(setup) is None
        return
    (tmp_path / ".ssh" / f"{name}.pem").write_text("key")
    key = pcluster._ssh_key(setup)
    assert key == tmp_path / ".ssh" / f"{name}.pem" and key.parent == tmp_path / ".ssh"


def test_init_takes_a_key_pair_with_a_space(tmp_path: Path) -> None:
    """`ctrain cluster init --key-pair "my key"` writes the config with that name, as AWS spells it."""
    from click.testing import CliRunner

    from ctrain.cli import main

    (tmp_path / "ctrain.yaml").write_text("")
    argv = ["--config", str(tmp_path / "ctrain.yaml"), *INIT[:7], "my key", *INIT[8:-1], str(tmp_path / "pc.yaml")]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "pc.yaml").read_text())["HeadNode"]["Ssh"]["KeyName"] == "my key"


SRC = {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


def _hand_edited(workdir: Path) -> None:
    text = template.render(setup_for(workdir))
    (workdir / "pcluster.yaml").write_text(text.replace("-no-duplicates", "-no-duplicates $(touch /tmp/PWN)"))


CLI = [
    Case("init-squash-options", [*INIT, "--set", "enroot_squash_options=-noI $(touch /tmp/PWN)"],
         ["cluster.enroot_squash_options", "mksquashfs options"]),
    Case("init-fsx-mount", [*INIT, "--set", "fsx_mount=/fsx;id"], ["cluster.fsx_mount", "absolute path"]),
    Case("init-key-pair", [*INIT[:7], "k/../x", *INIT[8:]], ["cluster.key_pair", "key pair name"]),
    Case("validate-hand-edited", ["cluster", "validate", "pcluster.yaml"],
         ["OnNodeConfigured.Args[1]", "mksquashfs options"], _hand_edited),
    Case("validate-not-a-file", ["cluster", "validate", "/dev/null"], ["/dev/null is not a regular file"]),
    Case("init-onto-a-device", [*INIT[:-1], "/dev/null"], ["/dev/null exists and is not a regular file"]),
]  # fmt: skip


@pytest.mark.parametrize("case", [replace(c, env=SRC, exit_code=2) for c in CLI], ids=lambda c: c.id)
def test_hostile_values_are_one_error_and_nothing_written(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp_path)


@pytest.mark.parametrize(
    ("local_storage", "squash", "said"),
    [
        ("/scratch", "-noI $(touch PWN)", "SQUASH_OPTIONS"),
        ("/scratch", "-noI\nENROOT_RESTRICT_DEV no", "SQUASH_OPTIONS"),
        ("/scratch", "-noI; touch PWN", "SQUASH_OPTIONS"),
        ("/scratch/$(touch PWN)", "-noI", "LOCAL_STORAGE"),
        ("/scratch\nENROOT_MOUNT_HOME yes", "-noI", "LOCAL_STORAGE"),
        ("scratch", "-noI", "LOCAL_STORAGE"),
    ],
)
def test_the_node_script_refuses_what_enroot_would_run(tmp_path: Path, local_storage: str, squash: str,
                                                       said: str) -> None:  # fmt: skip
    """The node script checks its arguments before it writes enroot.conf: a config that bypassed ctrain
    (edited after validate, or another tool's) is stopped on the node."""
    done = subprocess.run(["bash", str(SCRIPT), local_storage, squash], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"ctrain enroot-pyxis: {said}" in done.stderr
    assert not (tmp_path / "PWN").exists()
