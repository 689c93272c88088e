"""A cluster driven from a laptop over SSH: cluster profiles, and the runner that takes ctrain's
Slurm client (:mod:`ctrain.slurm`) to the login node.

Profiles live in a user-level file (``~/.config/ctrain/clusters.yaml``, or ``$CTRAIN_CLUSTERS``),
not in the project: host names, user names and keys are the user's, and a project stays
shareable. One SSH connection is opened per profile and reused (ControlMaster), so a command
costs one round trip; ssh never prompts (BatchMode), and what it says when it cannot connect is
turned into an error that names the cause and the fix.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shlex
import stat
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import yaml

from ctrain import install_hint, proc
from ctrain.errors import CommandError, ConfigError, CtrainError
from ctrain.files import atomic_write_json, atomic_write_text, control_problem, load_json_bounded, shorten
from ctrain.settings import SettingsFile, build, read_settings, to_mapping

PROFILES_ENV = "CTRAIN_CLUSTERS"
CONNECT_TIMEOUT = 10  # seconds ssh waits for the host to answer
CONTROL_PERSIST = 300  # seconds the shared connection stays open after the last command
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Profile:
    """One cluster as reached from here."""

    #: Login node: a host name, an address, or any Host of ~/.ssh/config (ProxyJump included).
    host: str = ""
    #: User on the cluster (default: ssh's, i.e. ~/.ssh/config's or the local user).
    user: str | None = None
    #: SSH port (default: ssh's).
    port: int | None = None
    #: Private key to use, and only it (default: ssh's keys and agent).
    identity_file: Path | None = None
    #: More ssh arguments, e.g. [-o, ProxyJump=bastion].
    ssh_options: list[str] = field(default_factory=list)
    #: The project's directory on the cluster's shared filesystem: jobs are submitted from there.
    project_dir: str = ""
    #: Where `ctrain push` puts images on the cluster (default: PROJECT_DIR/images).
    images_dir: str = ""
    #: The container runtime of the cluster.
    runtime: Literal["apptainer", "pyxis"] = "apptainer"
    #: ctrain on the cluster: a command on the login shell's PATH, or a path (e.g. a venv's bin/ctrain).
    ctrain: str = "ctrain"

    def check(self, where: str) -> None:
        """Each setting that ssh or the remote shell could misread; ``where`` names the profile."""
        if not self.host:
            raise ConfigError(f"'{where}.host' is not set: the login node, e.g. login.cluster.example.org",
                              key=f"{where}.host")  # fmt: skip
        if self.host.startswith("-") or any(c.isspace() for c in self.host):
            raise ConfigError(f"'{where}.host' is {self.host!r}: a host name, address or ~/.ssh/config Host",
                              key=f"{where}.host")  # fmt: skip
        if self.user is not None and (self.user.startswith("-") or "@" in self.user or not self.user.strip()):
            raise ConfigError(f"'{where}.user' is {self.user!r}: a user name on the cluster", key=f"{where}.user")
        if self.port is not None and not 0 < self.port < 65536:
            raise ConfigError(f"'{where}.port' is {self.port}: a TCP port (1-65535)", key=f"{where}.port")
        if not self.ctrain or self.ctrain.startswith("-"):
            raise ConfigError(f"'{where}.ctrain' is {self.ctrain!r}: a command or a path", key=f"{where}.ctrain")
        for directory, key in ((self.project_dir, "project_dir"), (self.images_dir, "images_dir")):
            problem = _remote_dir_problem(directory) if directory else None
            if problem:
                raise ConfigError(f"'{where}.{key}' is {directory!r}: {problem}", key=f"{where}.{key}")


def _remote_dir_problem(directory: str) -> str | None:
    """Why ``directory`` cannot name a directory on the cluster, else None: an absolute path, or ``~/PATH``."""
    if control := control_problem(directory):
        return f"it {control}: name a directory on the cluster"
    if directory.startswith("~") and directory != "~" and not directory.startswith("~/"):
        return ("~NAME means another user's home, which ctrain does not look up: write the absolute path, or "
                "~/PATH for a directory under your home on the cluster")  # fmt: skip
    if not directory.startswith(("/", "~")):
        return "give an absolute path on the cluster, or ~/PATH for a directory under your home there"
    return None


def on_cluster(directory: str) -> str:
    """``directory`` as ssh and rsync take it: ``~/PATH`` (and ``~``) becomes PATH relative to the login
    directory, which is where both start on the cluster; quoted, a ``~`` would be a directory named ``~``.
    Absolute paths stay as they are."""
    if directory != "~" and not directory.startswith("~/"):
        return directory
    rest = directory[1:].lstrip("/")
    return "." if not rest else f"./{rest}" if rest.startswith("-") else rest


_HOME_COMMAND = re.compile(r"~([A-Za-z_][A-Za-z0-9._-]*)?/(.*)", re.DOTALL)


def ctrain_command(cluster: Cluster, args: Sequence[str]) -> str:
    """The remote shell's command line that runs the profile's ``ctrain`` with ARGS, each quoted.

    A leading ``~/`` (or ``~USER/``) in ``ctrain`` is a home on the cluster, as in a login shell: it is left
    unquoted (``"$HOME"/`` + the quoted rest), since :func:`shlex.join` would quote the ``~`` and the remote
    shell would look for a directory named ``~``. Every command that runs the cluster's ctrain is built here."""
    command = cluster.profile.ctrain
    home = _HOME_COMMAND.fullmatch(command)
    if home is None:
        head = shlex.quote(command)
    else:
        user, rest = home.groups()
        head = (f"~{user}/" if user else '"$HOME"/') + (shlex.quote(rest) if rest else "")
    return " ".join([head, *(shlex.quote(arg) for arg in args)])


def shown(directory: str) -> str:
    """A directory on the cluster as the user writes it: ``~/PATH`` for one relative to the login directory."""
    if directory.startswith("/"):
        return directory
    rest = directory.removeprefix("./").lstrip("/") if directory != "." else ""
    return f"~/{rest}" if rest else "~"


@dataclass(frozen=True)
class Profiles:
    """The clusters file: ``default`` (a name) and ``clusters`` (name -> profile)."""

    #: The cluster that commands use when no --cluster is given; none: this machine.
    default: str | None = None
    clusters: dict[str, Profile] = field(default_factory=dict)

    def validate(self) -> None:
        for name, profile in self.clusters.items():
            if not _NAME.fullmatch(name):
                raise ConfigError(f"cluster name {name!r}: use letters, digits, '.', '_' and '-'", key="clusters")
            profile.check(f"clusters.{name}")
        if self.default is not None and self.default not in self.clusters:
            raise ConfigError(
                f"'default' is {self.default!r}, which is not one of the clusters "
                f"({', '.join(self.clusters) or 'none'})",
                key="default",
            )


def profiles_path() -> Path:
    """``$CTRAIN_CLUSTERS``, else ``$XDG_CONFIG_HOME/ctrain/clusters.yaml`` (``~/.config`` by default)."""
    if os.environ.get(PROFILES_ENV):
        return Path(os.environ[PROFILES_ENV]).expanduser()
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "ctrain" / "clusters.yaml"


def load_profiles(path: Path | None = None) -> Profiles:
    """The clusters file, validated; an empty set when there is none."""
    path = path or profiles_path()
    if not path.exists():
        return Profiles()
    return build(Profiles, read_settings(path))


@dataclass(frozen=True)
class Cluster:
    """A named profile, resolved."""

    name: str
    profile: Profile

    def __post_init__(self) -> None:
        # The directories as every command sends them (on_cluster): one meaning of ~/ for all of them.
        p = self.profile
        dirs = {"project_dir": on_cluster(p.project_dir), "images_dir": on_cluster(p.images_dir)}
        object.__setattr__(self, "profile", replace(p, **dirs))

    @property
    def images_dir(self) -> str:
        return self.profile.images_dir or f"{self.profile.project_dir.rstrip('/')}/images"

    @property
    def target(self) -> str:
        """``[USER@]HOST[:PORT]``, for messages."""
        p = self.profile
        return f"{p.user + '@' if p.user else ''}{p.host}{':' + str(p.port) if p.port else ''}"


def resolve(name: str | None, path: Path | None = None) -> Cluster | None:
    """The cluster ``--cluster NAME`` names, else the file's default; None: Slurm on this machine."""
    found = load_profiles(path)
    where = path or profiles_path()
    name = name or found.default
    if name is None:
        return None
    if name not in found.clusters:
        known = ", ".join(sorted(found.clusters)) or "none yet"
        raise ConfigError(
            f"no cluster named {name!r} in {where} (clusters: {known}); add one under `clusters:` "
            f"(host, user, project_dir), see docs/remote.md"
        )
    return Cluster(name, found.clusters[name])


# --- the runner -----------------------------------------------------------------------------------


# The longest directory for the sockets: a socket path holds about 100 bytes, and ssh adds '/', the
# connection's 40-character hash (%C) and, while it connects, a 17-character suffix.
_CONTROL_DIR_MAX = 40


def _control_dir() -> Path:
    """Where the shared connections' sockets live: short (sockets have a ~100-byte path limit), private.

    In $XDG_RUNTIME_DIR where that is a directory of this user's with room for the name, else in /tmp
    (not $TMPDIR: on macOS it alone is too long): a session whose runtime directory is gone (su, sudo,
    a container) still connects."""
    name = f"ctrain-ssh-{os.getuid()}"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or ""
    base = Path("/tmp")
    if runtime.startswith("/") and len(runtime) + len(name) < _CONTROL_DIR_MAX:
        with contextlib.suppress(OSError):
            info = os.stat(runtime)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
                base = Path(runtime)
    directory = base / name
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise CtrainError(f"cannot create {directory} for ssh's shared connections ({exc.strerror}): make {base} "
                          "writable, or point XDG_RUNTIME_DIR at a directory of yours") from None  # fmt: skip
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise CtrainError(f"{directory} is not private to you: remove it, ctrain makes it again")
    return directory


# What ssh says (exit 255) when it did not get to run the command, and what the user can do.
_SSH_PROBLEMS = (
    # Before "could not resolve": ssh says both when no name server answers (no network, a VPN down).
    (re.compile(r"Temporary failure in name resolution|No address associated with hostname"),
     "cannot look up {host!r}: no name server answers (no network here, or a VPN that is down?); connect, "
     "then try again"),
    (re.compile(r"Could not resolve hostname|Name or service not known|nodename nor servname"),
     "host {host!r} is unknown (neither DNS nor ~/.ssh/config knows it): check `host` in {file}"),
    (re.compile(r"Connection refused"),
     "{target} refused the connection (no sshd on that port): check `host` and `port` in {file}"),
    (re.compile(r"timed out|No route to host|Network is unreachable|Connection closed by|Connection reset"),
     "{target} does not answer (down, or a VPN/bastion is needed: ProxyJump in ~/.ssh/config or ssh_options)"),
    (re.compile(r"Permission denied"),
     "{target} refused the login for {user}: ssh tried {keys}; put the public key in ~/.ssh/authorized_keys "
     "there, or set `identity_file` in {file} (ctrain never asks for a password)"),
    (re.compile(r"Host key verification failed|REMOTE HOST IDENTIFICATION HAS CHANGED"),
     "the host key of {target} is unknown or has changed: run `ssh {target}` once, check the fingerprint "
     "and accept it"),
)  # fmt: skip


@dataclass(frozen=True)
class Ssh:
    """A :class:`ctrain.slurm.Runner` on a cluster's login node: each command is one ``ssh`` over the
    profile's shared connection, its arguments quoted for the remote shell."""

    cluster: Cluster
    control_dir: Path = field(default_factory=_control_dir)

    @property
    def target(self) -> str:
        return self.cluster.target

    def ssh_args(self) -> list[str]:
        """``ssh`` and its options, without the host and command (also rsync's ``-e``)."""
        p = self.cluster.profile
        args = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}",
                "-o", "ControlMaster=auto", "-o", f"ControlPath={self.control_dir}/%C",
                "-o", f"ControlPersist={CONTROL_PERSIST}"]  # fmt: skip
        if p.port:
            args += ["-p", str(p.port)]
        if p.user:
            args += ["-l", p.user]
        if p.identity_file:
            args += ["-i", str(p.identity_file), "-o", "IdentitiesOnly=yes"]
        return [*args, *p.ssh_options]

    def argv(self, command: str) -> list[str]:
        return [*self.ssh_args(), self.cluster.profile.host, "--", command]

    def _problem(self, stderr: str) -> CtrainError:
        p = self.cluster.profile
        keys = str(p.identity_file) if p.identity_file else "your default keys and agent"
        for pattern, message in _SSH_PROBLEMS:
            if pattern.search(stderr):
                text = message.format(host=p.host, target=self.target, user=p.user or "you", keys=keys,
                                      file=profiles_path())  # fmt: skip
                return CtrainError(f"cluster {self.cluster.name}: {text}")
        said = (stderr.strip().splitlines() or ["no message"])[-1]
        return CtrainError(f"cluster {self.cluster.name}: ssh to {self.target} failed: {said}")

    def run(
        self,
        args: Sequence[str],
        *,
        check: bool = True,
        input: str | None = None,
        cwd: Path | None = None,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        command = shlex.join(list(args))
        if cwd is not None:
            command = f"cd {shlex.quote(str(cwd))} && {command}"
        out = proc.run(self.argv(command), check=False, input=input, timeout=timeout)
        self._raise_for_connection(out.returncode, out.stderr)
        if out.returncode == 127 and "not found" in out.stderr:
            raise CtrainError(
                f"cluster {self.cluster.name}: {self.target} has no `{args[0]}`: is it the cluster's login "
                f"node (Slurm's commands on its PATH, e.g. after `module load slurm`)?"
            )
        if check and out.returncode != 0:
            raise CommandError(["ssh", self.target, *args], out.returncode, out.stderr, out.stdout)
        return out

    def _raise_for_connection(self, returncode: int, stderr: str) -> None:
        """ssh's own failures (exit 255 and ssh's words); a remote command's exit 255 passes."""
        if returncode != 255:
            return
        if stderr.lstrip().startswith("ssh:") or any(pattern.search(stderr) for pattern, _ in _SSH_PROBLEMS):
            raise self._problem(stderr)

    def glob(self, directory: Path, pattern: str) -> list[Path]:
        script = 'for f in "$1"/$2; do [ -e "$f" ] && printf "%s\\n" "$f"; done; exit 0'
        out = self.run(["sh", "-c", script, "sh", str(directory), pattern], check=False)
        return sorted(Path(line) for line in out.stdout.splitlines() if line)

    def has(self, tool: str) -> bool:
        return self.run(["sh", "-c", 'command -v "$1" >/dev/null', "sh", tool], check=False).returncode == 0

    def read(self, path: Path, offset: int = 0) -> bytes | None:
        start = f"+{offset + 1}" if offset >= 0 else str(-offset)
        command = shlex.join(["tail", "-c", start, "--", str(path)])
        out = proc.run(self.argv(command), check=False, binary=True)
        stderr = out.stderr.decode(errors="replace")
        self._raise_for_connection(out.returncode, stderr)
        return out.stdout if out.returncode == 0 else None

    def close(self) -> None:
        """End the shared connection now (it would end by itself after CONTROL_PERSIST seconds)."""
        proc.run([*self.ssh_args(), "-O", "exit", self.cluster.profile.host], check=False)


# --- the trip: project files and ctrain on the cluster ----------------------------------------------

# Names of files and directories that hold credentials: never sent to a cluster.
SECRET_NAMES = (
    ".env", ".env.*", "*.pem", "*.key", "id_rsa*", "id_ed25519*", ".netrc", ".git-credentials", "credentials",
    ".ssh", ".aws", ".docker",
)  # fmt: skip
# Never sent: what the cluster makes or already has (outputs, logs, images, environments), version
# control, and anything that looks like a secret. The project's .gitignore is honoured too.
SYNC_EXCLUDES = (
    ".git/", ".venv/", "venv/", "__pycache__/", ".ctrain/", "outputs/", "logs/", "images/", "*.sif", "*.sqsh",
    *SECRET_NAMES,
)  # fmt: skip
_VERSION = re.compile(r"^ctrain, version (\S+)$", re.MULTILINE)


def check_ctrain(ssh: Ssh, version: str) -> None:
    """The cluster's ctrain (the profile's ``ctrain`` command) answers and is this version."""
    command = ssh.cluster.profile.ctrain
    out = proc.run(ssh.argv(ctrain_command(ssh.cluster, ["--version"])), check=False)
    ssh._raise_for_connection(out.returncode, out.stderr)
    found = _VERSION.search(out.stdout)
    if out.returncode == 127 or (out.returncode != 0 and not found):
        raise CtrainError(
            f"cluster {ssh.cluster.name}: `{command}` does not run on {ssh.target} "
            f"({(out.stderr.strip().splitlines() or ['no output'])[-1]}): install it there "
            f"({install_hint(version=version, tool='pipx')}), or set `ctrain:` in {profiles_path()} to its path"
        )
    if not found:
        raise CtrainError(f"cluster {ssh.cluster.name}: `{command} --version` printed {out.stdout.strip()!r}")
    if found.group(1) != version:
        raise CtrainError(
            f"cluster {ssh.cluster.name} runs ctrain {found.group(1)}, this is {version}: install the same "
            f"version on both ({install_hint(version=version, tool='pipx')} there, or "
            f"{install_hint(version=found.group(1), tool='pipx')} here)"
        )


def project_dir(cluster: Cluster) -> str:
    """The profile's ``project_dir``; a ConfigError that says where to set it when there is none
    (asked before connecting: a missing setting is not worth an SSH connection)."""
    directory = cluster.profile.project_dir
    if not directory:
        raise ConfigError(f"cluster {cluster.name}: set `project_dir` in {profiles_path()} (the project's "
                          "directory on the cluster's shared filesystem)")  # fmt: skip
    return directory


def _project_dir(ssh: Ssh) -> str:
    return project_dir(ssh.cluster)


def sync_project(ssh: Ssh, root: Path, *, emit: Callable[[str], None]) -> None:
    """Send the project's files to PROJECT_DIR with rsync over the shared connection: only what
    changed, never outputs, logs, images or secrets (:data:`SYNC_EXCLUDES`, and .gitignore);
    nothing on the cluster is deleted."""
    directory = _project_dir(ssh)
    ssh.run(["mkdir", "-p", "--", directory])
    filters = [f"--exclude={pattern}" for pattern in SYNC_EXCLUDES]
    if (root / ".gitignore").is_file():
        filters.append("--filter=:- .gitignore")
    sent = _rsync(ssh, [*filters, f"{root}/"], f"{directory}/")
    emit(f"cluster {ssh.cluster.name}: {len(sent)} project file(s) sent to {shown(directory)}" + (
        f" ({', '.join(sent[:5])}{', ...' if len(sent) > 5 else ''})" if sent else " (all up to date)"))


def connect(cluster: Cluster, version: str) -> Ssh:
    """The connection a command run on the cluster goes through: its project directory is set (asked
    before connecting) and its ctrain answers, of this ``version``."""
    project_dir(cluster)
    ssh = Ssh(cluster)
    check_ctrain(ssh, version)
    return ssh


def run_in_project(ssh: Ssh, root: Path, args: Sequence[str], *, emit: Callable[[str], None],
                   on_line: Callable[[str], None]) -> int:  # fmt: skip
    """``ctrain ARGS`` on the cluster's login node in the project's directory there, after sending the
    project's files (:func:`sync_project`); its exit code, its lines to ``on_line``."""
    cluster = ssh.cluster
    sync_project(ssh, root, emit=emit)
    emit(f"cluster {cluster.name}: {' '.join([cluster.profile.ctrain, *args])} (in {shown(cluster.profile.project_dir)})")
    command = f"cd {shlex.quote(cluster.profile.project_dir)} && {ctrain_command(cluster, args)}"
    return proc.stream(ssh.argv(command), check=False, on_line=on_line)


# Recipe keys that may name a file or directory on this machine.
RECIPE_PATH_KEYS = ("data.source", "model.path", "tokenizer.path", "training.deepspeed")


def unsent_paths(recipe_file: Path, overrides: Sequence[str], root: Path) -> dict[str, str]:
    """{key: value as written} for the paths the recipe names that exist here but outside the project
    directory, which :func:`sync_project` does not send. A recipe that does not load gives none: the
    cluster's ctrain checks it and says what is wrong."""
    from ctrain.train.recipe import expand_path, load_recipe

    try:
        recipe = load_recipe(recipe_file, list(overrides))
    except (ConfigError, OSError):
        return {}
    found = {}
    for key in RECIPE_PATH_KEYS:
        section, name = key.split(".")
        raw = getattr(getattr(recipe, section), name)
        if not raw or str(raw).startswith("builtin:") or any(c in str(raw) for c in "*?["):
            continue
        local = expand_path(raw)
        local = local if local.is_absolute() else root / local
        if local.exists() and not local.resolve().is_relative_to(root.resolve()):
            found[key] = str(raw)
    return found


def send_unsent_paths(ssh: Ssh, paths: dict[str, str], root: Path, *, emit: Callable[[str], None]) -> list[str]:
    """Send each path of :func:`unsent_paths` that the cluster lacks to PROJECT_DIR/inputs/SECTION/NAME
    (rsync: only what changed) and return the overrides (``data.source=inputs/data/train.jsonl``) that
    point the job there. A path the cluster has (the same absolute path on a shared filesystem, or the
    relative one from PROJECT_DIR) is left as it is; one that looks like a secret is refused."""
    from ctrain.train.recipe import expand_path

    if not paths:
        return []
    directory = _project_dir(ssh)
    found = {}
    for key, raw in paths.items():  # all refused before any is sent
        local = expand_path(raw)
        found[key] = local = (local if local.is_absolute() else root / local).resolve()
        if any(fnmatch.fnmatch(part, name) for part in local.parts for name in SECRET_NAMES):
            raise ConfigError(f"{key} {raw} is where credentials are kept ({', '.join(SECRET_NAMES)}): it is not "
                              "sent to the cluster; name another path")  # fmt: skip
    overrides = []
    for key, raw in paths.items():
        local = found[key]
        if raw.startswith("$") or (raw.startswith("~") and not raw.startswith("~/")):
            continue  # the cluster's environment or users decide what it names: its ctrain checks it there
        there = raw if raw.startswith(("/", "~")) else f"{directory}/{raw}"
        probe = ["sh", "-c", 'test -e "$HOME/$1"', "sh", there[2:]] if there.startswith("~/") else ["test", "-e", there]
        if ssh.run(probe, check=False).returncode == 0:
            continue
        section = key.split(".")[0]
        target = f"inputs/{section}/{local.name}"
        ssh.run(["mkdir", "-p", "--", f"{directory}/inputs/{section}"])
        slash = "/" if local.is_dir() else ""
        sent = _rsync(ssh, [f"{local}{slash}"], f"{directory}/{target}{slash}")
        emit(f"cluster {ssh.cluster.name}: {key} {raw} is outside the project: sent to {shown(directory)}/{target} "
             f"({len(sent)} file(s) changed); the job reads it there ({key}={target})")  # fmt: skip
        overrides.append(f"{key}={target}")
    return overrides


def _rsync(ssh: Ssh, sources: list[str], destination: str) -> list[str]:
    """rsync SOURCES to DESTINATION on the cluster over the shared connection; the files it sent.

    The remote path reaches the cluster's rsync as an argument (--protect-args, :data:`proc.RSYNC_ENV`)."""
    out = _run_rsync(ssh, ["--recursive", "--links", "--times", "--perms", "--chmod=Dg+rx,Fg+r", *sources,
                           f"{ssh.cluster.profile.host}:{destination}"])  # fmt: skip
    return _transferred(out.stdout, "<f")


def _run_rsync(ssh: Ssh, args: list[str], *, missing_source_ok: bool = False) -> subprocess.CompletedProcess[str]:
    """rsync ARGS over the shared connection, its changes itemized; ssh's failures named, rsync's a
    CommandError (with MISSING_SOURCE_OK, a source directory that is not there is no failure)."""
    rsync = ["rsync", "--protect-args", "--itemize-changes", "-e", shlex.join(ssh.ssh_args()), *args]
    out = proc.run(rsync, check=False, env=proc.RSYNC_ENV)
    ssh._raise_for_connection(out.returncode, out.stderr)
    missing = out.returncode == 23 and "change_dir" in out.stderr and "No such file or directory" in out.stderr
    if out.returncode != 0 and not (missing_source_ok and missing):
        raise CommandError(rsync, out.returncode, out.stderr, out.stdout)
    return out


def _transferred(itemized: str, prefix: str) -> list[str]:
    """The files rsync's itemized changes say it sent (``<f``) or received (``>f``)."""
    return [line.split(maxsplit=1)[1] for line in itemized.splitlines() if line.startswith(prefix)]


def fetch_from(ssh: Ssh, directory: str, local: Path, includes: Sequence[str]) -> list[str]:
    """Copy what ``includes`` (rsync patterns, anchored at DIRECTORY) match in DIRECTORY on the cluster
    into LOCAL, nothing else: the cluster's files it brought (a second call brings only what changed;
    a file cut off mid-way is kept in part and finished next time). A DIRECTORY that is not there
    brings nothing."""
    if control_problem(directory) or not directory.startswith(("/", "~")):
        raise CtrainError(f"cluster {ssh.cluster.name}: {shorten(directory)!r} is not a directory to copy from")
    local.mkdir(parents=True, exist_ok=True)
    filters = [*(f"--include={pattern}" for pattern in includes), "--exclude=*"]
    out = _run_rsync(ssh, ["--recursive", "--times", "--partial", "--partial-dir=.ctrain-partial", "--prune-empty-dirs",
                           *filters, f"{ssh.cluster.profile.host}:{on_cluster(directory.rstrip('/'))}/", f"{local}/"],
                     missing_source_ok=True)  # fmt: skip
    return _transferred(out.stdout, ">f")


# --- which cluster a job went to ------------------------------------------------------------------------


def jobs_path() -> Path:
    """Jobs submitted from here to clusters: ``$XDG_STATE_HOME/ctrain/jobs.json`` (~/.local/state)."""
    state_home = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state_home / "ctrain" / "jobs.json"


# jobs.json holds the newest 1000 jobs: a few tens of KiB.
MAX_JOBS_BYTES = 4 * 2**20


def _submitted() -> dict[str, list[str]]:
    """What :func:`record_job` kept; none when the file is missing or is not one it wrote (bounded: a
    FIFO or a device there is refused, never read)."""
    if not os.path.lexists(jobs_path()):
        return {}
    try:
        data = load_json_bounded(jobs_path(), MAX_JOBS_BYTES, "the submitted jobs file")
    except CtrainError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): [str(c) for c in v] for k, v in data.items() if isinstance(v, list)}


def record_job(cluster: str, job_id: str) -> None:
    """Remember that ``job_id`` was submitted to ``cluster`` from here (the newest 1000 jobs)."""
    submitted = _submitted()
    submitted[job_id] = sorted({*submitted.get(job_id, []), cluster})
    kept = dict(list(submitted.items())[-1000:])
    jobs_path().parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(jobs_path(), kept)


def elsewhere(job_id: str, cluster: str | None) -> str:
    """A hint when a job that ``cluster`` (None: this machine) does not know was submitted from here
    to another cluster; else ""."""
    others = [c for c in _submitted().get(job_id.split(".")[0], []) if c != cluster]
    if not others:
        return ""
    return f"; job {job_id} was submitted from here to cluster {others[0]}: add --cluster {others[0]}"


def save_profile(name: str, profile: Profile, path: Path | None = None) -> Path:
    """Add or replace cluster ``name`` in the clusters file (made if missing); returns the file.

    The file is written back as plain YAML: comments in it are not kept."""
    path = path or profiles_path()
    data: dict[str, object] = dict(read_settings(path).data) if path.exists() else {}
    clusters = dict(data.get("clusters") or {})  # type: ignore[call-overload]
    clusters[name] = {k: (str(v) if isinstance(v, Path) else v) for k, v in to_mapping(profile).items()
                      if v not in (None, [], "") and v != getattr(Profile(), k)}  # fmt: skip
    data["clusters"] = clusters
    check = build(Profiles, SettingsFile(path, data))  # what is written must load
    assert name in check.clusters
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))
    return path
