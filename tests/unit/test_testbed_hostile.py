"""The testbed against a damaged state directory and a --state-dir that is not its own.

``status`` and ``exec`` read testbed.json, which a crash, a full disk or a person may have damaged: each
damage is one error, never a traceback or a hang. ``down`` acts only on what the testbed of its state
directory made: the selection is tested here on made-up listings (pure functions, and a decoy process),
never by running ``down`` (a real testbed may be up on this machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ctrain.errors import ConfigError, CtrainError
from ctrain.testbed import control, host, plan
from ctrain.testbed.control import Testbed
from tests.badinput import Case, run_case

DEFAULT = plan.Layout(plan.DEFAULT_STATE_DIR)
NODES = [{"name": "node1", "ip": "10.77.0.11"}, {"name": "node2", "ip": "10.77.0.12"}]


def _state(workdir: Path, data: bytes | str | Any, *, shared: bool = False) -> None:
    """A state directory ``tb`` in WORKDIR whose testbed.json holds DATA (bytes or text as they are, else JSON)."""
    (workdir / "tb").mkdir()
    if shared:
        (workdir / "tb" / "shared").mkdir()
    raw = data if isinstance(data, bytes) else (data if isinstance(data, str) else json.dumps(data)).encode()
    (workdir / "tb" / "testbed.json").write_bytes(raw)


def _fifo(workdir: Path) -> None:
    (workdir / "tb").mkdir()
    os.mkfifo(workdir / "tb" / "testbed.json")


def _directory(workdir: Path) -> None:
    (workdir / "tb" / "testbed.json").mkdir(parents=True)


GOOD = {"user": "ctrain", "controller_host": "head", "nodes": NODES, "daemons": {}, "pyxis": None}
DOWN = "ctrain testbed down --state-dir"
DAMAGED = [
    ("not-utf8", lambda w: _state(w, b'{"user": "\xff"}'), ["testbed.json line 1: byte 0xff is not UTF-8", DOWN]),
    ("deep", lambda w: _state(w, "[" * 100_000 + "]" * 100_000), ["testbed.json", "nests deeper than", DOWN]),
    ("pid-not-a-number", lambda w: _state(w, {**GOOD, "daemons": {"munged": {"program": "munged", "pid": "abc"}}}),
     ["testbed.json is damaged: daemons.munged.pid is 'abc', not a process ID", DOWN]),
    ("node-not-an-object", lambda w: _state(w, {**GOOD, "nodes": ["node1"]}), ["nodes[0] is 'node1'", DOWN]),
    ("not-an-object", lambda w: _state(w, "[]"), ["testbed.json is damaged: it holds list", DOWN]),
    ("not-json", lambda w: _state(w, "{"), ["testbed.json is not valid JSON", DOWN]),
    ("fifo", _fifo, ["testbed.json is not a regular file"]),
    ("state-file-a-directory", _directory, ["testbed.json is a directory"]),
]  # fmt: skip
CASES = [
    *(Case(f"status-{name}", ["testbed", "status", "--state-dir", "tb"], says, setup)
      for name, setup, says in DAMAGED),
    *(Case(f"exec-{name}", ["testbed", "exec", "--state-dir", "tb", "--", "true"], says, setup)
      for name, setup, says in DAMAGED),
    Case("status-state-dir-not-a-directory", ["testbed", "status", "--state-dir", "/dev/null"],
         ["state directory /dev/null is not a directory"]),
    Case("exec-state-dir-not-a-directory", ["testbed", "exec", "--state-dir", "/dev/null", "--", "true"],
         ["state directory /dev/null is not a directory"]),
    Case("exec-without-shared-dir", ["testbed", "exec", "--state-dir", "tb", "--", "true"],
         ["shared directory", "/tb/shared is missing", "ctrain testbed up --state-dir"],
         lambda w: _state(w, GOOD)),
    Case("exec-without-the-job-user", ["testbed", "exec", "--state-dir", "tb", "--", "true"],
         ["job user 'no-such-user-ctrain' does not exist"],
         lambda w: _state(w, {**GOOD, "user": "no-such-user-ctrain"}, shared=True)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_damaged_state_directory_is_one_error(case: Case, tmp_path: Path) -> None:
    """Never a traceback (UnicodeDecodeError, RecursionError, ValueError, NotADirectoryError,
    FileNotFoundError) and never a hang (a FIFO): one error naming the file and what to do."""
    run_case(case, tmp_path)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"user": ""}, "user is ''"),
        ({"controller_host": 3}, "controller_host is 3"),
        ({"pyxis": ["x"]}, "pyxis is ['x']"),
        ({"nodes": {"node1": {}}}, "nodes is {'node1': {}}, not a list"),
        ({"nodes": [{"name": "../x", "ip": "10.77.0.11"}]}, "nodes[0].name is '../x'"),
        ({"nodes": [{"name": "node1", "ip": "10.77.0.300"}]}, "nodes[0].ip is '10.77.0.300'"),
        ({"nodes": [{"name": "node1", "ip": "10.77.0.11", "gpus": "/dev/nvidia0"}]}, "nodes[0].gpus is"),
        ({"daemons": []}, "daemons is [], not an object"),
        ({"daemons": {"slurmctld": 7}}, "daemons.slurmctld is 7"),
        ({"daemons": {"slurmctld": {"pid": 7}}}, "daemons.slurmctld.program is None"),
        ({"daemons": {"slurmctld": {"program": "slurmctld", "pid": True}}}, "daemons.slurmctld.pid is True"),
        ({"daemons": {"slurmctld": {"program": "slurmctld", "pid": -1}}}, "daemons.slurmctld.pid is -1"),
        ({"daemons": {"slurmctld": {"program": "slurmctld", "pid": 7, "start": "x"}}}, "daemons.slurmctld.start"),
    ],
)
def test_each_field_of_the_state_file_has_the_type_up_writes(change: dict[str, Any], said: str) -> None:
    assert control.state_problem(GOOD) is None
    assert control.state_problem({**GOOD, "daemons": {"slurmctld": {"program": "slurmctld", "pid": 7,
                                                                      "start": None}}}) is None  # fmt: skip
    problem = control.state_problem({**GOOD, **change})
    assert problem is not None and problem.startswith(said), problem


def test_down_cleans_up_after_a_damaged_state_file(tmp_path: Path) -> None:
    """`down` is what the error says to run: it reads a damaged state file as none (PID files and the
    network it claims are enough), where status and exec refuse it."""
    _state(tmp_path, "[" * 100_000)
    tb = Testbed(tmp_path / "tb")
    assert tb._state(damaged_ok=True) is None
    with pytest.raises(ConfigError, match="is not valid JSON|nests deeper"):
        tb._state()
    with pytest.raises(ConfigError, match="is not a directory"):
        Testbed("/dev/null")._state(damaged_ok=True)


# --- what `down` may stop and remove --------------------------------------------------------------


def test_a_daemon_is_known_by_its_exact_paths_not_a_prefix() -> None:
    """A --state-dir of /var (or /srv/tb beside /srv/tb2) names none of another testbed's daemons."""
    slurmctld = ["/usr/sbin/slurmctld", "-f", "/var/lib/ctrain/testbed/slurm.conf"]
    munged = ["/usr/sbin/munged", "--socket=/srv/tb/run/munge.socket", "--key-file=/srv/tb/munge/munge.key"]
    assert plan.names_path(slurmctld, DEFAULT.daemon_paths)
    assert plan.names_path(["/usr/sbin/slurmctld", "-f", "/var/lib/ctrain//testbed/slurm.conf"], DEFAULT.daemon_paths)
    for other in ("/var", "/var/lib", "/var/lib/ctrain", "/var/lib/ctrain/test", "/"):
        assert not plan.names_path(slurmctld, plan.Layout(Path(other)).daemon_paths), other
    assert plan.names_path(munged, plan.Layout(Path("/srv/tb")).daemon_paths)
    assert not plan.names_path(munged, plan.Layout(Path("/srv")).daemon_paths)
    assert not plan.names_path(munged, plan.Layout(Path("/srv/t")).daemon_paths)
    assert not plan.names_path(["slurmd", "-f", "/srv/tb/slurm.conf.old"], plan.Layout(Path("/srv/tb")).daemon_paths)
    assert not plan.names_path(["slurmd", "-f", "/srv/tb2/slurm.conf"], plan.Layout(Path("/srv/tb")).daemon_paths)


def test_processes_of_a_testbed_below_the_state_dir_are_not_its_own(tmp_path: Path) -> None:
    """The /proc scan `down` ends leftovers with: a process started with TB/slurm.conf is TB's, not that of
    TB's parent directory (a substring match on "PARENT/" took it)."""
    conf = tmp_path / "tb" / "slurm.conf"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-f", str(conf)])
    try:
        deadline = time.monotonic() + 10
        while str(conf) not in getattr(host.proc_info(child.pid), "cmdline", "") and time.monotonic() < deadline:
            time.sleep(0.01)
        info = host.proc_info(child.pid)
        assert info is not None
        tools = (info.program,)
        assert child.pid in host.marked_processes(tools, plan.Layout(tmp_path / "tb").daemon_paths)
        assert child.pid not in host.marked_processes(tools, plan.Layout(tmp_path).daemon_paths)
        daemon = host.Daemon(info.program, child.pid, info.start)
        assert host.is_ours(daemon, plan.Layout(tmp_path / "tb").daemon_paths)
        assert not host.is_ours(daemon, plan.Layout(tmp_path).daemon_paths)
        assert not host.is_ours(daemon, Testbed(tmp_path).daemon_paths)
    finally:
        child.kill()
        child.wait()


NETNS = ["ctrain-node1", "ctrain-node2", "ctrain-node3", "other-ns"]
LINKS = ["lo", "eth0", plan.BRIDGE, "ctrain-v1", "ctrain-v2", "ctrain-v3"]
SCRATCH = plan.Layout(Path("/tmp/scratch-tb"))
TWO = [plan.Node(n["name"], n["ip"]) for n in NODES]


def test_another_testbeds_network_is_never_claimed() -> None:
    """/etc/slurm/slurm.conf links to the running testbed's config: a scratch --state-dir claims none of the
    network, even with a state file that records nodes of the same names."""
    claim = plan.network_claim(TWO, str(DEFAULT.slurm_conf), SCRATCH.slurm_conf)
    assert claim.netns_of(NETNS) == [] and claim.links_of(LINKS) == [] and not claim.hosts_lines
    claim = plan.network_claim([], str(DEFAULT.slurm_conf), SCRATCH.slurm_conf)
    assert claim.netns_of(NETNS) == [] and claim.links_of(LINKS) == []
    file = plan.network_claim(TWO, "", SCRATCH.slurm_conf)  # a Slurm of the machine's own: not the testbed's
    assert file.netns_of(NETNS) == [] and file.links_of(LINKS) == []


def test_the_testbed_the_link_names_claims_its_whole_network() -> None:
    """Its state file gone (a crash, a person), the testbed the link names still finds its namespaces."""
    claim = plan.network_claim([], str(DEFAULT.slurm_conf), DEFAULT.slurm_conf)
    assert claim.netns_of(NETNS) == NETNS[:3]
    assert claim.links_of(LINKS) == [plan.BRIDGE, "ctrain-v1", "ctrain-v2", "ctrain-v3"] and claim.hosts_lines


def test_without_the_link_only_the_recorded_nodes_are_claimed() -> None:
    claim = plan.network_claim(TWO, None, SCRATCH.slurm_conf)
    assert claim.netns_of(NETNS) == ["ctrain-node1", "ctrain-node2"]
    assert claim.links_of(LINKS) == [plan.BRIDGE, "ctrain-v1", "ctrain-v2"] and claim.hosts_lines
    nothing = plan.network_claim([], None, SCRATCH.slurm_conf)
    assert nothing.netns_of(NETNS) == [] and nothing.links_of(LINKS) == [] and not nothing.hosts_lines


def test_a_scratch_testbed_claims_nothing_of_the_machines_testbed(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """What `down --state-dir SCRATCH` would act on, with the machine's testbed up (its link in place)."""
    link = tmp_path / "etc-slurm.conf"
    link.symlink_to(DEFAULT.slurm_conf)
    monkeypatch.setattr(control, "SLURM_CONF_LINK", link)
    _state(tmp_path, GOOD)
    scratch = Testbed(tmp_path / "tb")
    assert scratch._network_claim(scratch._state()).netns_of(NETNS) == []
    assert Testbed(plan.DEFAULT_STATE_DIR)._network_claim(None).netns_of(NETNS) == NETNS[:3]


def test_purge_refuses_a_directory_the_testbed_did_not_make(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`down --purge --state-dir /var` would remove all of /var: a directory holding anything the testbed does
    not make is left whole."""
    layout = plan.Layout(tmp_path)
    made = ["testbed.json", "slurm.conf", "munge", "run", "log", "shared", "pyxis", ".testbed.json.tmp-12"]
    assert layout.foreign_entries(made) == []
    assert layout.foreign_entries([*made, "lib", "cache"]) == ["cache", "lib"]
    (tmp_path / "slurm.conf").write_text("")
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(control.system, "is_root", lambda: True)
    monkeypatch.setattr(control.host, "marked_processes", lambda *_: [])
    monkeypatch.setattr(control.host, "our_netns", lambda: [])
    monkeypatch.setattr(control.host, "remove_user", lambda _: pytest.fail("the job user was removed"))
    with pytest.raises(CtrainError, match=r"holds lib, which the testbed did not make.*nothing was removed"):
        Testbed(tmp_path).purge(log=lambda _: None)
    assert (tmp_path / "lib").is_dir() and (tmp_path / "slurm.conf").is_file()


def test_a_pid_file_that_is_a_fifo_is_skipped(tmp_path: Path) -> None:
    """PID files are read within a bound and as regular files only: a FIFO there would hang `down`."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "slurmctld.pid")
    (run / "munged.pid").write_text("-5\n")
    assert Testbed(tmp_path)._daemons(None) == {}
