"""Driving the ``pcluster`` CLI: ``up``, ``status``, ``ssh``, ``down`` and ``validate --aws``.

pcluster prints one JSON document per command (the ParallelCluster API's response, camelCase keys)
and exits 0 on success, 1 on any error with ``{"message": ...}``. A dry run that would succeed also
exits 1, with :data:`DRYRUN_OK` as its message. ctrain reads only the fields it needs and raises
:class:`ParseError` with the raw text when a reply does not have the documented shape.

Before any command that reaches AWS, :func:`require_aws` checks locally that pcluster is installed
and that the AWS SDK finds credentials, so a missing piece is a clear message with the fix.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ctrain import proc, ui
from ctrain.cluster import checks
from ctrain.cluster import setup as cluster_setup
from ctrain.cluster.checks import InvalidConfig, Problem
from ctrain.errors import CommandError, ConfigError, CtrainError, ParseError

AWS_HELPER = Path(__file__).with_name("_aws_helper.py")
DRYRUN_OK = "Request would have succeeded, but DryRun flag is set."
NOT_FOUND = "does not exist"  # in pcluster's message for a cluster it cannot find
PCLUSTER_LOG = "~/.parallelcluster/pcluster-cli.log"
# pcluster create-cluster synthesises CloudFormation with the CDK first (Node.js): allow it time.
CALL_TIMEOUT = 900
HEARTBEAT = 300.0  # seconds between progress lines while nothing changes

Say = Callable[[str], None]


class MissingCredentials(CtrainError):
    """The AWS SDK finds no credentials; the message says how to provide them."""

    exit_code = 3


@dataclass(frozen=True)
class Reply:
    """One pcluster command's exit code and JSON reply."""

    command: str
    code: int
    data: dict[str, Any]
    raw: str

    @property
    def message(self) -> str:
        return str(self.data.get("message", ""))

    def get(self, *keys: str, kind: type | tuple[type, ...] = str) -> Any:
        """``data[k1][k2]...`` of type ``kind``, or :class:`ParseError` with the raw reply."""
        node: Any = self.data
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                raise ParseError(f"`pcluster {self.command}` output (no {'.'.join(keys)})", self.raw)
            node = node[key]
        if not isinstance(node, kind):
            raise ParseError(f"`pcluster {self.command}` output ({'.'.join(keys)} is not {kind})", self.raw)
        return node

    def failed(self) -> CtrainError:
        return CtrainError(f"pcluster {self.command} failed: {self.message or self.raw}")


def call(command: str, *args: str, region: str) -> Reply:
    """Run ``pcluster COMMAND ARGS --region REGION`` and parse its JSON reply."""
    argv = [cluster_setup.pcluster_bin(), command, *args, "--region", region]
    out = proc.run(argv, check=False, timeout=CALL_TIMEOUT)
    text = out.stdout.strip()
    if not text and out.returncode != 0:
        raise CommandError(argv, out.returncode, out.stderr or f"no output; pcluster's log is {PCLUSTER_LOG}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise ParseError(f"`pcluster {command}` output", out.stdout + out.stderr) from None
    if not isinstance(data, dict):
        raise ParseError(f"`pcluster {command}` output (not a JSON object)", text)
    return Reply(command, out.returncode, data, text)


def _helper(*args: str) -> dict[str, Any]:
    out = proc.run(cluster_setup.helper(AWS_HELPER, *args), check=False, timeout=CALL_TIMEOUT)
    try:
        reply = json.loads(out.stdout)
    except json.JSONDecodeError:
        raise ParseError(f"`_aws_helper.py {args[0]}` output", out.stdout + out.stderr) from None
    if not isinstance(reply, dict):
        raise ParseError(f"`_aws_helper.py {args[0]}` output", out.stdout)
    return reply


def require_aws() -> None:
    """pcluster installed and AWS credentials findable, checked locally before any AWS call."""
    cluster_setup.pcluster_bin()
    reply = _helper("credentials")
    if not reply.get("found"):
        reason = f" ({reply['error']})" if reply.get("error") else ""
        raise MissingCredentials(
            f"no AWS credentials found{reason}: run `aws configure`, or `aws sso login --profile NAME` and "
            "export AWS_PROFILE=NAME, or export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(on EC2, attach an instance role)"
        )


# --- cluster state ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterState:
    """What ``pcluster describe-cluster`` says, reduced to what ctrain shows and decides on."""

    name: str
    region: str
    status: str
    stack_status: str
    fleet: str
    version: str
    head_state: str | None
    head_type: str | None
    head_public_ip: str | None
    head_private_ip: str | None
    failures: tuple[str, ...]

    @property
    def head_address(self) -> str | None:
        return self.head_public_ip or self.head_private_ip


def describe(name: str, region: str) -> ClusterState | None:
    """The cluster's state, or None when pcluster says it does not exist."""
    reply = call("describe-cluster", "--cluster-name", name, region=region)
    if reply.code != 0:
        if NOT_FOUND in reply.message:
            return None
        raise reply.failed()
    head = reply.data.get("headNode") or {}
    if not isinstance(head, dict):
        raise ParseError("`pcluster describe-cluster` output (headNode)", reply.raw)
    failures = reply.data.get("failures") or []
    if not isinstance(failures, list):
        raise ParseError("`pcluster describe-cluster` output (failures)", reply.raw)
    return ClusterState(
        name=reply.get("clusterName"),
        region=region,
        status=reply.get("clusterStatus"),
        stack_status=reply.get("cloudFormationStackStatus"),
        fleet=reply.get("computeFleetStatus"),
        version=reply.get("version"),
        head_state=head.get("state"),
        head_type=head.get("instanceType"),
        head_public_ip=head.get("publicIpAddress"),
        head_private_ip=head.get("privateIpAddress"),
        failures=tuple(
            f"{f.get('failureCode', '?')}: {f.get('failureReason', '')}" for f in failures if isinstance(f, dict)
        ),
    )


def _require(name: str, region: str) -> ClusterState:
    state = describe(name, region)
    if state is None:
        raise CtrainError(f"cluster '{name}' not found in {region}; `ctrain cluster up` creates it")
    return state


def failed_events(name: str, region: str) -> list[str]:
    """The CloudFormation events that failed, oldest first (pcluster lists newest first)."""
    reply = call("get-cluster-stack-events", "--cluster-name", name, region=region)
    if reply.code != 0:
        return [f"(stack events unavailable: {reply.message or reply.raw})"]
    lines = []
    for event in reversed(reply.get("events", kind=list)):
        if not isinstance(event, dict):
            raise ParseError("`pcluster get-cluster-stack-events` output (an event is not an object)", reply.raw)
        status = str(event.get("resourceStatus", ""))
        reason = str(event.get("resourceStatusReason", ""))
        if status.endswith("FAILED") and "cancelled" not in reason:
            lines.append(f"{event.get('logicalResourceId')} ({event.get('resourceType')}) {status}: {reason}")
    return lines


def failure_report(state: ClusterState) -> str:
    lines = [f"cluster '{state.name}' is {state.status} (CloudFormation {state.stack_status})"]
    lines += [f"  {failure}" for failure in state.failures]
    events = failed_events(state.name, state.region)
    if events:
        lines.append("  failed CloudFormation events, oldest first:")
        lines += [f"    {event}" for event in events]
    lines.append(
        f"  logs: `pcluster list-cluster-log-streams -n {state.name} -r {state.region}` (head node bootstrap, "
        "custom actions); `ctrain cluster down` removes what is left"
    )
    return "\n".join(lines)


def wait(
    name: str,
    region: str,
    *,
    done: Iterable[str],
    failed: Iterable[str],
    poll: float,
    timeout: float,
    say: Say = ui.info,
    gone_is_done: bool = False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ClusterState | None:
    """Poll ``describe-cluster`` until the status is in ``done`` (or the cluster is gone, when that
    is the goal), printing a line whenever something changes and a heartbeat while nothing does."""
    start = last_said = clock()
    last = ""
    done, failed = set(done), set(failed)
    while True:
        state = describe(name, region)
        now = clock()
        if state is None:
            if gone_is_done:
                say(f"[{_minutes(now - start)}] cluster '{name}' is gone")
                return None
            raise CtrainError(f"cluster '{name}' disappeared while waiting for it (deleted elsewhere?)")
        line = f"{state.status} (CloudFormation {state.stack_status}; head node {state.head_state or 'not started'})"
        if line != last or now - last_said >= HEARTBEAT:
            say(f"[{_minutes(now - start)}] {line}")
            last, last_said = line, now
        if state.status in done:
            return state
        if state.status in failed:
            raise CtrainError(failure_report(state))
        if now - start >= timeout:
            raise CtrainError(
                f"cluster '{name}' is still {state.status} after {_minutes(now - start)}; it carries on in AWS: "
                "`ctrain cluster status` shows where it is"
            )
        sleep(poll)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


# --- steps --------------------------------------------------------------------------------------


def upload_scripts(setup: cluster_setup.Setup, config: dict[str, Any], say: Say = ui.info) -> list[str]:
    """Upload the custom-action scripts the config takes from ``cluster.scripts_s3_uri``."""
    scripts = checks.local_scripts(setup, config)
    if not scripts or not setup.scripts_uri:
        return []
    bucket = setup.scripts_uri.removeprefix("s3://").split("/", 1)[0]
    pairs = [f"{uri.removeprefix(f's3://{bucket}/')}={path}" for uri, path in sorted(scripts.items())]
    reply = _helper("upload", bucket, *pairs)
    if reply.get("error"):
        raise CtrainError(f"uploading the custom-action scripts to {setup.scripts_uri}/ failed: {reply['error']}")
    for uri in reply.get("uploaded") or []:
        say(f"uploaded {uri}")
    return list(reply.get("uploaded") or [])


def _suppress(validators: Sequence[str]) -> list[str]:
    """pcluster's ``--suppress-validators`` from names (``KeyPairValidator``, ``type:...`` or ``ALL``)."""
    if not validators:
        return []
    return ["--suppress-validators", *(v if v == "ALL" or v.startswith("type:") else f"type:{v}" for v in validators)]


def _messages(reply: Reply) -> list[Problem]:
    """pcluster's validation messages (``validationMessages`` or ``configurationValidationErrors``)."""
    items = reply.data.get("validationMessages") or reply.data.get("configurationValidationErrors") or []
    if not isinstance(items, list) or not all(isinstance(i, dict) and "message" in i for i in items):
        raise ParseError(f"`pcluster {reply.command}` validation messages", reply.raw)
    levels = {"ERROR", "WARNING", "INFO"}
    return [
        Problem(
            i.get("level") if i.get("level") in levels else "ERROR",
            "",
            str(i["message"]),
            f"pcluster {i.get('type', 'validator')}",
        )
        for i in items
    ]


def _create_args(setup: cluster_setup.Setup, path: Path, suppress: Sequence[str]) -> list[str]:
    return ["--cluster-name", setup.settings.name, "--cluster-configuration", str(path), *_suppress(suppress)]


def dry_run(setup: cluster_setup.Setup, path: Path, suppress: Sequence[str] = (), say: Say = ui.info) -> list[Problem]:
    """``pcluster create-cluster --dryrun true``: ParallelCluster's validators against the real account.

    Uploads the custom-action scripts first (pcluster checks that they exist). Returns the
    validators' warnings; raises :class:`InvalidConfig` with their errors.
    """
    config = checks.read(path)
    region = cluster_setup.region(setup, config)
    require_aws()
    upload_scripts(setup, config, say)
    reply = call("create-cluster", *_create_args(setup, path, suppress), "--dryrun", "true", region=region)
    if reply.code != 0 and reply.message == DRYRUN_OK:
        return _messages(reply)
    if reply.code == 0:
        raise ParseError("`pcluster create-cluster --dryrun true` reply (exit 0: was a cluster created?)", reply.raw)
    if "configurationValidationErrors" in reply.data:
        raise InvalidConfig(setup.display(path), _messages(reply))
    raise reply.failed()


def up(
    setup: cluster_setup.Setup,
    path: Path,
    *,
    suppress: Sequence[str] = (),
    poll: float = 30.0,
    timeout: float = 3600.0,
    say: Say = ui.info,
) -> ClusterState:
    """Validate, upload the scripts, create the cluster and wait until it is ready (or failed)."""
    offline = checks.validate(setup, path, suppress)
    for problem in offline:
        say(str(problem))
    config = checks.read(path)
    region = cluster_setup.region(setup, config)
    name = setup.settings.name
    require_aws()
    state = describe(name, region)
    if state is not None and state.status in ("CREATE_COMPLETE", "UPDATE_COMPLETE"):
        say(f"cluster '{name}' is already up ({state.status})")
        return state
    if state is not None and state.status != "CREATE_IN_PROGRESS":
        raise CtrainError(
            f"cluster '{name}' already exists in {region} and is {state.status}: `ctrain cluster down` first, "
            "or pick another cluster.name"
        )
    if state is None:
        upload_scripts(setup, config, say)
        reply = call("create-cluster", *_create_args(setup, path, suppress), region=region)
        if reply.code != 0:
            if "configurationValidationErrors" in reply.data:
                raise InvalidConfig(setup.display(path), _messages(reply))
            raise reply.failed()
        status = reply.get("cluster", "clusterStatus")
        said = {(p.source, p.message) for p in offline}
        for problem in _messages(reply):
            if (problem.source, problem.message) not in said:
                say(str(problem))
        say(f"creating cluster '{name}' in {region} ({status}); this usually takes 15-30 minutes")
    else:
        say(f"cluster '{name}' is already being created; waiting for it")
    state = wait(name, region, done={"CREATE_COMPLETE"}, failed={"CREATE_FAILED"}, poll=poll, timeout=timeout, say=say)
    assert state is not None
    return state


def _local_config(setup: cluster_setup.Setup) -> dict[str, Any]:
    """The config file's settings where it is a good one, else none: ``status``, ``ssh`` and ``down``
    only take the region and storage notes from it, and must work whatever became of the file."""
    try:
        return checks.read(setup.config_file)
    except ConfigError:
        return {}


def _storage_note(setup: cluster_setup.Setup) -> str:
    """What deleting the cluster does to its shared storage, read from the config file if there is one."""
    config = _local_config(setup)
    notes = []
    for storage in config.get("SharedStorage") or []:
        settings = storage.get("FsxLustreSettings") or {}
        if settings and "FileSystemId" not in settings and settings.get("DeletionPolicy", "Delete") == "Delete":
            notes.append(f"the FSx file system at {storage.get('MountDir')} and ALL data on it")
    return ", ".join(notes) or "storage the cluster created with DeletionPolicy Delete"


def down(
    setup: cluster_setup.Setup,
    *,
    confirm: Callable[[str], bool],
    poll: float = 30.0,
    timeout: float = 3600.0,
    say: Say = ui.info,
) -> None:
    """Ask, delete the cluster, and wait until it is gone."""
    name = setup.settings.name
    region = cluster_setup.region(setup, _local_config(setup))
    require_aws()
    state = describe(name, region)
    if state is None:
        raise CtrainError(f"cluster '{name}' not found in {region}; nothing to delete")
    if state.status != "DELETE_IN_PROGRESS":
        question = (
            f"Delete cluster '{name}' in {region} ({state.status})? This removes the head node, every compute "
            f"node and {_storage_note(setup)}."
        )
        if not confirm(question):
            raise CtrainError("not confirmed; nothing deleted")
        reply = call("delete-cluster", "--cluster-name", name, region=region)
        if reply.code != 0:
            raise reply.failed()
        say(f"deleting cluster '{name}' ({reply.get('cluster', 'clusterStatus')})")
    wait(name, region, done=(), failed={"DELETE_FAILED"}, poll=poll, timeout=timeout, say=say, gone_is_done=True)


# --- status and ssh -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """A compute node from ``pcluster describe-cluster-instances``."""

    queue: str
    instance_type: str
    state: str


def compute_instances(name: str, region: str) -> list[Instance]:
    reply = call("describe-cluster-instances", "--cluster-name", name, "--node-type", "ComputeNode", region=region)
    if reply.code != 0:
        raise reply.failed()
    found = []
    for item in reply.get("instances", kind=list):
        if not isinstance(item, dict) or not {"instanceType", "state"} <= item.keys():
            raise ParseError("`pcluster describe-cluster-instances` output (an instance)", reply.raw)
        found.append(Instance(str(item.get("queueName", "?")), str(item["instanceType"]), str(item["state"])))
    return found


def status(setup: cluster_setup.Setup) -> str:
    """State, head node address, compute fleet and compute nodes, as aligned lines."""
    region = cluster_setup.region(setup, _local_config(setup))
    require_aws()
    state = _require(setup.settings.name, region)
    nodes: dict[tuple[str, str, str], int] = {}
    for node in compute_instances(state.name, region):
        key = (node.queue, node.state, node.instance_type)
        nodes[key] = nodes.get(key, 0) + 1
    head = "not started"
    if state.head_state:
        address = state.head_public_ip or "no public address"
        head = f"{address} (private {state.head_private_ip}), {state.head_state}, {state.head_type}"
    rows = [
        ("cluster", f"{state.name} ({region}, ParallelCluster {state.version})"),
        ("state", f"{state.status} (CloudFormation {state.stack_status})"),
        ("head node", head),
        ("compute fleet", state.fleet),
        ("compute nodes", "; ".join(f"{q}: {n} {s} {t}" for (q, s, t), n in sorted(nodes.items())) or "none"),
        *(("failure", f) for f in state.failures),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _ssh_key(setup: cluster_setup.Setup) -> Path | None:
    """cluster.ssh_key, else ~/.ssh/KEY_PAIR.pem where it exists."""
    key = setup.settings.ssh_key
    if key is None and setup.settings.key_pair:
        default = Path(f"~/.ssh/{setup.settings.key_pair}.pem").expanduser()
        try:
            key = default if default.is_file() else None
        except OSError:  # a name AWS takes (up to 255 characters) is too long for a file name with .pem
            key = None
    return setup.path(key) if key else None


# The login user of each operating system ParallelCluster offers.
LOGIN_USERS = {"alinux2023": "ec2-user", "ubuntu2204": "ubuntu", "ubuntu2404": "ubuntu", "rhel8": "ec2-user",
               "rocky8": "rocky", "rhel9": "ec2-user", "rocky9": "rocky"}  # fmt: skip


def save_profile(setup: cluster_setup.Setup, state: ClusterState) -> Path | None:
    """A cluster profile for the head node (ctrain.remote), so that `ctrain submit --cluster NAME`
    works from here: pyxis, the project in FSx under the login user; None without an address."""
    from ctrain import remote

    if not state.head_address:
        return None
    user = LOGIN_USERS.get(setup.settings.os, "ec2-user")
    profile = remote.Profile(host=state.head_address, user=user, identity_file=_ssh_key(setup),
                             project_dir=f"{setup.settings.fsx_mount.rstrip('/')}/{user}/{setup.root.name}",
                             runtime="pyxis")  # fmt: skip
    return remote.save_profile(setup.settings.name, profile)


def ssh_command(setup: cluster_setup.Setup, extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """``pcluster ssh`` argv and the environment it needs (it takes the region from the environment)."""
    region = cluster_setup.region(setup, _local_config(setup))
    key = _ssh_key(setup)
    identity = ["-i", str(key)] if key else []
    argv = [cluster_setup.pcluster_bin(), "ssh", "--cluster-name", setup.settings.name, *identity, *extra]
    return argv, {"AWS_DEFAULT_REGION": region}


def ssh(setup: cluster_setup.Setup, extra: Sequence[str] = ()) -> NoReturn:
    """Replace this process with ``pcluster ssh`` (an interactive session keeps the terminal)."""
    proc.require("ssh")
    require_aws()
    argv, env = ssh_command(setup, extra)
    os.execve(argv[0], argv, {**os.environ, **env})
