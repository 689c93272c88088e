"""The testbed itself: ``up``, ``down``, ``status``, and running commands and jobs as the job user.

State lives in one directory (``testbed.json`` plus config, munge key, logs, spool, controller
state and the shared directory). The state file is written after every step of ``up``, so ``down``
can undo a start that crashed half-way; ``down`` also finds PID files and the testbed's own
network names when the state file is gone or damaged. It acts only on what the testbed of its state
directory made: daemons naming that directory's exact paths, and the network names it claims
(:func:`ctrain.testbed.plan.network_claim`), so a mistyped --state-dir stops no other testbed.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ctrain import proc, system, ui
from ctrain.errors import ConfigError, CtrainError
from ctrain.files import NotRegularFile, atomic_write_json, load_json_bounded, read_regular, read_text_bounded
from ctrain.slurm import Local, Slurm
from ctrain.testbed import host, pyxis
from ctrain.testbed.plan import (
    BRIDGE,
    CONTROLLER_IP,
    DEFAULT_STATE_DIR,
    JOB_USER,
    PARTITION,
    READY_NODE_STATES,
    STATE_DIR_ENV,
    Gpu,
    Layout,
    NetworkClaim,
    Node,
    check_nodes,
    hosts_conflicts,
    hosts_with_ours,
    hosts_without_ours,
    machine_cpus,
    machine_gpus,
    machine_memory_mb,
    network_claim,
    node_plan,
    render_cgroup_conf,
    render_gres_conf,
    render_slurm_conf,
    TASK_PROLOG_LINE,
    render_task_prolog,
    split_gpus,
)

SLURM_CONF_LINK = Path("/etc/slurm/slurm.conf")
SLURM_TIMEOUT = 30.0
STARTUP_TIMEOUT = 60.0
MAX_STATE_BYTES = 1 << 20  # testbed.json: a few hundred bytes a node, and at most 243 nodes
MAX_PID_FILE_BYTES = 64
COMPLETING_GRACE = 5.0  # seconds a restarted node may stay COMPLETING before it is set DOWN and resumed
JOB_DRAIN_TIMEOUT = 10.0
Log = Callable[[str], None]


@dataclass
class NodeStatus:
    """One node as ``status`` sees it."""

    name: str
    ip: str
    pid: int | None
    running: bool
    slurm_state: str


@dataclass
class Status:
    """The testbed's state: whether it is up, what is wrong, and each daemon."""

    up: bool
    problems: list[str] = field(default_factory=list)
    controller_host: str = ""
    controller_ip: str = str(CONTROLLER_IP)
    controller_pid: int | None = None
    controller_running: bool = False
    controller_answer: str = ""
    munged_pid: int | None = None
    munged_running: bool = False
    nodes: list[NodeStatus] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.up and not self.problems


def _tail(path: Path, lines: int = 15, limit: int = 64 * 1024) -> str:
    """The last LINES lines of a log, from its last LIMIT bytes (a log may be large, or no regular file)."""
    try:
        data = read_regular(path, limit, -limit)
    except FileNotFoundError:
        return f"  ({path} does not exist)"
    except NotRegularFile:
        return f"  ({path} is not a regular file)"
    except OSError as exc:
        return f"  ({path} cannot be read: {exc.strerror})"
    text = data.decode(errors="replace").splitlines()[-lines:]
    return "\n".join("  " + line for line in text)


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def _int(value: object) -> bool:
    """Whether VALUE is a JSON integer (Python counts True as one; the state file never holds it for a number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def state_problem(state: object) -> str | None:
    """Why STATE (a parsed testbed.json) is not one the testbed wrote, else None: each field it uses has the
    type it writes, so a damaged file is one error, not a traceback where a field is first used."""
    if not isinstance(state, dict):
        return f"it holds {type(state).__name__}, not an object"
    for key in ("user", "controller_host"):
        if key in state and not (isinstance(state[key], str) and state[key]):
            return f"{key} is {state[key]!r}, not a name"
    if state.get("pyxis") is not None and not isinstance(state["pyxis"], str):
        return f"pyxis is {state['pyxis']!r}, not a fingerprint"
    nodes = state.get("nodes", [])
    if not isinstance(nodes, list):
        return f"nodes is {nodes!r}, not a list"
    for i, node in enumerate(nodes):
        if not isinstance(node, dict):
            return f"nodes[{i}] is {node!r}, not an object"
        if not (isinstance(node.get("name"), str) and _NODE_NAME.fullmatch(node["name"])):
            return f"nodes[{i}].name is {node.get('name')!r}, not a node name"
        try:
            ipaddress.IPv4Address(node.get("ip"))
        except ValueError:
            return f"nodes[{i}].ip is {node.get('ip')!r}, not an IPv4 address"
        gpus = node.get("gpus", [])
        if not (isinstance(gpus, list) and all(isinstance(g, str) for g in gpus)):
            return f"nodes[{i}].gpus is {gpus!r}, not a list of device files"
    daemons = state.get("daemons", {})
    if not isinstance(daemons, dict):
        return f"daemons is {daemons!r}, not an object"
    for name, daemon in daemons.items():
        if not isinstance(daemon, dict):
            return f"daemons.{name} is {daemon!r}, not an object"
        if not isinstance(daemon.get("program"), str):
            return f"daemons.{name}.program is {daemon.get('program')!r}, not a program name"
        if not (_int(daemon.get("pid")) and daemon["pid"] > 0):
            return f"daemons.{name}.pid is {daemon.get('pid')!r}, not a process ID"
        if daemon.get("start") is not None and not _int(daemon["start"]):
            return f"daemons.{name}.start is {daemon['start']!r}, not a start time"
    return None


@dataclass(frozen=True)
class AsUser(Local):
    """Commands as the testbed's job user, in a login-like environment (``env`` only, nothing of
    root's), from ``home`` unless told otherwise: a :class:`ctrain.slurm.Runner`."""

    user: str = JOB_USER
    home: Path = Path("/")

    def argv(self, args: Sequence[str | os.PathLike[str]]) -> list[str]:
        """``args`` wrapped to run as the user, with ``env`` and nothing else."""
        user = pwd.getpwnam(self.user)
        drop = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--reset-env", "--"]
        return [*drop, "env", *(f"{k}={v}" for k, v in self.env.items()), *map(os.fspath, args)]

    def added_env(self) -> dict[str, str] | None:
        return None  # ``env`` is on the command line: setpriv --reset-env drops root's environment


class Testbed:
    """A Slurm cluster on this machine: one controller, N nodes in network namespaces, one job user.

    ``state_dir`` defaults to ``$CTRAIN_TESTBED_DIR``, else /var/lib/ctrain/testbed.
    """

    __test__ = False  # not a test class, though its name starts with "Test"

    def __init__(self, state_dir: Path | str | None = None) -> None:
        root = Path(state_dir or os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR).expanduser().absolute()
        self.layout = Layout(root)
        # The state directory as its daemons' paths start (for a look at the processes). Which are the
        # testbed's is told by ``daemon_paths``, matched whole: a prefix also matches a testbed below it.
        self.marker = f"{root}/"
        # Only the testbed's daemons have one of these on their command line (config, socket or key path).
        self.daemon_paths = self.layout.daemon_paths

    # --- what it is -------------------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.layout.root

    @property
    def shared_dir(self) -> Path:
        """Like a cluster's /scratch: owned by the job user, readable by all, the same on every node."""
        return self.layout.shared_dir

    @property
    def slurm_conf(self) -> Path:
        return self.layout.slurm_conf

    @property
    def user(self) -> str:
        return str((self._state() or {}).get("user", JOB_USER))

    @property
    def nodes(self) -> list[Node]:
        """The nodes of the running testbed (empty when it is down)."""
        return [Node(n["name"], n["ip"]) for n in (self._state() or {}).get("nodes", [])]

    @property
    def gpus(self) -> dict[str, list[str]]:
        """Each node's GPUs (device files) in the running testbed; empty lists on a machine without GPUs."""
        return {n["name"]: list(n.get("gpus", [])) for n in (self._state() or {}).get("nodes", [])}

    def _command(self, name: str) -> str:
        """``ctrain testbed NAME`` for this state directory, for messages."""
        where = "" if self.state_dir == DEFAULT_STATE_DIR else f" --state-dir {shlex.quote(str(self.state_dir))}"
        return f"ctrain testbed {name}{where}"

    def _state(self, *, damaged_ok: bool = False) -> dict | None:
        """The state file, checked (:func:`state_problem`); None when there is none. Read within a bound,
        only as a regular file (a FIFO would hang every command). A damaged one is a ConfigError, or
        with DAMAGED_OK (``down``, which cleans up without it) None."""
        root = self.state_dir
        if os.path.lexists(root) and not root.is_dir():
            raise ConfigError(f"the testbed's state directory {root} is not a directory: name a directory "
                              f"(--state-dir or ${STATE_DIR_ENV})")  # fmt: skip
        if not os.path.lexists(self.layout.state_file):
            return None
        try:
            state = load_json_bounded(self.layout.state_file, MAX_STATE_BYTES, "the testbed's state file")
            problem = state_problem(state)
            if problem:
                raise ConfigError(f"the testbed's state file {self.layout.state_file} is damaged: {problem}")
        except ConfigError as exc:
            if damaged_ok:
                return None
            raise ConfigError(f"{exc}; run `{self._command('down')}` to stop what it started and remove it") from None
        return state

    def _save(self, state: dict) -> None:
        atomic_write_json(self.layout.state_file, state, indent=2)

    # --- slurm and the job user ---------------------------------------------------------------------

    @property
    def slurm(self) -> Slurm:
        """The Slurm client as root (an administrator's view: every job, node updates), on this testbed."""
        return Slurm(Local(env={"SLURM_CONF": str(self.slurm_conf)}, timeout=SLURM_TIMEOUT))

    @property
    def user_slurm(self) -> Slurm:
        """The Slurm client as the job user, from the shared directory: how a user submits."""
        return Slurm(self.user_runner())

    def user_runner(self, env: Mapping[str, str] | None = None) -> AsUser:
        """A runner as the job user from the shared directory; a CtrainError naming what is missing when the
        testbed is not up (no state, no shared directory, no job user)."""
        state = self._state()
        if state is None:
            raise CtrainError(f"the testbed in {self.state_dir} is not up: run `ctrain testbed up` first")
        if not self.shared_dir.is_dir():
            raise CtrainError(f"the testbed's shared directory {self.shared_dir} is missing: run "
                              f"`{self._command('up')}` to make it again")  # fmt: skip
        user = str(state.get("user", JOB_USER))
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise CtrainError(f"the testbed's job user {user!r} does not exist: run `{self._command('up')}` to "
                              "create it again") from None  # fmt: skip
        return AsUser(env={"SLURM_CONF": str(self.slurm_conf), **(env or {})}, user=user, home=self.shared_dir)

    def run_as_user(
        self,
        args: Sequence[str | os.PathLike[str]],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        check: bool = True,
        timeout: float | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command as the job user (login-like environment) in the shared directory."""
        return self.user_runner(env).run(
            [os.fspath(a) for a in args], cwd=cwd, check=check, timeout=timeout, input=input
        )

    def stream_as_user(
        self, args: Sequence[str], *, env: Mapping[str, str] | None = None, on_line: Log | None = None
    ) -> int:
        """Like :meth:`run_as_user`, passing output lines on as they come; returns the exit code."""
        runner = self.user_runner(env)
        return proc.stream(runner.argv(args), cwd=runner.home, check=False, on_line=on_line)

    def submit(
        self, script: Path | str, *sbatch_args: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> str:
        """``sbatch --parsable SBATCH_ARGS SCRIPT ARGS`` as the job user from the shared directory; the job id.

        A script the job user cannot read (e.g. in a checkout under /root) is copied into the
        shared directory first.
        """
        script = Path(script).absolute()
        if not script.is_file():
            raise CtrainError(f"batch script {script} does not exist")
        if not host.world_readable(script):
            copy = self.shared_dir / ".submitted" / script.name
            copy.parent.mkdir(exist_ok=True)
            shutil.copyfile(script, copy)
            uid, gid = pwd.getpwnam(self.user)[2:4]
            os.chown(copy.parent, uid, gid)
            os.chown(copy, uid, gid)
            script = copy
        client = Slurm(self.user_runner(env))
        return client.sbatch([*sbatch_args, str(script), *args], cwd=self.shared_dir)

    def job_state(self, job_id: str) -> str:
        """The job's state from the controller (finished jobs are kept for an hour)."""
        found = self.slurm.job(job_id)
        if found is None:
            raise CtrainError(f"job {job_id}: the testbed's controller does not know it")
        return found.state

    def wait(self, job_id: str, timeout: float = 300, poll: float = 1.0) -> str:
        """Wait until the job reaches a final state (COMPLETED, FAILED, ...) and return it."""
        return self.slurm.wait(job_id, timeout=timeout, poll=poll).state

    # --- faults ------------------------------------------------------------------------------------------

    def _node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise CtrainError(f"the testbed has no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    def kill_node(self, name: str, *, over: float = 0, seed: int = 0) -> int:
        """Lose a node as a power cut or a kernel panic loses it: its slurmd and every process in its
        network namespace (steps, containers, workers) stopped at once, then SIGKILLed, nothing told
        first, Slurm included (:func:`ctrain.testbed.host.kill_netns_now`). With ``over`` seconds,
        the node dies slowly instead: its processes, slurmd among them, SIGKILLed one at a time in an
        order drawn from ``seed`` (:func:`ctrain.testbed.host.kill_netns_slowly`).

        Returns how many processes died. :meth:`start_node` brings the node back.
        """
        node = self._node(name)
        daemon = self._daemons(self._state()).get(f"slurmd-{name}")
        ours = daemon is not None and host.is_ours(daemon, self.daemon_paths)
        if over > 0:
            count = host.kill_netns_slowly(node.netns, over, random.Random(seed))
        else:
            if ours:
                os.kill(daemon.pid, signal.SIGSTOP)
            count = host.kill_netns_now(node.netns)
        if ours and host.is_ours(daemon, self.daemon_paths):  # in the namespace, it is gone already
            os.kill(daemon.pid, signal.SIGKILL)
        return count

    def local_disk(self, name: str, mib: int) -> Path:
        """Give node NAME a local scratch disk of MIB MiB (a tmpfs), its tasks' TMPDIR from the next
        task on (the TaskProlog); the other nodes keep the shared /tmp. :meth:`remove_local_disk`
        and ``down`` remove it."""
        node = self._node(name)
        path = self.layout.scratch_dir / node.name
        host.mount_tmpfs(path, mib, self.user)
        self._task_prolog(True)
        return path

    def remove_local_disk(self, name: str) -> None:
        path = self.layout.scratch_dir / self._node(name).name
        host.unmount_all_below(path)
        shutil.rmtree(path, ignore_errors=True)
        self._task_prolog(False)

    def _task_prolog(self, on: bool) -> None:
        """Slurm's TaskProlog on (a scratch disk needs it) or back as ``up`` wrote it. Not always on:
        slurmstepd runs the prolog in the task's mount namespace, which under pyxis is the container's,
        where the testbed's prolog file does not exist, and every pyxis task would fail (seen in CI)."""
        conf = self.layout.slurm_conf
        text = conf.read_text()
        line = TASK_PROLOG_LINE.format(path=self.layout.task_prolog)
        if on and "TaskProlog=" not in text:
            conf.write_text(text + line)
        elif not on and line in text:
            conf.write_text(text.replace(line, ""))
        else:
            return
        self.slurm.run(["scontrol", "reconfigure"])

    def slow_node(self, name: str, percent: int) -> int:
        """Slow node NAME down: its slurmd and every process it starts share PERCENT of one CPU (a cgroup
        quota), as a throttled or failing device computes. Returns how many processes were slowed.
        :meth:`restore_node` and ``down`` undo it."""
        return host.throttle_netns(self._node(name).netns, percent)

    def restore_node(self, name: str) -> bool:
        return host.unthrottle_netns(self._node(name).netns)

    def cut_node(self, name: str) -> None:
        """Cut node NAME off the network as a failed switch port or cable does: its link goes down and
        no packet reaches it or leaves it, while every process on it, slurmd included, keeps running
        and no connection is closed, so its peers hear nothing, not even an error.
        :meth:`reconnect_node` and ``down`` undo it. (On the testbed the node still reaches the shared
        file system, which is the machine's own.)"""
        host.set_link(self._node(name).veth, up=False)

    def freeze_node(self, name: str) -> int:
        """Freeze node NAME as a hung kernel does: every process on it, slurmd included, stopped
        (SIGSTOP) with its connections open, so its peers hear nothing. Returns how many were stopped;
        :meth:`thaw_node` undoes it, and ``down`` kills them."""
        return host.stop_netns(self._node(name).netns)

    def thaw_node(self, name: str) -> int:
        """Undo :meth:`freeze_node`; how many processes had been stopped."""
        return host.continue_netns(self._node(name).netns)

    def reconnect_node(self, name: str) -> bool:
        """Undo :meth:`cut_node`; whether the node was cut off."""
        return host.set_link(self._node(name).veth, up=True)

    def start_node(self, name: str, *, timeout: float = STARTUP_TIMEOUT) -> None:
        """Start a killed node's slurmd again and wait until Slurm can give it jobs; a node Slurm set
        DOWN meanwhile is resumed, as an administrator would after replacing it. A node still
        COMPLETING a job that ended while it was gone (the new slurmd never ran it) is set DOWN
        first, which lets go of the job, then resumed."""
        node = self._node(name)
        state = self._state() or {}
        pid_file = self.layout.pid_file(f"slurmd-{name}")
        daemon = host.start_daemon(self._slurmd_argv(node), "slurmd", pid_file, self.daemon_paths)
        state.setdefault("daemons", {})[f"slurmd-{name}"] = daemon.to_json()
        self._save(state)
        started = time.monotonic()
        deadline = started + timeout
        while (now := self.node_state(name)) not in READY_NODE_STATES:
            if now.startswith(("down", "drain", "fail")):
                self.slurm.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], check=False)
            elif now.startswith("completing") and time.monotonic() - started > COMPLETING_GRACE:
                update = ["scontrol", "update", f"NodeName={name}", "State=DOWN", "Reason=restarted by the testbed"]
                self.slurm.run(update, check=False)
            if time.monotonic() > deadline:
                raise CtrainError(f"{name} is {now} {timeout:.0f}s after its slurmd started again")
            time.sleep(0.5)

    def restart_controller(self, *, down: float = 5.0) -> None:
        """Restart slurmctld mid-job as an administrator's restart or upgrade does: SIGTERM (it saves
        its state and exits), ``down`` seconds without a controller, then the same slurmctld again,
        which recovers the jobs from its state; returns once it answers."""
        state = self._state() or {}
        daemon = self._daemons(state).get("slurmctld")
        if daemon is None or not host.is_ours(daemon, self.daemon_paths):
            raise CtrainError("the testbed's slurmctld is not running: `ctrain testbed up` first")
        if host.end_processes([daemon.pid], term_timeout=30):
            raise CtrainError(f"slurmctld (pid {daemon.pid}) did not exit")
        host.wait_reaped([daemon.pid])
        time.sleep(down)
        started = host.start_daemon(self._slurmctld_argv(), "slurmctld", self.layout.pid_file("slurmctld"),
                                    self.daemon_paths)
        state.setdefault("daemons", {})["slurmctld"] = started.to_json()
        self._save(state)
        self._wait_controller()

    def node_state(self, name: str) -> str:
        """The node's state as ``sinfo`` prints it (``idle``, ``allocated``, ``down*``, ...)."""
        return self.slurm.node_states(name).get(name, "missing")

    # --- status ------------------------------------------------------------------------------------------

    def _daemons(self, state: dict | None) -> dict[str, host.Daemon]:
        """Daemons from the state file, plus any PID file of a daemon the state file missed."""
        found = {name: host.Daemon.from_json(d) for name, d in (state or {}).get("daemons", {}).items()}
        if self.layout.run_dir.is_dir():
            for pid_file in sorted(self.layout.run_dir.glob("*.pid")):
                name = pid_file.stem
                try:
                    pid = int(read_text_bounded(pid_file, MAX_PID_FILE_BYTES, "a PID file").strip())
                except (CtrainError, ValueError):
                    continue
                if pid <= 0:
                    continue
                tool = name.split("-", 1)[0]
                if tool not in ("munged", "slurmctld", "slurmd") or not proc.which(tool):
                    continue
                if name not in found:
                    found[name] = host.Daemon(host.program_of(tool), pid)
                elif found[name].pid != pid:
                    found[f"{name} (pid file)"] = host.Daemon(host.program_of(tool), pid)
        return found

    def status(self) -> Status:
        """What is running, and what the controller says about each node."""
        state = self._state()
        if state is None:
            claim = self._network_claim(None)
            bridge = [n for n in claim.links_of(host.our_links()) if n == BRIDGE]
            leftovers = claim.netns_of(host.our_netns()) + bridge
            running = [n for n, d in self._daemons(None).items() if host.is_ours(d, self.daemon_paths)]
            problems = (
                [f"left over from an earlier start: {', '.join(leftovers + running)}"] if leftovers or running else []
            )
            return Status(up=False, problems=problems)
        daemons = self._daemons(state)
        st = Status(up=True, controller_host=state.get("controller_host", ""))

        def check(name: str) -> tuple[int | None, bool]:
            d = daemons.get(name)
            ok = d is not None and host.is_ours(d, self.daemon_paths)
            if not ok:
                st.problems.append(f"{name} is not running")
            return (d.pid if d else None), ok

        st.munged_pid, st.munged_running = check("munged")
        st.controller_pid, st.controller_running = check("slurmctld")
        states: dict[str, str] = {}
        if st.controller_running:
            answers, st.controller_answer = self.slurm.ping()
            if not answers:
                st.problems.append(f"the controller does not answer: {st.controller_answer}")
            else:
                states = self.slurm.node_states()
        for node in self.nodes:
            pid, running = check(f"slurmd-{node.name}")
            st.nodes.append(NodeStatus(node.name, node.ip, pid, running, states.get(node.name, "unknown")))
        return st

    def is_up(self) -> bool:
        """Whether the testbed is up and every daemon it started is running."""
        return self.status().healthy

    # --- up ------------------------------------------------------------------------------------------------

    def up(self, nodes: int = 2, *, with_pyxis: pyxis.Sources | None = None, log: Log = ui.info) -> None:
        """Start a testbed with ``nodes`` nodes (harmless if the same one is already up).

        ``with_pyxis``: build enroot and pyxis from these sources first and load pyxis in every slurmd;
        once installed they stay (a later ``up`` keeps them) until ``down --purge``.
        """
        memory_mb = machine_memory_mb()
        check_nodes(nodes, memory_mb)
        if not system.is_root():
            raise CtrainError(
                "`ctrain testbed up` must run as root: it starts Slurm daemons and creates network namespaces"
            )
        if with_pyxis is not None:
            system.ensure("pyxis")
            self.layout.root.mkdir(parents=True, exist_ok=True)
            pyxis.install(self.layout, with_pyxis, log)
        current = self.status()
        plan = node_plan(nodes)
        gpus = split_gpus(machine_gpus(), plan)
        if current.up:
            same = current.healthy and len(current.nodes) == nodes
            if same and not self._config_changed(plan, memory_mb // nodes, gpus):
                log(f"testbed already up with {nodes} nodes")
                self._wait_ready(plan, log)
                return
            if current.healthy and not same:
                raise CtrainError(
                    f"a testbed with {len(current.nodes)} nodes is already up; to change the number of nodes, run "
                    f"`ctrain testbed down`, then `ctrain testbed up --nodes {nodes}`"
                )
            if same:
                why = "its slurm.conf is not what this version of ctrain writes"
            else:
                why = f"it is not fully up: {'; '.join(current.problems)}"
            log(f"restarting the testbed ({why})")
            self._teardown()
        elif current.problems:
            log(f"cleaning up first: {current.problems[0]}")
            self._teardown()
        self._refuse_foreign(plan)
        system.ensure("testbed", "apptainer")
        try:
            self._start(plan, memory_mb // nodes, gpus, log)
        except BaseException:
            log(f"start failed; stopping what was started (logs are kept in {self.layout.log_dir})")
            try:
                self._teardown()
            except CtrainError as exc:
                log(f"cleanup after the failed start also failed: {exc}")
            raise

    def _render(self, plan: list[Node], memory_mb: int, gpus: dict[str, list[Gpu]]) -> str:
        host_name = socket.gethostname().split(".")[0]
        return render_slurm_conf(self.layout, host_name, plan, machine_cpus(), memory_mb, gpus)

    def _config_changed(self, plan: list[Node], memory_mb: int, gpus: dict[str, list[Gpu]]) -> bool:
        """Whether the running daemons read other files than these (a pyxis built since counts)."""
        found = pyxis.installed(self.layout)
        if (self._state() or {}).get("pyxis") != (found.fingerprint if found else None):
            return True
        try:
            written = tuple(read_text_bounded(p, MAX_STATE_BYTES, "the testbed's config")
                            for p in (self.slurm_conf, self.layout.plugstack_conf))  # fmt: skip
        except CtrainError:
            return True
        return written != (self._render(plan, memory_mb, gpus), pyxis.render_plugstack(self.layout, found is not None))

    def _refuse_foreign(self, plan: list[Node]) -> None:
        """Never take over a Slurm setup, host names or a directory the testbed did not create."""
        link = SLURM_CONF_LINK
        ours = link.is_symlink() and os.readlink(link) == str(self.slurm_conf)
        if (link.exists() or link.is_symlink()) and not ours:
            what = f"a link to {os.readlink(link)}" if link.is_symlink() else "a file"
            raise CtrainError(
                f"{link} already exists ({what}) and was not created by this testbed; the testbed does not "
                f"replace an existing Slurm setup. Slurm commands read $SLURM_CONF, else {link}, so the "
                f"testbed needs that path: move the file away (and back after `ctrain testbed down`), "
                "or use a machine without Slurm configured"
            )
        foreign = host.foreign_daemons(("slurmctld", "slurmd"), self.daemon_paths)
        if foreign:
            raise CtrainError(
                "Slurm daemons not started by this testbed are running; stop them first (the testbed uses "
                "Slurm's default ports):\n  " + "\n  ".join(foreign)
            )
        conflicts = hosts_conflicts(host.HOSTS_FILE.read_text(), plan)
        if conflicts:
            raise CtrainError(
                f"{host.HOSTS_FILE} already names the testbed's nodes or addresses; remove these lines first:\n  "
                + "\n  ".join(conflicts)
            )
        if socket.gethostname().split(".")[0] in {n.name for n in plan}:
            raise CtrainError(f"this machine's hostname {socket.gethostname()!r} is also a testbed node name")
        blocked = host.unreachable_dirs(self.state_dir)
        if blocked:
            raise CtrainError(
                f"the job user could not reach {self.state_dir}: {blocked[0]} is closed to other users; choose a "
                f"state directory elsewhere (--state-dir or ${STATE_DIR_ENV}), e.g. under /var/lib or /srv"
            )

    def _start(self, plan: list[Node], memory_mb: int, gpus: dict[str, list[Gpu]], log: Log) -> None:
        self._prepare_files(plan, memory_mb, gpus)
        nodes: list[dict] = [{"name": n.name, "ip": n.ip} for n in plan]
        for node in nodes:
            if gpus[node["name"]]:
                node["gpus"] = [g.path for g in gpus[node["name"]]]
        found = pyxis.installed(self.layout)
        state: dict = {
            "user": JOB_USER,
            "controller_host": socket.gethostname().split(".")[0],
            "nodes": nodes,
            "daemons": {},
            "pyxis": found.fingerprint if found else None,
        }
        self._save(state)

        def start(name: str, argv: list[str]) -> None:
            tool = re.match(r"[a-z]+", name).group()
            daemon = host.start_daemon(argv, tool, self.layout.pid_file(name), self.daemon_paths)
            state["daemons"][name] = daemon.to_json()
            self._save(state)

        if any(gpus.values()):
            dealt = ", ".join(f"{name} {' '.join(g.path for g in gs) or 'none'}" for name, gs in gpus.items())
            log(f"GPUs (Slurm gres gpu): {dealt}")
        log(f"network: bridge {BRIDGE} ({CONTROLLER_IP}), {len(plan)} node namespaces")
        host.network_up(plan)
        host.write_in_place(host.HOSTS_FILE, hosts_with_ours(host.HOSTS_FILE.read_text(), plan))
        log("starting munged, slurmctld")
        start("munged", self._munged_argv())
        start("slurmctld", self._slurmctld_argv())
        self._wait_controller()
        # Jobs saved by a controller that crashed would otherwise run again on the new nodes.
        stale = self.slurm.queued_ids()
        if stale:
            self.slurm.run(["scancel", *stale])
            log(f"cancelled {len(stale)} job(s) left from before the last stop")
        if found:
            log(f"pyxis {found.pyxis} and enroot {found.enroot}: loaded by every slurmd and srun ({self.layout.plugstack_conf})")
        log(f"starting slurmd on {', '.join(n.name for n in plan)}")
        for node in plan:
            start(f"slurmd-{node.name}", self._slurmd_argv(node))
        self._wait_ready(plan, log)
        if host.fuse_needs_opening():
            host.open_fuse()
            log(
                f"made {host.FUSE_DEVICE} usable by all users (mode 0666, the usual default): Apptainer needs it "
                "to mount images as an unprivileged user"
            )

    def _prepare_files(self, plan: list[Node], memory_mb: int, gpus: dict[str, list[Gpu]]) -> None:
        """Directories, the job user and shared dir, the munge key, slurm.conf (with cgroup.conf, and
        gres.conf and the task prolog where there are GPUs) and its /etc/slurm link."""
        lay = self.layout
        for parent in reversed(lay.root.parents):
            if not parent.exists():  # made reachable for the job user whatever the umask
                parent.mkdir()
                parent.chmod(0o755)
        private = (lay.munge_dir, lay.controller_state_dir)
        for directory in (lay.root, lay.run_dir, lay.log_dir, lay.spool_dir, *private):
            mode = 0o700 if directory in private else 0o755
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(mode)
        user = host.ensure_user(JOB_USER)
        lay.shared_dir.mkdir(exist_ok=True)
        os.chown(lay.shared_dir, user.pw_uid, user.pw_gid)
        lay.shared_dir.chmod(0o755)
        if not lay.munge_key.exists():
            fd = os.open(lay.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as handle:
                handle.write(os.urandom(1024))
        lay.slurm_conf.write_text(self._render(plan, memory_mb, gpus))
        lay.cgroup_conf.write_text(render_cgroup_conf())
        lay.plugstack_conf.write_text(pyxis.render_plugstack(lay, pyxis.installed(lay) is not None))
        lay.task_prolog.write_text(render_task_prolog(gpus, lay.scratch_dir))
        lay.task_prolog.chmod(0o755)  # run by the job user before each task
        if any(gpus.values()):
            lay.gres_conf.write_text(render_gres_conf(gpus))
        else:  # what a start on a GPU machine left would otherwise be read by slurmd
            lay.gres_conf.unlink(missing_ok=True)
        if not SLURM_CONF_LINK.is_symlink():
            SLURM_CONF_LINK.parent.mkdir(parents=True, exist_ok=True)
            SLURM_CONF_LINK.symlink_to(lay.slurm_conf)

    def _munged_argv(self) -> list[str]:
        lay = self.layout
        return [
            proc.require("munged"),
            f"--socket={lay.munge_socket}",
            f"--key-file={lay.munge_key}",
            f"--pid-file={lay.pid_file('munged')}",
            f"--log-file={lay.log_file('munged')}",
            f"--seed-file={lay.munge_dir / 'munged.seed'}",
        ]

    def _slurmctld_argv(self) -> list[str]:
        return [proc.require("slurmctld"), "-f", str(self.slurm_conf)]

    def _slurmd_argv(self, node: Node) -> list[str]:
        """slurmd in the node's network namespace, with the node's hostname in a new UTS namespace.

        Only the network namespace is entered: `ip netns exec` would remount /sys without the
        cgroup mounts slurmd needs.
        """
        enter = ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--"]
        # pyxis runs `enroot` from slurmd's PATH (the only variable it keeps from slurmstepd).
        path = f"PATH={shlex.quote(str(pyxis.bin_dir(self.layout)))}:$PATH " if pyxis.installed(self.layout) else ""
        script = f'{shlex.quote(proc.require("hostname"))} "$0" && {path}exec "$@"'
        set_hostname = ["/bin/sh", "-c", script, node.name]
        return [*enter, *set_hostname, proc.require("slurmd"), "-f", str(self.slurm_conf), "-N", node.name]

    def _wait_controller(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            answers, answer = self.slurm.ping()
            if answers:
                return
            if time.monotonic() > deadline:
                raise CtrainError(
                    f"slurmctld does not answer after {STARTUP_TIMEOUT:.0f}s ({answer}); "
                    f"end of {self.layout.log_file('slurmctld')}:\n{_tail(self.layout.log_file('slurmctld'))}"
                )
            time.sleep(0.3)

    def _wait_ready(self, plan: list[Node], log: Log) -> None:
        """Wait until every node is up in ``sinfo``, printing each change."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        last = ""
        while True:
            states = self.slurm.node_states()
            waiting = [n for n in plan if states.get(n.name) not in READY_NODE_STATES]
            line = ", ".join(f"{n.name} {states.get(n.name, 'missing')}" for n in plan)
            if line != last:
                log(f"nodes: {line}")
                last = line
            if not waiting:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"end of {self.layout.log_file('slurmd-' + n.name)}:\n{_tail(self.layout.log_file('slurmd-' + n.name))}"
                    for n in waiting
                )
                raise CtrainError(f"nodes not ready after {STARTUP_TIMEOUT:.0f}s: {line}\n{tails}")
            time.sleep(0.3)

    # --- down -----------------------------------------------------------------------------------------------

    def down(self, *, log: Log = ui.info) -> list[str]:
        """Stop everything the testbed started and remove what it created; returns what it did."""
        if not system.is_root():
            raise CtrainError("`ctrain testbed down` must run as root: it stops daemons and removes network namespaces")
        done = self._teardown()
        log("testbed is down" + (f": {'; '.join(done)}" if done else " (nothing was running)"))
        return done

    def purge(self, *, log: Log = ui.info) -> list[str]:
        """After ``down``: remove the state directory and the job user, leaving no trace of the testbed."""
        if not system.is_root():
            raise CtrainError("`ctrain testbed down --purge` must run as root: it removes a user and a directory")
        running = host.marked_processes(("munged", "slurmctld", "slurmd"), self.daemon_paths)
        if running or self._network_claim(self._state(damaged_ok=True)).netns_of(host.our_netns()):
            raise CtrainError("the testbed is still running: run `ctrain testbed down` first")
        done = []
        if self.state_dir.is_dir() and (foreign := self.layout.foreign_entries(os.listdir(self.state_dir))):
            raise CtrainError(
                f"{self.state_dir} holds {', '.join(foreign[:3])}, which the testbed did not make: it is not the "
                "testbed's state directory (mistyped --state-dir?); nothing was removed"
            )
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
            done.append(f"removed {self.state_dir}")
        if host.remove_user(JOB_USER):
            done.append(f"removed user {JOB_USER} and its home")
        log("testbed purged" + (f": {'; '.join(done)}" if done else " (nothing to remove)"))
        return done

    def _network_claim(self, state: dict | None) -> NetworkClaim:
        """The network names this testbed made (:func:`ctrain.testbed.plan.network_claim`): another testbed's
        are never this one's to remove, whatever --state-dir names."""
        link = SLURM_CONF_LINK
        target = os.readlink(link) if link.is_symlink() else "" if link.exists() else None
        nodes = [Node(n["name"], n["ip"]) for n in (state or {}).get("nodes", [])]
        return network_claim(nodes, target, self.slurm_conf)

    def _teardown(self) -> list[str]:
        """Stop and remove what this state directory's testbed started and made, and nothing else: its
        daemons (by PID and their exact paths) and the network names it claims (:meth:`_network_claim`)."""
        state = self._state(damaged_ok=True)
        daemons = self._daemons(state)
        claim = self._network_claim(state)
        done: list[str] = []
        by_tool = {
            t: [n for n in daemons if re.match(r"[a-z]+", n).group() == t] for t in ("munged", "slurmctld", "slurmd")
        }
        if any(host.is_ours(daemons[n], self.daemon_paths) for n in by_tool["slurmctld"]):
            jobs = self.slurm.queued_ids()
            if jobs:
                self.slurm.run(["scancel", *jobs], check=False)
                done.append(f"cancelled {len(jobs)} job(s)")
                # Let the nodes finish them, so the controller does not save them as still completing.
                deadline = time.monotonic() + JOB_DRAIN_TIMEOUT
                while self.slurm.queued_ids():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)

        # Every process this teardown ends: it returns only once they are all gone (reaped).
        ended = [d.pid for n, d in daemons.items() if host.is_ours(d, self.daemon_paths)]
        ended += [pid for ns in claim.netns_of(host.our_netns()) for pid in host.netns_pids(ns)]

        def stop(names: list[str]) -> None:
            for name in names:
                if host.stop(daemons[name], self.daemon_paths):
                    done.append(f"stopped {name} (pid {daemons[name].pid})")

        for netns in claim.netns_of(host.throttled_netns()):
            if host.unthrottle_netns(netns):
                done.append(f"undid the CPU limit of {netns}")
        stop(by_tool["slurmd"])
        for netns in claim.netns_of(host.our_netns()):
            count = host.kill_netns_processes(netns)
            if count:
                done.append(f"ended {count} job process(es) left on {netns}")
        stop(by_tool["slurmctld"])
        stop(by_tool["munged"])
        # What the daemons started may outlive them (a slurmstepd, a helper of munged): end it and
        # wait, so that `down` returns only when nothing of this testbed runs any more.
        marked = host.marked_processes(("munged", "slurmctld", "slurmd"), self.daemon_paths)
        in_netns = [pid for ns in claim.netns_of(host.our_netns()) for pid in host.netns_pids(ns)]
        leftover = sorted({*marked, *in_netns})
        if leftover:
            survivors = host.end_processes(leftover)
            if survivors:
                raise CtrainError(f"process(es) {', '.join(map(str, survivors))} still running after SIGKILL")
            done.append(f"ended {len(leftover)} leftover process(es)")
        host.wait_reaped([*ended, *leftover])
        done.extend(f"removed {what}" for what in host.network_down(claim))
        for mount in host.unmount_all_below(self.layout.scratch_dir):
            done.append(f"unmounted the scratch disk {mount}")
        shutil.rmtree(self.layout.scratch_dir, ignore_errors=True)
        hosts = host.HOSTS_FILE.read_text()
        kept = hosts_without_ours(hosts)
        if claim.hosts_lines and kept != hosts:
            host.write_in_place(host.HOSTS_FILE, kept)
            done.append(f"removed the testbed's lines from {host.HOSTS_FILE}")
        if SLURM_CONF_LINK.is_symlink() and os.readlink(SLURM_CONF_LINK) == str(self.slurm_conf):
            SLURM_CONF_LINK.unlink()
            done.append(f"removed {SLURM_CONF_LINK}")
        for name, daemon in daemons.items():
            if host.is_ours(daemon, self.daemon_paths):
                raise CtrainError(f"{name} (pid {daemon.pid}) is still running after SIGKILL")
        state_file = self.layout.state_file
        if os.path.lexists(state_file) and (state_file.is_symlink() or not state_file.is_dir()):
            state_file.unlink()
        elif os.path.lexists(state_file):
            done.append(f"left {state_file} (a directory, not a state file: remove it)")
        return done


def usage(tb: Testbed) -> str:
    """How to use a running testbed (printed by ``up``)."""
    names = " ".join(n.name for n in tb.nodes)
    gpus = tb.gpus
    gpu_lines = gpu_try = ""
    if any(gpus.values()):
        dealt = ", ".join(f"{name}: {' '.join(paths) or 'none'}" for name, paths in gpus.items())
        per_node = min(len(paths) for paths in gpus.values())
        gpu_lines = f"  GPUs:       {dealt} (Slurm gres gpu)\n"
        gpu_try = (
            f"  ctrain testbed exec -- srun -N{len(tb.nodes)} --gpus-per-node={max(per_node, 1)} "
            "sh -c 'echo $(hostname) $CUDA_VISIBLE_DEVICES'\n"
        )
    return f"""\
testbed is up: {len(tb.nodes)} nodes ({names}), partition {PARTITION}, controller at {CONTROLLER_IP}
  job user:   {tb.user} (jobs run as this user, as on a cluster)
  shared dir: {tb.shared_dir} (the same path on every node, like /scratch)
{gpu_lines}try:
  ctrain testbed exec -- srun -N{len(tb.nodes)} hostname
  ctrain testbed exec -- sbatch -N{len(tb.nodes)} --wrap 'srun hostname -I'
{gpu_try}  su - {tb.user}                 # then sbatch, srun, squeue as on a login node; cd {tb.shared_dir}
  ctrain testbed status; ctrain testbed down
"""
