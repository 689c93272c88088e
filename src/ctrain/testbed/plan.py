"""What a testbed looks like, as data: node names and addresses, limits, file layout, slurm.conf,
gres.conf, cgroup.conf, the GPU task prolog and the /etc/hosts lines. Pure functions (and readers of
/proc and /dev), so everything here is tested without root.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ctrain.errors import ConfigError, ParseError

DEFAULT_STATE_DIR = Path("/var/lib/ctrain/testbed")
STATE_DIR_ENV = "CTRAIN_TESTBED_DIR"
JOB_USER = "ctrain"
PARTITION = "debug"
# The partition's time limits, as a site sets them: a job that names none gets the default (and
# `ctrain submit` says so), and none may ask for more than the maximum.
PARTITION_DEFAULT_TIME = "04:00:00"
PARTITION_MAX_TIME = "7-00:00:00"
CLUSTER_NAME = "testbed"

# One testbed per machine: these names are the testbed's own, so `down` may remove them after a crash.
NETWORK = ipaddress.IPv4Network("10.77.0.0/24")
CONTROLLER_IP = NETWORK[1]
FIRST_NODE_HOST = 11
BRIDGE = "ctrain0"
NETNS_PREFIX = "ctrain-"
VETH_PREFIX = "ctrain-v"
NODE_PREFIX = "node"
HOSTS_MARK = "# ctrain testbed"

# Job step credentials live this long; all daemons are on one machine, so a short life is safe
# and lets a requeued job start again soon.
CRED_EXPIRE_S = 10

# Each node advertises an equal share of the machine's memory and must get at least this much.
MIN_NODE_MEMORY_MB = 1024
MAX_NODES_BY_ADDRESS = NETWORK.num_addresses - 1 - FIRST_NODE_HOST  # .11 up to .254


@dataclass(frozen=True)
class Node:
    """One Slurm node: its name, address and the network namespace and host-side veth it lives on."""

    name: str
    ip: str

    @property
    def netns(self) -> str:
        return NETNS_PREFIX + self.name

    @property
    def veth(self) -> str:
        return VETH_PREFIX + self.name.removeprefix(NODE_PREFIX)


def node_plan(count: int) -> list[Node]:
    """Nodes node1..nodeN at 10.77.0.11, .12, ..."""
    return [Node(f"{NODE_PREFIX}{i}", str(NETWORK[FIRST_NODE_HOST + i - 1])) for i in range(1, count + 1)]


def max_nodes(memory_mb: int) -> int:
    """How many nodes this machine can hold: by memory share and by the /24's addresses."""
    return max(0, min(MAX_NODES_BY_ADDRESS, memory_mb // MIN_NODE_MEMORY_MB))


def check_nodes(count: int, memory_mb: int) -> None:
    """Reject a node count the machine cannot hold, saying why and what the limit is."""
    if count < 1:
        raise ConfigError(f"--nodes must be at least 1 (got {count}); the default is 2")
    limit = max_nodes(memory_mb)
    if count > limit:
        raise ConfigError(
            f"--nodes {count} is more than this machine can hold: at most {limit} nodes here "
            f"(each node gets an equal share of the machine's {memory_mb} MB of memory and needs at least "
            f"{MIN_NODE_MEMORY_MB} MB; the testbed network {NETWORK} has room for {MAX_NODES_BY_ADDRESS} nodes)"
        )


def machine_memory_mb() -> int:
    """Total memory from /proc/meminfo, in MB."""
    text = Path("/proc/meminfo").read_text()
    match = re.search(r"^MemTotal:\s+(\d+) kB", text, re.MULTILINE)
    if not match:
        raise ParseError("/proc/meminfo", text[:500])
    return int(match.group(1)) // 1024


def machine_cpus() -> int:
    """CPUs this process may run on (what each node advertises to Slurm)."""
    return len(os.sched_getaffinity(0))


# --- GPUs ----------------------------------------------------------------------------------------

_GPU_DEVICE = re.compile(r"nvidia(\d+)")
_GPU_INFO = re.compile(r"^(GPU UUID|Device Minor):\s*(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU of this machine: its device file /dev/nvidiaN and, where the driver says, its UUID."""

    minor: int
    uuid: str | None = None

    @property
    def path(self) -> str:
        return f"/dev/nvidia{self.minor}"


def machine_gpus(dev: Path = Path("/dev"), driver: Path = Path("/proc/driver/nvidia/gpus")) -> list[Gpu]:
    """The machine's NVIDIA GPUs (/dev/nvidiaN device files), with UUIDs from the driver's /proc files.

    None on a machine without NVIDIA's driver: the testbed is then CPU-only, as before.
    """
    minors = sorted(
        int(match.group(1))
        for entry in (dev.iterdir() if dev.is_dir() else [])
        if (match := _GPU_DEVICE.fullmatch(entry.name))
    )
    uuids: dict[int, str] = {}
    for info in sorted(driver.glob("*/information")) if driver.is_dir() else []:
        try:
            fields = dict(_GPU_INFO.findall(info.read_text(errors="replace")))
        except OSError:
            continue
        if fields.get("Device Minor", "").isdigit() and fields.get("GPU UUID", "").startswith("GPU-"):
            uuids[int(fields["Device Minor"])] = fields["GPU UUID"]
    return [Gpu(minor, uuids.get(minor)) for minor in minors]


def split_gpus(gpus: Sequence[Gpu], nodes: Sequence[Node]) -> dict[str, list[Gpu]]:
    """The machine's GPUs dealt to the nodes in order: equal shares, the first nodes one more where
    they do not divide (3 GPUs on 2 nodes: 2 and 1); nodes beyond the GPUs get none."""
    share, extra = divmod(len(gpus), len(nodes)) if nodes else (0, 0)
    split: dict[str, list[Gpu]] = {}
    start = 0
    for i, node in enumerate(nodes):
        count = share + (1 if i < extra else 0)
        split[node.name] = list(gpus[start : start + count])
        start += count
    return split


@dataclass(frozen=True)
class Layout:
    """Where a testbed keeps its files: config, munge key, sockets and PID files, logs, spool, state."""

    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "testbed.json"

    @property
    def slurm_conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        return self.root / "gres.conf"

    @property
    def cgroup_conf(self) -> Path:
        return self.root / "cgroup.conf"

    @property
    def task_prolog(self) -> Path:
        return self.root / "task-prolog.sh"

    @property
    def scratch_dir(self) -> Path:
        """Node-local scratch disks: ``scratch/NODE``, where it exists, is that node's TMPDIR."""
        return self.root / "scratch"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge.socket"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def spool_dir(self) -> Path:
        return self.root / "spool"

    @property
    def controller_state_dir(self) -> Path:
        return self.root / "slurmctld"

    @property
    def shared_dir(self) -> Path:
        return self.root / "shared"

    @property
    def plugstack_conf(self) -> Path:
        return self.root / "plugstack.conf"

    @property
    def pyxis_prefix(self) -> Path:
        """Where enroot and pyxis are installed when the testbed runs them (``up --pyxis``)."""
        return self.root / "pyxis"

    def pid_file(self, daemon: str) -> Path:
        return self.run_dir / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.log_dir / f"{daemon}.log"

    #: The names the testbed makes in its state directory (``up --pyxis`` builds in pyxis-build).
    ENTRIES = frozenset({"testbed.json", "slurm.conf", "gres.conf", "cgroup.conf", "task-prolog.sh", "scratch",
                         "munge", "run", "log", "spool", "slurmctld", "shared", "plugstack.conf", "pyxis",
                         "pyxis-build"})  # fmt: skip

    def foreign_entries(self, names: Iterable[str]) -> list[str]:
        """Those of NAMES (a state directory's entries) the testbed did not make: ``down --purge`` removes
        the whole directory, which must not be one named by mistake (a --state-dir of /var, or a home)."""
        return sorted(n for n in names if n not in self.ENTRIES and not n.startswith(".testbed.json.tmp-"))

    @property
    def daemon_paths(self) -> frozenset[str]:
        """The paths under the state directory that the testbed starts its daemons with (slurmctld's and
        slurmd's ``-f``, munged's options): a process naming one of them exactly is this testbed's."""
        munge = [self.munge_socket, self.munge_key, self.pid_file("munged"), self.log_file("munged"),
                 self.munge_dir / "munged.seed"]  # fmt: skip
        return frozenset(str(p) for p in (self.slurm_conf, *munge))


def names_path(argv: Sequence[str], marker: str | Collection[str]) -> bool:
    """Whether a command line names one of the paths in MARKER itself, as an argument or an option's value
    (``-f PATH``, ``--key-file=PATH``). Compared as paths, whole: the testbed in /var owns no daemon started
    with /var/lib/ctrain/testbed/slurm.conf, nor the one in /srv/tb a daemon of /srv/tb2."""
    wanted = {Path(marker)} if isinstance(marker, str) else {Path(p) for p in marker}
    for arg in argv:
        for value in (arg, arg.partition("=")[2]):
            if value.startswith("/") and Path(value) in wanted:
                return True
    return False


@dataclass(frozen=True)
class NetworkClaim:
    """Which of the machine's testbed network names (fixed: bridge, ctrain-NODE namespaces, veths) the
    testbed of one state directory made, and so may remove; the rest may be another testbed's."""

    everything: bool = False
    netns: frozenset[str] = frozenset()
    links: frozenset[str] = frozenset()

    def netns_of(self, names: Iterable[str]) -> list[str]:
        """Those of the namespaces NAMES that are claimed."""
        return [n for n in names if n.startswith(NETNS_PREFIX) and (self.everything or n in self.netns)]

    def links_of(self, names: Iterable[str]) -> list[str]:
        """Those of the links NAMES that are claimed."""
        ours = [n for n in names if n == BRIDGE or n.startswith(VETH_PREFIX)]
        return [n for n in ours if self.everything or n in self.links]

    @property
    def hosts_lines(self) -> bool:
        """Whether the testbed lines of /etc/hosts are this testbed's (they name no state directory)."""
        return self.everything or bool(self.netns)


def network_claim(nodes: Sequence[Node], link: str | None, slurm_conf: Path) -> NetworkClaim:
    """What of the network the testbed whose config is SLURM_CONF made. LINK is where /etc/slurm/slurm.conf
    points (None: nothing there; "": a file, no link). ``up`` makes that link before the network and ``down``
    removes it after, and ``up`` refuses to start while it points elsewhere: pointing at SLURM_CONF, the
    machine's testbed is this one (all its names, even with the state file gone); pointing elsewhere, it is
    another's (none). With no link, the namespaces and veths of the NODES the state file records, and the bridge."""
    if link is not None:
        return NetworkClaim(everything=True) if link and Path(link) == slurm_conf else NetworkClaim()
    if not nodes:
        return NetworkClaim()
    return NetworkClaim(netns=frozenset(n.netns for n in nodes), links=frozenset({BRIDGE, *(n.veth for n in nodes)}))


def render_slurm_conf(
    layout: Layout,
    controller_host: str,
    nodes: list[Node],
    cpus: int,
    memory_mb: int,
    gpus: Mapping[str, Sequence[Gpu]] | None = None,
) -> str:
    """The testbed's slurm.conf (Slurm 22.05 and later); ``gpus`` (node -> its GPUs) adds GPU gres."""
    gpus = gpus or {}

    def gres(node: Node) -> str:
        count = len(gpus.get(node.name, ()))
        return f" Gres=gpu:{count}" if count else ""

    node_lines = "\n".join(
        f"NodeName={n.name} NodeAddr={n.ip} CPUs={cpus} RealMemory={memory_mb}{gres(n)} State=UNKNOWN" for n in nodes
    )
    gpu_lines = ""
    if any(gpus.values()):
        gpu_lines = f"""
# GPUs: this machine's /dev/nvidiaN dealt to the nodes as generic resources (gres.conf beside this
# file); jobs ask with --gpus-per-node or --gres=gpu:N and get CUDA_VISIBLE_DEVICES and
# SLURM_GPUS_ON_NODE. The nodes share one machine, so the task prolog turns each node's GPU
# numbers (from 0, as on any node) into the machine's own GPUs. No device cgroup confines a job.
GresTypes=gpu
TaskProlog={layout.task_prolog}
"""
    return f"""\
# Written by `ctrain testbed up`; rewritten on every start. See docs/testbed.md.
ClusterName={CLUSTER_NAME}
SlurmctldHost={controller_host}({CONTROLLER_IP})
SlurmUser=root
SlurmdUser=root

# The testbed's own munged, key and socket: an existing /etc/munge setup is left alone.
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={layout.munge_socket},cred_expire={CRED_EXPIRE_S}

StateSaveLocation={layout.controller_state_dir}
SlurmdSpoolDir={layout.spool_dir}/%n
SlurmctldPidFile={layout.pid_file("slurmctld")}
SlurmdPidFile={layout.pid_file("slurmd-%n")}
SlurmctldLogFile={layout.log_file("slurmctld")}
SlurmdLogFile={layout.log_file("slurmd-%n")}
# SPANK plugins (pyxis, with `ctrain testbed up --pyxis`): one file for every slurmd and srun,
# whichever slurm.conf path they were given.
PlugStackConfig={layout.plugstack_conf}

# All nodes share one kernel: track job processes by parent PID, no cgroups, no CPU binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Every node advertises all of the machine's CPUs; never drain a node for having "too few".
SlurmdParameters=config_overrides
ReturnToService=2
# A tiny cluster: look at pending jobs every 2 s (default 60 s), so a job whose begin time has
# passed (a requeued one, say) starts promptly.
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none

# Preemption-safe jobs: `scontrol requeue`, `sbatch --requeue`, `--signal` all work.
JobRequeue=1
# Refuse at submit time what could never run (e.g. -N3 on 2 nodes) instead of queueing it forever.
EnforcePartLimits=ALL
# No accounting database (sacct needs slurmdbd): finished jobs stay in `scontrol show job` for an
# hour, and every finished job gets a line in the completion log.
MinJobAge=3600
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={layout.log_file("jobcomp")}
{gpu_lines}
{node_lines}
PartitionName={PARTITION} Nodes=ALL Default=YES DefaultTime={PARTITION_DEFAULT_TIME} MaxTime={PARTITION_MAX_TIME} State=UP
"""


def render_gres_conf(gpus: Mapping[str, Sequence[Gpu]]) -> str:
    """gres.conf: each node's GPUs by device file. Only CUDA_VISIBLE_DEVICES is set for them
    (``Flags=nvidia_gpu_env``), not the AMD, Intel and OpenCL variables Slurm sets by default."""
    lines = [
        "# Written by `ctrain testbed up`; rewritten on every start. See docs/testbed.md (GPUs).",
        "# slurmd reads the lines of its own node: one line per GPU, its device file on this machine.",
    ]
    for node, node_gpus in gpus.items():
        lines += [f"NodeName={node} Name=gpu File={gpu.path} Flags=nvidia_gpu_env" for gpu in node_gpus]
    return "\n".join(lines) + "\n"


def render_cgroup_conf() -> str:
    """cgroup.conf: no cgroups. slurmd loads a cgroup plugin whatever the other settings say, and on a
    cgroup v2 machine without systemd (a container, a small VM) the v2 plugin's set-up fails; the v1
    plugin's does nothing, and nothing else here uses cgroups (proctrack/linuxproc, task/none)."""
    return """\
# Written by `ctrain testbed up`; rewritten on every start. See docs/testbed.md.
# No cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none in slurm.conf), but slurmd
# loads a cgroup plugin anyway: cgroup/v1's set-up does nothing, so it starts on any machine, also
# one with cgroup v2 and no systemd, where cgroup/v2's would fail.
CgroupPlugin=cgroup/v1
IgnoreSystemd=yes
"""


TASK_PROLOG_LINE = "TaskProlog={path}  # a node's own scratch disk as its TMPDIR (Testbed.local_disk)\n"


def render_task_prolog(gpus: Mapping[str, Sequence[Gpu]], scratch: Path) -> str:
    """The TaskProlog: a node's own scratch disk as the task's TMPDIR, where ``scratch/NODE`` exists
    (``Testbed.local_disk``; the nodes share one file system, and a site's TaskProlog or
    job_container plugin gives each node's tasks a local TMPDIR the same way), and a node's GPU
    numbers mapped to this machine's GPUs (by UUID where known).

    Slurm numbers each node's GPUs from 0 in CUDA_VISIBLE_DEVICES, as on a real node, where GPU 0 is
    the node's own. The testbed's nodes share one machine: node2's GPU 0 is, say, /dev/nvidia1. The
    prolog runs before each task (the batch script too) and prints the task's new value.
    """
    cases = []
    for node, node_gpus in gpus.items():
        if node_gpus:
            names = " ".join(gpu.uuid or str(gpu.minor) for gpu in node_gpus)
            cases.append(f"    {node}) gpus='{names}' ;;")
    case_lines = "\n".join(cases)
    return f"""\
#!/bin/sh
# Written by `ctrain testbed up`; rewritten on every start. See docs/testbed.md (GPUs).
# Slurm's TaskProlog: what it prints as `export NAME=VALUE` is set in the task's environment.
# A node with a scratch disk of its own (a directory named after it, made by the tests) gets it as
# TMPDIR, as a node-local /tmp.
[ -z "${{SLURMD_NODENAME:-}}" ] || [ ! -d {shlex.quote(str(scratch))}/"$SLURMD_NODENAME" ] ||
    echo "export TMPDIR="{shlex.quote(str(scratch))}/"$SLURMD_NODENAME"
# The testbed's nodes share this machine's GPUs. Slurm numbers each node's GPUs from 0, as on a real
# node; here they are turned into this machine's own GPUs (UUIDs, else device numbers), so that
# CUDA on node2 uses node2's GPU and not the machine's first one.
[ -n "${{CUDA_VISIBLE_DEVICES:-}}" ] || exit 0
case ${{SLURMD_NODENAME:-}} in
{case_lines}
    *) exit 0 ;;
esac
# nth N WORD...: the Nth word, counting from 0
nth() {{
    shift "$(($1 + 1))"
    echo "$1"
}}
count=$(echo $gpus | wc -w)
out=
for index in $(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' '); do
    case $index in
        '' | *[!0-9]*) exit 0 ;; # not a number: leave the value as Slurm set it
    esac
    [ "$index" -lt "$count" ] || exit 0
    out=${{out:+$out,}}$(nth "$index" $gpus)
done
echo "export CUDA_VISIBLE_DEVICES=$out"
"""


def _is_ours(line: str) -> bool:
    return line.rstrip().endswith(HOSTS_MARK)


def hosts_without_ours(text: str) -> str:
    """/etc/hosts with the testbed's lines removed; every other line is kept byte for byte."""
    return "".join(line for line in text.splitlines(keepends=True) if not _is_ours(line))


def hosts_with_ours(text: str, nodes: list[Node]) -> str:
    """/etc/hosts with exactly one testbed line per node (any older testbed lines replaced)."""
    kept = hosts_without_ours(text)
    if kept and not kept.endswith("\n"):
        kept += "\n"
    return kept + "".join(f"{n.ip}\t{n.name}\t{HOSTS_MARK}\n" for n in nodes)


def hosts_conflicts(text: str, nodes: list[Node]) -> list[str]:
    """Lines not written by the testbed that already name one of its nodes or addresses."""
    names = {n.name for n in nodes}
    addresses = {n.ip for n in nodes}
    found = []
    for line in text.splitlines():
        if _is_ours(line):
            continue
        fields = line.split("#", 1)[0].split()
        if fields and (fields[0] in addresses or names.intersection(fields[1:])):
            found.append(line)
    return found


# A node that answers and can take jobs (sinfo marks unresponsive nodes with '*').
READY_NODE_STATES = {"idle", "mixed", "allocated"}
