"""The testbed's plan without root: slurm.conf, node addresses and limits, /etc/hosts editing,
parsing Slurm's answers, process identity, and refusals that must happen before anything changes.

Golden files: tests/golden/testbed/slurm.conf (a machine without GPUs) and slurm-gpu.conf,
gres.conf, task-prolog.sh (one with two); CTRAIN_UPDATE_GOLDEN=1 rewrites them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import system, testbed
from ctrain.cli import main
from ctrain.errors import ConfigError, CtrainError, ParseError
from ctrain.testbed import host, plan
from tests.golden_files import assert_golden


def test_slurm_conf_golden() -> None:
    layout = plan.Layout(Path("/var/lib/ctrain/testbed"))
    text = plan.render_slurm_conf(layout, "head", plan.node_plan(3), cpus=2, memory_mb=8034)
    assert_golden("testbed", "slurm.conf", text)


def _fake_gpus(tmp_path: Path, minors: list[int], uuids: dict[int, str]) -> tuple[Path, Path]:
    """A /dev with nvidiaN device files (and the driver's other files) and /proc/driver/nvidia/gpus."""
    dev, driver = tmp_path / "dev", tmp_path / "gpus"
    dev.mkdir()
    for name in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "null", "nvidia-caps"]:
        (dev / name).touch()
    for minor in minors:
        (dev / f"nvidia{minor}").touch()
    for minor, uuid in uuids.items():
        info = driver / f"0000:{minor:02x}:00.0"
        info.mkdir(parents=True)
        (info / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 36\nGPU UUID: \t {uuid}\nVideo BIOS: \t ??.??.??.??.??\n"
            f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDevice Minor: \t {minor}\n"
        )
    return dev, driver


TWO_GPUS = [
    plan.Gpu(0, "GPU-1f6b0c8e-0000-4000-8000-000000000000"),
    plan.Gpu(1, "GPU-9a4d2e71-0000-4000-8000-000000000001"),
]


def test_machine_gpus_from_device_files_with_uuids_from_the_driver(tmp_path: Path) -> None:
    dev, driver = _fake_gpus(tmp_path, [1, 0, 10], {0: TWO_GPUS[0].uuid, 1: TWO_GPUS[1].uuid})
    gpus = plan.machine_gpus(dev, driver)
    assert gpus == [*TWO_GPUS, plan.Gpu(10, None)]  # by number; no driver file, no UUID
    assert [g.path for g in gpus] == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia10"]


def test_no_gpus_without_nvidia_device_files(tmp_path: Path) -> None:
    assert plan.machine_gpus(tmp_path / "absent", tmp_path / "absent") == []
    dev, driver = _fake_gpus(tmp_path, [], {})
    assert plan.machine_gpus(dev, driver) == []


@pytest.mark.parametrize(
    ("count", "nodes", "shares"),
    [(2, 2, [1, 1]), (8, 2, [4, 4]), (3, 2, [2, 1]), (1, 2, [1, 0]), (0, 3, [0, 0, 0]), (4, 1, [4])],
)
def test_split_gpus_deals_equal_shares_in_order(count: int, nodes: int, shares: list[int]) -> None:
    gpus = [plan.Gpu(i) for i in range(count)]
    split = plan.split_gpus(gpus, plan.node_plan(nodes))
    assert [len(v) for v in split.values()] == shares
    assert [g for v in split.values() for g in v] == gpus  # each GPU once, in order


def test_slurm_conf_without_gpus_is_unchanged_by_an_empty_split() -> None:
    layout = plan.Layout(Path("/var/lib/ctrain/testbed"))
    nodes = plan.node_plan(3)
    plain = plan.render_slurm_conf(layout, "head", nodes, cpus=2, memory_mb=8034)
    empty = plan.split_gpus([], nodes)
    assert plan.render_slurm_conf(layout, "head", nodes, cpus=2, memory_mb=8034, gpus=empty) == plain
    assert "Gres" not in plain and "TaskProlog" not in plain  # not under pyxis: see Testbed._task_prolog


def test_gpu_testbed_files_golden() -> None:
    """Two GPUs on two nodes, as `ctrain testbed up --nodes 2` writes them on a 2-GPU machine."""
    layout = plan.Layout(Path("/var/lib/ctrain/testbed"))
    nodes = plan.node_plan(2)
    gpus = plan.split_gpus(TWO_GPUS, nodes)
    text = plan.render_slurm_conf(layout, "gpuhost", nodes, cpus=32, memory_mb=129024, gpus=gpus)
    assert_golden("testbed", "slurm-gpu.conf", text)
    assert "GresTypes=gpu" in text and "TaskProlog=/var/lib/ctrain/testbed/task-prolog.sh" in text
    assert [line.split()[-2] for line in text.splitlines() if line.startswith("NodeName=")] == ["Gres=gpu:1"] * 2
    assert_golden("testbed", "gres.conf", plan.render_gres_conf(gpus))
    assert_golden("testbed", "task-prolog.sh", plan.render_task_prolog(gpus, layout.scratch_dir))


def test_task_prolog_gives_a_node_with_a_scratch_disk_its_own_tmpdir(tmp_path: Path) -> None:
    """Testbed.local_disk makes scratch/NODE; that node's tasks get it as TMPDIR, the others keep theirs."""
    scratch = tmp_path / "state dir" / "scratch"
    (scratch / "node2").mkdir(parents=True)
    script = tmp_path / "task-prolog.sh"
    script.write_text(plan.render_task_prolog(plan.split_gpus([], plan.node_plan(2)), scratch))
    assert _prolog(script, "node2", None) == f"export TMPDIR={scratch}/node2\n"
    assert _prolog(script, "node1", None) == ""


def test_cgroup_conf_loads_the_plugin_that_does_nothing() -> None:
    settings = dict(
        line.split("=", 1) for line in plan.render_cgroup_conf().splitlines() if line and not line.startswith("#")
    )
    assert settings == {"CgroupPlugin": "cgroup/v1", "IgnoreSystemd": "yes"}


def _prolog(script: Path, node: str, visible: str | None) -> str:
    env = {"PATH": os.environ["PATH"], "SLURMD_NODENAME": node}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    result = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, check=True)
    assert result.stderr == ""
    return result.stdout


def test_task_prolog_maps_node_gpu_numbers_to_the_machines_gpus(tmp_path: Path) -> None:
    """What slurmstepd would set: node2's GPU 0 is the machine's second GPU, named by UUID."""
    nodes = plan.node_plan(3)
    gpus = plan.split_gpus([*TWO_GPUS, plan.Gpu(2), plan.Gpu(3, "GPU-3"), plan.Gpu(4), plan.Gpu(5)], nodes)
    script = tmp_path / "task-prolog.sh"
    script.write_text(plan.render_task_prolog(gpus, tmp_path / "no-scratch"))
    uuid0, uuid1 = TWO_GPUS[0].uuid, TWO_GPUS[1].uuid
    assert _prolog(script, "node1", "0") == f"export CUDA_VISIBLE_DEVICES={uuid0}\n"
    assert _prolog(script, "node1", "1,0") == f"export CUDA_VISIBLE_DEVICES={uuid1},{uuid0}\n"
    assert _prolog(script, "node2", "0,1") == "export CUDA_VISIBLE_DEVICES=2,GPU-3\n"  # no UUID known: the number
    assert _prolog(script, "node3", "1") == "export CUDA_VISIBLE_DEVICES=5\n"
    # Left as Slurm set it: no GPUs asked for, not a number, out of range, a node without GPUs here.
    for node, visible in (("node1", None), ("node1", ""), ("node1", "NoDevFiles"), ("node1", "2"), ("node9", "0")):
        assert _prolog(script, node, visible) == "", (node, visible)


def test_slurm_conf_names_every_node_and_only_testbed_paths() -> None:
    layout = plan.Layout(Path("/srv/tb"))
    text = plan.render_slurm_conf(layout, "login", plan.node_plan(5), cpus=4, memory_mb=2048)
    node_lines = [line for line in text.splitlines() if line.startswith("NodeName=")]
    assert [line.split()[0] for line in node_lines] == [f"NodeName=node{i}" for i in range(1, 6)]
    assert all("CPUs=4 RealMemory=2048" in line for line in node_lines)
    assert "SlurmctldHost=login(10.77.0.1)" in text
    paths = [v for line in text.splitlines() for v in line.split("=", 1)[1:] if v.startswith("/")]
    assert paths and all(p.startswith("/srv/tb/") for p in paths), paths
    assert f"AuthInfo=socket=/srv/tb/run/munge.socket,cred_expire={plan.CRED_EXPIRE_S}" in text


def test_node_plan_addresses_and_names() -> None:
    nodes = plan.node_plan(3)
    assert [(n.name, n.ip, n.netns, n.veth) for n in nodes] == [
        ("node1", "10.77.0.11", "ctrain-node1", "ctrain-v1"),
        ("node2", "10.77.0.12", "ctrain-node2", "ctrain-v2"),
        ("node3", "10.77.0.13", "ctrain-node3", "ctrain-v3"),
    ]
    last = plan.node_plan(plan.MAX_NODES_BY_ADDRESS)[-1]
    assert last.ip == "10.77.0.254" and len(last.veth) <= 15  # Linux interface names: at most 15 characters


@pytest.mark.parametrize(
    ("memory_mb", "limit"),
    [(24105, 23), (2047, 1), (1023, 0), (10**7, plan.MAX_NODES_BY_ADDRESS)],
)
def test_max_nodes_by_memory_and_addresses(memory_mb: int, limit: int) -> None:
    assert plan.max_nodes(memory_mb) == limit


def test_node_count_errors_say_why_and_what_to_do() -> None:
    plan.check_nodes(1, 2048)
    plan.check_nodes(23, 24105)
    with pytest.raises(ConfigError, match=r"--nodes must be at least 1 \(got 0\)"):
        plan.check_nodes(0, 24105)
    with pytest.raises(ConfigError) as err:
        plan.check_nodes(24, 24105)
    message = str(err.value)
    assert "at most 23 nodes here" in message
    assert "24105 MB of memory" in message and "at least 1024 MB" in message
    assert "room for 244 nodes" in message


HOSTS = "127.0.0.1\tlocalhost\n# a comment\n::1 ip6-localhost\n10.0.0.5 db db.local"


def test_hosts_edit_keeps_foreign_lines_byte_for_byte() -> None:
    nodes = plan.node_plan(2)
    added = plan.hosts_with_ours(HOSTS, nodes)
    assert added.startswith(HOSTS + "\n")
    assert added.count(plan.HOSTS_MARK) == 2
    assert "10.77.0.12\tnode2\t# ctrain testbed\n" in added
    assert plan.hosts_with_ours(added, nodes) == added, "adding twice must not duplicate lines"
    assert plan.hosts_with_ours(added, nodes[:1]).count(plan.HOSTS_MARK) == 1
    assert plan.hosts_without_ours(added) == HOSTS + "\n"
    assert plan.hosts_without_ours(HOSTS) == HOSTS


def test_hosts_conflicts_find_foreign_lines_naming_nodes_or_addresses() -> None:
    nodes = plan.node_plan(2)
    text = plan.hosts_with_ours(HOSTS, nodes) + "10.77.0.12 other\n192.168.1.9 gpu node1 # mine\n10.1.1.1 node10\n"
    assert plan.hosts_conflicts(text, nodes) == ["10.77.0.12 other", "192.168.1.9 gpu node1 # mine"]
    assert plan.hosts_conflicts(plan.hosts_with_ours(HOSTS, nodes), nodes) == []


def test_process_identity_checks_program_start_time_and_marker() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "/marker/"])
    try:
        deadline = time.monotonic() + 10
        while "/marker/" not in getattr(host.proc_info(child.pid), "cmdline", "") and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd
        info = host.proc_info(child.pid)
        assert info is not None and info.program == os.path.basename(os.path.realpath(sys.executable))
        ours = host.Daemon(info.program, child.pid, info.start)
        assert host.is_ours(ours, "/marker/")
        assert not host.is_ours(ours, "/other/"), "a process without the testbed's path is not ours"
        assert not host.is_ours(host.Daemon("slurmd", child.pid, info.start), "/marker/"), "other program"
        assert not host.is_ours(host.Daemon(info.program, child.pid, info.start + 1), "/marker/"), "reused PID"
    finally:
        child.kill()
        child.wait()
    assert host.proc_info(child.pid) is None


def test_unreachable_dirs(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    inner = closed / "inner"
    inner.mkdir(parents=True)
    tmp_path.chmod(0o755)
    closed.chmod(0o700)
    assert closed in host.unreachable_dirs(inner)
    closed.chmod(0o755)
    assert closed not in host.unreachable_dirs(inner)
    assert host.unreachable_dirs(Path("/var/lib")) == []


def test_up_refuses_bad_node_counts_before_touching_anything(tmp_path: Path) -> None:
    state = tmp_path / "tb"
    for nodes, message in (("0", "at least 1"), ("100000", "more than this machine can hold")):
        result = CliRunner().invoke(main, ["testbed", "up", "--nodes", nodes, "--state-dir", str(state)])
        assert result.exit_code == 2, result.output
        assert f"error: --nodes {nodes if nodes != '0' else 'must be'}" in result.output
        assert message in result.output
    assert not state.exists()


def test_up_and_down_refuse_without_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root is checked before anything else changes (the real non-root run is an integration test)."""
    monkeypatch.setattr(system, "is_root", lambda: False)
    state = tmp_path / "tb"
    with pytest.raises(CtrainError, match="must run as root"):
        testbed.Testbed(state).up(2)
    with pytest.raises(CtrainError, match="must run as root"):
        testbed.Testbed(state).down()
    assert not state.exists()


def test_status_of_a_testbed_that_never_ran(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["testbed", "status", "--state-dir", str(tmp_path / "none")])
    assert result.exit_code == 1
    assert result.output.startswith("testbed is down")
    result = CliRunner().invoke(main, ["testbed", "status", "--shared-dir", "--state-dir", str(tmp_path / "x")])
    assert result.output.strip() == str(tmp_path / "x" / "shared")


def test_state_dir_from_environment(tmp_path: Path) -> None:
    env = {**os.environ, "CTRAIN_TESTBED_DIR": str(tmp_path / "from-env")}
    out = subprocess.run(
        [sys.executable, "-m", "ctrain", "testbed", "status", "--shared-dir"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.stdout.strip() == str(tmp_path / "from-env" / "shared"), out.stderr


def test_exec_on_a_testbed_that_is_not_up(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["testbed", "exec", "--state-dir", str(tmp_path), "--", "true"])
    assert result.exit_code == 1
    assert f"error: the testbed in {tmp_path} is not up: run `ctrain testbed up` first" in result.output


def test_packages_whose_programs_are_on_path_need_no_installing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline machine with the tools installed some other way: ensure() installs nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in system.PROGRAMS["munge"] + system.PROGRAMS["slurm-wlm"]:
        (bin_dir / program).write_text("#!/bin/sh\n")
        (bin_dir / program).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # no dpkg-query on this PATH
    assert system.missing(["munge", "slurm-wlm"]) == []
    assert system.missing(["munge", "apptainer", "docker-registry"]) == ["apptainer", "docker-registry"]
    (bin_dir / "scancel").unlink()  # one program of the package missing: the package is missing
    assert system.missing(["slurm-wlm"]) == ["slurm-wlm"]


def test_every_testbed_package_names_its_programs() -> None:
    for group in ("testbed", "apptainer"):
        for package in system.PACKAGES[group]:
            assert system.PROGRAMS.get(package), package


@pytest.mark.parametrize("root", ["/tmp/a$(touch /tmp/pwned)", "/tmp/a b", "/tmp/a\nb", "/tmp/a'b", '/tmp/a"b', "rel/dir"])
def test_pyxis_refuses_a_state_dir_enroot_would_evaluate(root: str, tmp_path: Path) -> None:
    """enroot.conf's values are evaluated by enroot in a shell, and plugstack.conf splits on spaces:
    the prefix's path is refused before anything is built or written."""
    from ctrain.testbed import pyxis
    from ctrain.testbed.plan import Layout

    with pytest.raises(CtrainError, match="has characters enroot.conf and plugstack.conf cannot hold"):
        pyxis.install(Layout(Path(root)), pyxis.Sources(tmp_path / "e", tmp_path / "p"), print)
    assert not Path("/tmp/pwned").exists()
    pyxis.check_prefix(Layout(Path("/var/lib/ctrain/testbed")))  # the default is plain
