"""The testbed's life, for real: refusals, 3 nodes with one task each (plain and in Apptainer),
`up` twice, status and doctor, `down` leaving nothing behind, recovery after a crash.

These tests stop and start the machine-wide testbed, so tests/plugins/testbed.py runs them first;
a testbed that was up before them is brought back up (same node count) afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctrain import proc
from ctrain.testbed import Testbed, build_demo_image, host
from ctrain.testbed.control import SLURM_CONF_LINK
from ctrain.testbed.plan import HOSTS_MARK, NETNS_PREFIX
from tests.conftest import need, need_root

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


# Imports ctrain as root (the checkout may be closed to other users, e.g. under /root), then
# becomes the user for good and runs the CLI.
_AS_USER = """import os, pwd, sys
import ctrain.cli, ctrain.testbed
user = pwd.getpwnam(sys.argv.pop(1))
os.setgroups([]); os.setgid(user.pw_gid); os.setuid(user.pw_uid)
sys.argv[0] = "ctrain"
ctrain.cli.main()
"""


def ctrain(*args: str, as_user: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess, optionally running as another user."""
    argv = [sys.executable, "-c", _AS_USER, as_user, *args] if as_user else [sys.executable, "-m", "ctrain", *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600, check=False)


def leftovers(tb: Testbed) -> list[str]:
    """Anything of the testbed still on the machine: processes, namespaces, links, hosts lines, config link."""
    programs = {host.program_of(t) for t in ("munged", "slurmctld", "slurmd")}
    found = []
    for entry in Path("/proc").iterdir():
        info = host.proc_info(int(entry.name)) if entry.name.isdigit() else None
        if info is None:
            continue
        # slurmstepd does not name the testbed on its command line; none may run once it is down.
        if (info.program in programs and tb.marker in info.cmdline) or info.program == "slurmstepd":
            found.append(f"process {entry.name}: {info.cmdline}")
    found += [f"netns {n}" for n in proc.run(["ip", "netns", "list"]).stdout.split() if n.startswith(NETNS_PREFIX)]
    found += [f"link {n}" for n in host.our_links()]
    found += [f"hosts line {line!r}" for line in Path("/etc/hosts").read_text().splitlines() if HOSTS_MARK in line]
    if SLURM_CONF_LINK.exists() or SLURM_CONF_LINK.is_symlink():
        found.append(str(SLURM_CONF_LINK))
    return found


def recorded_pids(tb: Testbed) -> dict[str, int]:
    state = json.loads(tb.layout.state_file.read_text())
    return {name: d["pid"] for name, d in state["daemons"].items()}


def gone(pid: int) -> bool:
    info = host.proc_info(pid)
    return info is None or info.state == "Z"


def task_lines(text: str) -> list[tuple[str, str]]:
    """(hostname, ip) of every 'hello from HOST ip=IP' or 'HOST IP' line a job printed."""
    return re.findall(r"^(?:hello from )?(node\d+) (?:ip=)?(10\.77\.0\.\d+)\b", text, re.MULTILINE)


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    """The machine-wide testbed, taken down first; restored afterwards if it was up before."""
    need_root()
    testbed = Testbed()
    before = len(testbed.nodes) if testbed.is_up() else 0
    testbed.down()
    need(
        not (SLURM_CONF_LINK.exists() or SLURM_CONF_LINK.is_symlink()),
        f"no Slurm config of another setup at {SLURM_CONF_LINK}",
    )
    yield testbed
    testbed.down()
    if before:
        testbed.up(before)


def test_bad_node_counts_are_refused(tb: Testbed, tmp_path: Path) -> None:
    state = tmp_path / "state"
    zero = ctrain("testbed", "up", "--nodes", "0", "--state-dir", str(state))
    assert zero.returncode == 2 and "error: --nodes must be at least 1 (got 0)" in zero.stderr
    many = ctrain("testbed", "up", "--nodes", "5000", "--state-dir", str(state))
    assert many.returncode == 2
    assert re.search(r"at most \d+ nodes here \(each node gets an equal share of the machine's \d+ MB", many.stderr)
    assert not state.exists() and leftovers(tb) == []


def test_not_root_is_refused(tb: Testbed, tmp_path: Path) -> None:
    for command in ("up", "down"):
        result = ctrain("testbed", command, "--state-dir", str(tmp_path / "state"), as_user="nobody")
        assert result.returncode == 1, result.stderr
        assert f"error: `ctrain testbed {command}` must run as root" in result.stderr
    assert leftovers(tb) == []


@pytest.mark.parametrize("kind", ["file", "link"])
def test_foreign_slurm_conf_is_refused_and_left_alone(tb: Testbed, tmp_path: Path, kind: str) -> None:
    SLURM_CONF_LINK.parent.mkdir(parents=True, exist_ok=True)
    foreign = tmp_path / "site-slurm.conf"
    foreign.write_text("ClusterName=site\n")
    if kind == "file":
        SLURM_CONF_LINK.write_text(foreign.read_text())
    else:
        SLURM_CONF_LINK.symlink_to(foreign)
    try:
        result = ctrain("testbed", "up", "--state-dir", str(tmp_path / "state"))
        assert result.returncode == 1
        assert f"error: {SLURM_CONF_LINK} already exists" in result.stderr
        assert "does not replace an existing Slurm setup" in result.stderr and "$SLURM_CONF" in result.stderr
        assert SLURM_CONF_LINK.read_text() == "ClusterName=site\n"
        assert SLURM_CONF_LINK.is_symlink() == (kind == "link")
        assert not (tmp_path / "state").exists()
        assert [x for x in leftovers(tb) if x != str(SLURM_CONF_LINK)] == []
    finally:
        SLURM_CONF_LINK.unlink()


def test_three_nodes_run_one_task_each(tb: Testbed, tmp_path: Path) -> None:
    result = ctrain("testbed", "up", "--nodes", "3")
    assert result.returncode == 0, result.stderr
    assert "testbed is up: 3 nodes (node1 node2 node3)" in result.stdout
    assert re.search(r"nodes: node1 idle, node2 idle, node3 idle", result.stderr)
    script = tmp_path / "hostnames.sbatch"
    script.write_text("#!/bin/sh\nsrun sh -c 'echo \"$(hostname) $(hostname -I)\"'\n")
    job = tb.submit(script, "-N3", "--output=lifecycle-hostnames-%j.out")
    assert tb.wait(job, timeout=120) == "COMPLETED"
    lines = task_lines((tb.shared_dir / f"lifecycle-hostnames-{job}.out").read_text())
    assert sorted(lines) == [("node1", "10.77.0.11"), ("node2", "10.77.0.12"), ("node3", "10.77.0.13")]


def test_three_nodes_run_one_task_each_in_apptainer(tb: Testbed) -> None:
    image = build_demo_image(tb, REPO / "examples" / "hello-node.def")
    assert image.parent == tb.shared_dir and image.stat().st_uid == os.stat(tb.shared_dir).st_uid
    job = tb.submit(REPO / "examples" / "hello-nodes.sbatch", "-N3", args=[image.name])
    assert tb.wait(job, timeout=120) == "COMPLETED"
    out = (tb.shared_dir / f"hello-nodes-{job}.out").read_text()
    assert sorted(task_lines(out)) == [("node1", "10.77.0.11"), ("node2", "10.77.0.12"), ("node3", "10.77.0.13")]
    assert out.count(f"image={image.name}") == 3, out


def test_up_again_is_harmless_and_a_different_count_is_refused(tb: Testbed) -> None:
    pids = recorded_pids(tb)
    again = ctrain("testbed", "up", "--nodes", "3")
    assert again.returncode == 0, again.stderr
    assert "testbed already up with 3 nodes" in again.stderr
    assert recorded_pids(tb) == pids
    other = ctrain("testbed", "up", "--nodes", "2")
    assert other.returncode == 1
    assert "a testbed with 3 nodes is already up" in other.stderr and "ctrain testbed down" in other.stderr
    assert recorded_pids(tb) == pids and tb.is_up()


def test_up_restarts_a_testbed_whose_config_is_not_current(tb: Testbed) -> None:
    pids = recorded_pids(tb)
    current = tb.slurm_conf.read_text()
    tb.slurm_conf.write_text(current + "# edited by hand\n")
    result = ctrain("testbed", "up", "--nodes", "3")
    assert result.returncode == 0, result.stderr
    assert "restarting the testbed (its slurm.conf is not what this version of ctrain writes)" in result.stderr
    assert tb.slurm_conf.read_text() == current
    assert set(recorded_pids(tb).values()).isdisjoint(pids.values()) and tb.is_up()


def test_status_and_doctor_see_the_testbed(tb: Testbed) -> None:
    status = ctrain("testbed", "status")
    assert status.returncode == 0, status.stdout
    for i in (1, 2, 3):
        assert re.search(rf"^node\s+node{i}\s+10\.77\.0\.1{i}\s+\d+\s+idle$", status.stdout, re.MULTILINE), (
            status.stdout
        )
    assert re.search(
        r"^controller\s+\S+\s+10\.77\.0\.1\s+\d+\s+Slurmctld\(primary\) at \S+ is UP", status.stdout, re.MULTILINE
    )
    assert f"shared dir: {tb.shared_dir}" in status.stdout
    as_user = ctrain("testbed", "status", as_user="nobody")
    assert as_user.returncode == 0 and as_user.stdout == status.stdout, "status works without root"
    doctor = ctrain("doctor", "--for", "apptainer-jobs")
    assert doctor.returncode == 0, doctor.stdout
    assert re.search(r"^slurm controller\s+ok\s+Slurmctld\(primary\) at \S+ is UP", doctor.stdout, re.MULTILINE)
    assert re.search(r"^apptainer\s+ok\s+apptainer version", doctor.stdout, re.MULTILINE)


def test_down_leaves_nothing_and_twice_is_fine(tb: Testbed, tmp_path: Path) -> None:
    # A job still running on every node: `down` must return only once its steps are gone too.
    script = tmp_path / "sleeper.sbatch"
    script.write_text("#!/bin/sh\nsrun sleep 600\n")
    job = tb.submit(script, f"-N{len(tb.nodes)}", "--output=/dev/null")
    deadline = time.monotonic() + 60
    while tb.job_state(job) != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} is {tb.job_state(job)}, not RUNNING"
        time.sleep(0.5)
    pids = recorded_pids(tb)
    started = time.monotonic()
    result = ctrain("testbed", "down")
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    # Checked at once: nothing may still be exiting, or be a zombie, when `down` has returned.
    assert leftovers(tb) == []
    assert not [pid for pid in pids.values() if Path("/proc", str(pid)).exists()]
    assert took < 60, f"down took {took:.1f} s"
    assert not tb.layout.state_file.exists() and tb.layout.slurm_conf.exists(), "config and logs are kept"
    again = ctrain("testbed", "down")
    assert again.returncode == 0 and "nothing was running" in again.stderr


def test_up_after_down_and_after_a_crash(tb: Testbed) -> None:
    assert ctrain("testbed", "up").returncode == 0
    first = recorded_pids(tb)
    assert tb.run_as_user(["srun", "-N2", "hostname"]).stdout.split() != []
    # A crash: the controller and one node die without `down`.
    for name in ("slurmctld", "slurmd-node1"):
        os.kill(first[name], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not (gone(first["slurmctld"]) and gone(first["slurmd-node1"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    status = ctrain("testbed", "status")
    assert status.returncode == 1 and "slurmctld is not running" in status.stdout
    result = ctrain("testbed", "up")
    assert result.returncode == 0, result.stderr
    assert "it is not fully up: slurmctld is not running; slurmd-node1 is not running" in result.stderr
    assert tb.is_up() and set(recorded_pids(tb).values()).isdisjoint(first.values())
    assert all(gone(pid) for pid in first.values())


def test_down_never_kills_a_reused_pid(tb: Testbed) -> None:
    """A PID in the state file that now belongs to another program is left alone."""
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(tb.slurm_conf)])
    try:
        state = json.loads(tb.layout.state_file.read_text())
        real_ctld = state["daemons"]["slurmctld"]["pid"]
        deadline = time.monotonic() + 10
        while (
            str(tb.slurm_conf) not in getattr(host.proc_info(decoy.pid), "cmdline", "") and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        state["daemons"]["slurmctld"] = {"program": "slurmctld", "pid": decoy.pid, "start": None}
        tb.layout.state_file.write_text(json.dumps(state))
        assert ctrain("testbed", "down").returncode == 0
        assert decoy.poll() is None, "down killed a process it did not start"
        assert gone(real_ctld), "the real slurmctld (found by its PID file) was not stopped"
        assert leftovers(tb) == []
    finally:
        decoy.kill()
        decoy.wait()


def test_down_without_a_state_file_finds_pid_files_and_names(tb: Testbed) -> None:
    assert ctrain("testbed", "up").returncode == 0
    pids = recorded_pids(tb)
    tb.layout.state_file.unlink()
    status = ctrain("testbed", "status")
    assert status.returncode == 1 and "left over from an earlier start" in status.stdout
    assert ctrain("testbed", "down").returncode == 0
    assert all(gone(pid) for pid in pids.values()) and leftovers(tb) == []
