"""What the testbed does to the machine: daemons (started detached, known by PID), the bridge and
per-node network namespaces, /etc/hosts lines, the job user. Everything here needs root.

A daemon counts as the testbed's only while its PID still runs the same program, started at the
recorded time, with one of the testbed's own paths on its command line (``marker``: a path, or the set
:attr:`ctrain.testbed.plan.Layout.daemon_paths`, matched whole, never as a substring); nothing is stopped
by name.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import stat
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

from ctrain import proc
from ctrain.errors import CtrainError
from ctrain.testbed.plan import (
    BRIDGE,
    CONTROLLER_IP,
    NETNS_PREFIX,
    NETWORK,
    VETH_PREFIX,
    NetworkClaim,
    Node,
    names_path,
)

#: What names a testbed's processes: one path, or the paths its daemons are started with.
Marker = str | Collection[str]

HOSTS_FILE = Path("/etc/hosts")
FUSE_DEVICE = Path("/dev/fuse")


@dataclass(frozen=True)
class Daemon:
    """A process the testbed started: PID, program and start time (clock ticks after boot)."""

    program: str
    pid: int
    start: int | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Daemon:
        return cls(str(data["program"]), int(data["pid"]), data.get("start"))


@dataclass(frozen=True)
class ProcInfo:
    """What /proc says about a PID."""

    program: str
    start: int
    state: str
    cmdline: str
    argv: tuple[str, ...] = ()


def program_of(tool: str) -> str:
    """The executable a tool's binary really is (/usr/sbin/slurmctld may be a link to slurmctld-wlm)."""
    return os.path.basename(os.path.realpath(proc.require(tool)))


def proc_info(pid: int) -> ProcInfo | None:
    """The program, start time, state and command line of ``pid``; None when it is gone."""
    base = Path("/proc") / str(pid)
    try:
        stat_text = (base / "stat").read_text()
        argv = (base / "cmdline").read_bytes().decode(errors="replace").split("\0")
        try:
            exe = os.readlink(base / "exe")
        except PermissionError:  # another user's process, seen without root: trust its argv[0]
            exe = os.path.realpath(shutil.which(argv[0]) or argv[0])
    except (FileNotFoundError, ProcessLookupError):
        return None
    cmdline = " ".join(argv).strip()
    # Fields after the command name (which may hold spaces) start after the last ')'.
    rest = stat_text[stat_text.rindex(")") + 2 :].split()
    program = os.path.basename(exe.removesuffix(" (deleted)"))
    return ProcInfo(program=program, start=int(rest[19]), state=rest[0], cmdline=cmdline,
                    argv=tuple(a for a in argv if a))  # fmt: skip


def is_ours(daemon: Daemon, marker: Marker) -> bool:
    """Whether ``daemon.pid`` still is the process the testbed started (not a reused PID)."""
    info = proc_info(daemon.pid)
    if info is None or info.state in ("Z", "X"):
        return False
    if info.program != daemon.program or not names_path(info.argv, marker):
        return False
    return daemon.start is None or info.start == daemon.start


def start_daemon(argv: list[str], tool: str, pid_file: Path, marker: Marker, timeout: float = 15) -> Daemon:
    """Start a self-daemonizing program and return it as read from its PID file."""
    program = program_of(tool)
    pid_file.unlink(missing_ok=True)
    proc.run(argv, timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int(pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            pid = 0
        info = proc_info(pid) if pid else None
        if info is not None and info.program == program and names_path(info.argv, marker):
            return Daemon(program, pid, info.start)
        time.sleep(0.1)
    raise CtrainError(f"{program} did not start (no live process in {pid_file} after {timeout:.0f}s)")


def stop(daemon: Daemon, marker: Marker, timeout: float = 15) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; only if the PID is still ours. True if it was running."""
    if not is_ours(daemon, marker):
        return False
    _signal(daemon.pid, signal.SIGTERM)
    if not _wait_gone(daemon, marker, timeout):
        _signal(daemon.pid, signal.SIGKILL)
        _wait_gone(daemon, marker, 5)
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(daemon: Daemon, marker: Marker, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_ours(daemon, marker):
            return True
        time.sleep(0.1)
    return not is_ours(daemon, marker)


def foreign_daemons(tools: tuple[str, ...], marker: Marker) -> list[str]:
    """Running ``tools`` that were not started for this testbed (``marker`` not on their command line)."""
    programs = {*tools, *(program_of(t) for t in tools if proc.which(t))}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        info = proc_info(int(entry.name))
        if info and info.state not in ("Z", "X") and info.program in programs and not names_path(info.argv, marker):
            found.append(f"pid {entry.name}: {info.cmdline}")
    return found


# --- network -------------------------------------------------------------------------------------


def netns_exists(name: str) -> bool:
    return (Path("/run/netns") / name).exists()


def our_netns() -> list[str]:
    """Network namespaces named like the testbed's."""
    directory = Path("/run/netns")
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(NETNS_PREFIX)) if directory.is_dir() else []


def _links() -> list[str]:
    out = proc.run(["ip", "-o", "link", "show"]).stdout
    return [line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def our_links() -> list[str]:
    """The bridge and host-side veths, if present."""
    return [name for name in _links() if name == BRIDGE or name.startswith(VETH_PREFIX)]


def network_up(nodes: list[Node]) -> None:
    """A bridge at the controller address and, per node, a namespace wired to it by a veth pair."""
    prefix = NETWORK.prefixlen
    proc.run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    proc.run(["ip", "addr", "add", f"{CONTROLLER_IP}/{prefix}", "dev", BRIDGE])
    proc.run(["ip", "link", "set", BRIDGE, "up"])
    for node in nodes:
        proc.run(["ip", "netns", "add", node.netns])
        proc.run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns])
        proc.run(["ip", "link", "set", node.veth, "master", BRIDGE, "up"])
        proc.run(["ip", "-n", node.netns, "addr", "add", f"{node.ip}/{prefix}", "dev", "eth0"])
        proc.run(["ip", "-n", node.netns, "link", "set", "eth0", "up"])
        proc.run(["ip", "-n", node.netns, "link", "set", "lo", "up"])


def netns_pids(name: str) -> list[int]:
    """Processes living in a network namespace (a node's slurmd, slurmstepd and job processes)."""
    out = proc.run(["ip", "netns", "pids", name], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_netns_processes(name: str, timeout: float = 2) -> int:
    """SIGTERM, then SIGKILL, every process left in the namespace, and wait until they are gone.

    Returns how many there were. A caller that removes the namespace or starts a new testbed
    right after must not race processes that are still exiting.
    """
    pids = netns_pids(name)
    end_processes(pids, timeout)
    return len(pids)


def kill_netns_now(name: str, timeout: float = 5) -> int:
    """Stop every process in the namespace at once (SIGSTOP, again for any started meanwhile), then
    SIGKILL them all, until none is left.

    How a node is lost (power, kernel panic): nothing in it gets to clean up or say goodbye. Killed
    one by one, the node's last live processes saw the others die and acted on it within the same
    millisecond (a request from the lost node SIGKILLed the job's steps on the other nodes), which a
    node that loses power cannot do; stopped first, none of them runs again.
    Returns how many processes were killed.
    """
    deadline = time.monotonic() + timeout
    stop_netns(name, timeout)
    killed: set[int] = set()
    while pids := [pid for pid in netns_pids(name) if _alive(pid)]:
        if time.monotonic() > deadline:
            raise CtrainError(f"process(es) {', '.join(map(str, pids))} in {name} still alive after SIGKILL")
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        killed.update(pids)
        time.sleep(0.05)
    return len(killed)


def stop_netns(name: str, timeout: float = 5) -> int:
    """SIGSTOP every process in the namespace, again for any started meanwhile, until none runs: a
    node frozen (a hung kernel, a stuck hypervisor) keeps its connections open and says nothing.
    Returns how many were stopped; :func:`continue_netns` lets them run again."""
    stopped: set[int] = set()
    deadline = time.monotonic() + timeout
    while pids := [pid for pid in netns_pids(name) if pid not in stopped and _alive(pid)]:
        if time.monotonic() > deadline:
            raise CtrainError(f"process(es) {', '.join(map(str, pids))} in {name} still running after SIGSTOP")
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        stopped.update(pids)
    return len(stopped)


def continue_netns(name: str) -> int:
    """SIGCONT every process in the namespace (undoes :func:`stop_netns`); how many were stopped."""
    count = 0
    for pid in netns_pids(name):
        info = proc_info(pid)
        if info is not None and info.state == "T":
            count += 1
        _signal(pid, signal.SIGCONT)
    return count


def kill_netns_slowly(name: str, seconds: float, rng: random.Random, timeout: float = 10) -> int:
    """SIGKILL the namespace's processes one at a time, in random order, spread over ``seconds``.

    How a node often dies in practice (an out-of-memory cascade, a failing disk, a job's processes
    killed one by one): the ones left alive see the others go and act on it, in whatever order the
    deaths came. Processes started meanwhile are killed too. Returns how many were killed.
    """
    start = time.monotonic()
    killed: set[int] = set()
    while pids := sorted(pid for pid in netns_pids(name) if _alive(pid)):
        if time.monotonic() > start + seconds + timeout:
            raise CtrainError(f"process(es) {', '.join(map(str, pids))} in {name} still alive after SIGKILL")
        pid = rng.choice(pids)
        _signal(pid, signal.SIGKILL)
        killed.add(pid)
        left = start + seconds - time.monotonic()
        time.sleep(left / len(pids) if left > 0 else 0.01)
    return len(killed)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has exited)."""
    info = proc_info(pid)
    return info is not None and info.state not in ("Z", "X")


def end_processes(pids: list[int], term_timeout: float = 5, kill_timeout: float = 5) -> list[int]:
    """SIGTERM ``pids``, SIGKILL those alive after ``term_timeout``; the ones still alive after that."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    for sig, timeout in ((signal.SIGKILL, term_timeout), (None, kill_timeout)):
        deadline = time.monotonic() + timeout
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if sig is not None:
            for pid in pids:
                if _alive(pid):
                    _signal(pid, sig)
    return [pid for pid in pids if _alive(pid)]


def wait_reaped(pids: list[int], timeout: float = 10) -> list[int]:
    """Wait until ``pids`` are gone from /proc, zombies included; the ones still listed after ``timeout``.

    An exited daemon stays a zombie until init reaps it, which some inits do only every few
    seconds: until then ``ps`` and ``pgrep`` still show it, and a script that runs ``down`` then
    ``up`` would see the old testbed's processes.
    """
    deadline = time.monotonic() + timeout
    while True:
        listed = [pid for pid in pids if Path("/proc", str(pid)).exists()]
        if not listed or time.monotonic() > deadline:
            return listed
        time.sleep(0.05)


def marked_processes(tools: tuple[str, ...], marker: Marker) -> list[int]:
    """Live processes of ``tools`` whose command line names ``marker`` (the testbed's daemon paths)."""
    programs = {*tools, *(program_of(t) for t in tools if proc.which(t))}
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            info = proc_info(int(entry.name))
            if info and info.state not in ("Z", "X") and info.program in programs and names_path(info.argv, marker):
                found.append(int(entry.name))
    return found


def network_down(claim: NetworkClaim) -> list[str]:
    """Remove the namespaces, veths and bridge of CLAIM (those one testbed made; another's are left);
    returns what was removed."""
    removed = []
    for name in claim.netns_of(our_netns()):
        proc.run(["ip", "netns", "delete", name])
        removed.append(f"netns {name}")
    for name in claim.links_of(our_links()):
        proc.run(["ip", "link", "delete", name], check=False)
        removed.append(f"link {name}")
    return removed


# --- files and users -------------------------------------------------------------------------------


def write_in_place(path: Path, text: str) -> None:
    """Rewrite a file keeping its inode (/etc/hosts is often a bind mount that rename would break)."""
    with path.open("r+") as handle:
        handle.seek(0)
        handle.write(text)
        handle.truncate()


def remove_user(name: str) -> bool:
    """Remove the user, its home and its processes' leftovers; False when there was no such user."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    proc.run(["userdel", "--remove", name], check=False)
    try:
        pwd.getpwnam(name)
    except KeyError:
        return True
    raise CtrainError(f"could not remove user {name}: run `userdel --remove {name}` as root to see why")


def ensure_user(name: str) -> pwd.struct_passwd:
    """The job user, created (with a home directory) if missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    made = proc.run(["useradd", "--create-home", "--shell", "/bin/bash", "--comment", "ctrain testbed job user", name],
                    check=False)  # fmt: skip
    try:
        return pwd.getpwnam(name)  # made here, or by another process at the same moment
    except KeyError:
        raise CtrainError(f"could not create the user {name}: {made.stderr.strip()}") from None


def unreachable_dirs(path: Path) -> list[Path]:
    """Directories on the way to ``path`` that other users cannot enter (no o+x)."""
    blocked = []
    for directory in [*reversed(path.parents), path]:
        try:
            mode = directory.stat().st_mode
        except FileNotFoundError:
            continue
        if not mode & stat.S_IXOTH:
            blocked.append(directory)
    return blocked


def world_readable(path: Path) -> bool:
    """Whether any user can read ``path`` (readable file, every directory on the way enterable)."""
    try:
        return bool(path.stat().st_mode & stat.S_IROTH) and not unreachable_dirs(path.parent)
    except FileNotFoundError:
        return False


def fuse_needs_opening() -> bool:
    """Whether /dev/fuse exists but unprivileged users cannot open it (Apptainer needs it to mount SIFs)."""
    try:
        mode = FUSE_DEVICE.stat().st_mode
    except FileNotFoundError:
        return False
    return mode & 0o666 != 0o666


def open_fuse() -> None:
    FUSE_DEVICE.chmod(0o666)


# --- faults of a node's own: a full local disk, a slow CPU -----------------------------------------

CPU_CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_PREFIX = "ctrain-testbed-"


def mount_tmpfs(path: Path, mib: int, owner: str) -> None:
    """A small file system of MIB MiB at PATH, owned by OWNER: a node's local disk that can fill up."""
    path.mkdir(parents=True, exist_ok=True)
    proc.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(path)])
    user = pwd.getpwnam(owner)
    os.chown(path, user.pw_uid, user.pw_gid)


def unmount_all_below(root: Path) -> list[Path]:
    """Unmount every file system mounted at or below ROOT (deepest first); returns what was unmounted."""
    mounts = []
    prefix = str(root).rstrip("/") + "/"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ") if len(line.split()) > 1 else ""
        if target == str(root) or target.startswith(prefix):
            mounts.append(Path(target))
    for target in sorted(mounts, key=lambda p: len(p.parts), reverse=True):
        proc.run(["umount", "-l", str(target)], check=False)
    return mounts


def _cpu_cgroup(netns: str) -> Path:
    if not CPU_CGROUP_V1.is_dir():
        raise CtrainError(f"{CPU_CGROUP_V1} is not mounted (a cgroup v1 cpu controller): the testbed cannot slow a node")
    return CPU_CGROUP_V1 / f"{CGROUP_PREFIX}{netns}"


THROTTLE_PERIOD_US = 10_000  # cgroup v1 CPU period of a slowed node (its quota's unit of time)


def throttle_netns(netns: str, percent: int) -> int:
    """Every process of a node (its network namespace: slurmd and what it starts later, which inherits
    the group) limited to PERCENT of one CPU: a node that computes slowly. Returns how many moved."""
    group = _cpu_cgroup(netns)
    group.mkdir(exist_ok=True)
    # A short period spreads the quota evenly: with the default 100 ms a process may run at full speed
    # for PERCENT ms before it is held, so a measurement of a few hundred ms sees far more than PERCENT.
    (group / "cpu.cfs_quota_us").write_text("-1")  # the period may only shrink under an unlimited quota
    (group / "cpu.cfs_period_us").write_text(str(THROTTLE_PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text(str(max(1000, THROTTLE_PERIOD_US * percent // 100)))
    moved = 0
    for pid in netns_pids(netns):
        try:
            (group / "cgroup.procs").write_text(str(pid))
            moved += 1
        except OSError:  # gone meanwhile
            pass
    return moved


def unthrottle_netns(netns: str) -> bool:
    """Undo :func:`throttle_netns`: the node's processes back in the root group, the group removed."""
    group = _cpu_cgroup(netns) if CPU_CGROUP_V1.is_dir() else None
    if group is None or not group.is_dir():
        return False
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (CPU_CGROUP_V1 / "cgroup.procs").write_text(pid)
        except OSError:
            pass
    for _ in range(50):
        try:
            group.rmdir()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def throttled_netns() -> list[str]:
    """The namespaces :func:`throttle_netns` slowed and nothing undid."""
    if not CPU_CGROUP_V1.is_dir():
        return []
    return [p.name.removeprefix(CGROUP_PREFIX) for p in CPU_CGROUP_V1.glob(f"{CGROUP_PREFIX}*") if p.is_dir()]


def link_is_up(link: str) -> bool:
    """Whether LINK (a node's host-side veth) is administratively up."""
    out = proc.run(["ip", "-o", "link", "show", "dev", link], check=False).stdout
    flags = out.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in out else []
    return "UP" in flags


def set_link(link: str, up: bool) -> bool:
    """LINK up or down; whether that changed anything. Down, nothing passes the link either way and
    no connection through it is closed: the far side only stops hearing back (no FIN, no RST)."""
    if link_is_up(link) == up:
        return False
    proc.run(["ip", "link", "set", "dev", link, "up" if up else "down"])
    return True
