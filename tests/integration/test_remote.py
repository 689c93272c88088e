"""`ctrain status/logs/cancel --cluster NAME` from "a laptop": over a real OpenSSH server on the
testbed's login host, to the testbed's real Slurm (tests/plugins/remote.py)."""

from __future__ import annotations

import json
import pwd
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ctrain import protocol, remote, slurm
from ctrain.cli import main
from ctrain import __version__
from tests.plugins.image import free_port
from tests.plugins.remote import LoginHost, user_ctrain

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


@pytest.fixture()
def clusters(login_host: LoginHost, sbatch_project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clusters file with the testbed as `tb` (the default), a fresh project directory there as
    `fresh` (with this checkout's ctrain as the cluster's), and broken variants of them."""
    path = tmp_path / "clusters.yaml"
    project_dir = str(sbatch_project.path)
    fresh = Path(sbatch_project.testbed.shared_dir) / f"laptop-project-{time.monotonic_ns()}"
    launcher = user_ctrain(login_host.directory)
    full = login_host.directory / "full"  # a file system of 1 MiB, as a full disk on the cluster
    full.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(full)], check=True)
    profiles = {
        "default": "tb",
        "clusters": {
            "tb": login_host.profile(project_dir=project_dir),
            "fresh": login_host.profile(project_dir=str(fresh), ctrain=str(launcher)),
            "noctrain": login_host.profile(project_dir=str(fresh), ctrain="/nonexistent/bin/ctrain"),
            "oldctrain": login_host.profile(
                project_dir=str(fresh), ctrain=str(_other_ctrain(login_host.directory))
            ),
            "full": login_host.profile(project_dir=str(fresh), images_dir=str(full)),
            "noslurm": login_host.profile(port=login_host.bare_port),
            "noproject": login_host.profile(),
            "wrongkey": login_host.profile(identity_file=str(login_host.directory / "other_key")),
            "nosshd": login_host.profile(port=free_port(login_host.host)),
            "nohost": login_host.profile(host="no-such-login.invalid"),
        },
    }
    path.write_text(yaml.safe_dump(profiles))
    monkeypatch.setenv(remote.PROFILES_ENV, str(path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # which cluster each job went to
    yield path
    for name in profiles["clusters"]:
        remote.Ssh(remote.resolve(name, path)).close()
    shutil.rmtree(fresh, ignore_errors=True)
    subprocess.run(["umount", str(full)], check=True)


def _other_ctrain(directory: Path) -> Path:
    """A ctrain of another version on the cluster (it only answers --version)."""
    other = directory / "bin" / "ctrain-0.0.1"
    other.parent.mkdir(mode=0o755, exist_ok=True)
    other.write_text('#!/bin/sh\necho "ctrain, version 0.0.1"\n')
    other.chmod(0o755)
    return other


def _job(testbed, workdir: Path, body: str, name: str) -> str:
    script = workdir / f"{name}.sbatch"
    script.write_text(f"#!/bin/sh\n#SBATCH --job-name={name}\n#SBATCH --output=logs/%x-%j.out\n{body}\n")
    return testbed.user_slurm.sbatch([str(script)], cwd=workdir)


def _ctrain(*args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output, time.monotonic() - start


def _masters() -> dict[str, str]:
    """Each shared SSH connection ctrain holds: its socket's name -> its master's pid (``ssh -O check``)."""
    found = {}
    for socket in sorted(remote._control_dir().iterdir()):
        check = subprocess.run(["ssh", "-o", f"ControlPath={socket}", "-O", "check", "placeholder"],
                               capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
        if match := re.search(r"Master running \(pid=(\d+)\)", check.stderr):
            found[socket.name] = match.group(1)
    return found


def test_status_logs_and_cancel_over_ssh(testbed, sbatch_project, clusters: Path) -> None:
    job_id = _job(testbed, sbatch_project.path, "echo started on $(hostname)\nsleep 120", "sshprobe")
    code, out, first = _ctrain("status", "--cluster", "tb", job_id)  # opens the shared connection
    assert code == 0, out
    deadline = time.monotonic() + 60
    while not re.search(rf"^{job_id}\s+sshprobe\s+RUNNING\s", out, re.MULTILINE):
        assert time.monotonic() < deadline, out
        time.sleep(0.5)
        code, out, _ = _ctrain("status", job_id)  # the default cluster: tb
    masters = _masters()
    times = [_ctrain("status", "--cluster", "tb", job_id)[2] for _ in range(5)]
    print(f"remote | ctrain status --cluster tb JOB: first {first:.2f} s, then {min(times):.2f}-{max(times):.2f} s")
    assert masters and _masters() == masters, (masters, _masters())  # the five went over the first's connection

    deadline = time.monotonic() + 30
    while "started on" not in (text := _ctrain("logs", "--cluster", "tb", job_id)[1]):
        assert time.monotonic() < deadline, text
        time.sleep(0.5)
    assert re.search(r"started on node\d", text), text

    followed: list[str] = []
    client = slurm.Slurm(remote.Ssh(remote.resolve("tb")))
    follower = threading.Thread(target=lambda: followed.append(str(client.follow(job_id, emit=followed.append,
                                                                                poll=0.5))))  # fmt: skip
    follower.start()
    code, out, _ = _ctrain("cancel", "--cluster", "tb", job_id)
    assert code == 0 and f"job {job_id}: cancelled" in out, out
    follower.join(timeout=60)
    assert not follower.is_alive(), "following over ssh did not stop when the job ended"
    assert any(line.startswith("started on node") for line in followed) and "CANCELLED" in followed[-1], followed
    code, out, _ = _ctrain("status", "--cluster", "tb", job_id)
    assert re.search(rf"^{job_id}\s+sshprobe\s+CANCELLED\s", out, re.MULTILINE), out


def test_log_of_a_job_slurm_forgot_is_found_in_the_remote_project(sbatch_project, clusters: Path) -> None:
    """A finished job Slurm no longer knows: its log is looked for in PROJECT_DIR/logs on the cluster."""
    log = sbatch_project.path / "logs" / "old-999998.out"
    log.write_text("an old run\n")
    try:
        code, out, _ = _ctrain("logs", "--cluster", "tb", "999998")
        assert code == 0 and out == "an old run\n", out
    finally:
        log.unlink()
    code, out, _ = _ctrain("logs", "--cluster", "tb", "999997")
    assert code == 1 and "no log for job 999997" in out, out


def test_a_job_of_another_cluster_is_named_as_such(clusters: Path) -> None:
    """A job id Slurm there does not know, submitted from here to another cluster: the error says which."""
    remote.record_job("fresh", "999996")
    code, out, _ = _ctrain("logs", "--cluster", "tb", "999996")
    assert code == 1 and out.rstrip().endswith(
        "; job 999996 was submitted from here to cluster fresh: add --cluster fresh"), out  # fmt: skip
    code, out, _ = _ctrain("status", "--cluster", "tb", "999996")
    assert code == 0 and "job 999996: this cluster does not know it; job 999996 was submitted from here to " \
        "cluster fresh" in out, out  # fmt: skip
    code, out, _ = _ctrain("cancel", "--cluster", "tb", "999996")
    assert code == 1 and "add --cluster fresh" in out and "Traceback" not in out, out


@pytest.mark.parametrize(
    ("cluster", "said"),
    [
        ("wrongkey", r"refused the login for ctrain: ssh tried \S+other_key; put the public key"),
        ("nosshd", r"refused the connection \(no sshd on that port\)"),
        ("nohost", r"host 'no-such-login.invalid' is unknown"),
        ("nope", r"no cluster named 'nope' in \S+clusters.yaml \(clusters: fresh, full, noctrain, nohost, noproject, "
                 r"noslurm, nosshd, oldctrain, tb, wrongkey\)"),
    ],
)
def test_what_goes_wrong_reaching_a_cluster_is_said_in_one_line(clusters: Path, cluster: str, said: str) -> None:
    code, out, seconds = _ctrain("status", "--cluster", cluster)
    assert code != 0 and "Traceback" not in out, out
    assert re.search(r"^error: (cluster \S+: )?(\S+ )?" + said, out), out
    assert len(out.strip().splitlines()) == 1, out
    assert seconds < 60, seconds  # a hang guard: never a prompt that waits for an answer


def test_logs_of_a_forgotten_job_without_a_project_dir_say_where_to_set_it(clusters: Path) -> None:
    code, out, _ = _ctrain("logs", "--cluster", "noproject", "999990")
    assert code != 0 and len(out.strip().splitlines()) == 1, out
    assert "no project directory to look in (project_dir in the cluster's profile)" in out, out


def _laptop_project(tmp_path: Path) -> Path:
    """A project on "the laptop": ctrain's files, a ctrain.yaml, and what must never be sent."""
    project = tmp_path / "laptop"
    project.mkdir()
    for name in ("sbatch", "recipes", "configs"):
        shutil.copytree(REPO / name, project / name)
    (project / "ctrain.yaml").write_text("slurm:\n  runtime: apptainer\n  ntasks_per_node: 1\n")
    (project / ".gitignore").write_text("scratch/\n")
    (project / ".env").write_text("HF_TOKEN=hf_not_for_the_cluster\n")
    for ignored in ("outputs/old/model.safetensors", "scratch/big.bin", "images/local.sif"):
        (project / ignored).parent.mkdir(parents=True, exist_ok=True)
        (project / ignored).write_text("local only\n")
    return project


def test_push_and_submit_from_a_laptop_project(testbed, clusters: Path, cpu_sif: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The trip from a laptop: the image to the cluster's images_dir (then, unchanged, not again),
    the project's files to PROJECT_DIR (never secrets, outputs, images or ignored files), and a
    2-node demo job queued there by the cluster's ctrain, its log followed to the end, where the trained
    model's accuracy on held-out problems is printed. The job trains 40 steps: the trip is under
    test here; the demo's bar is the quickstart's (test_quickstart.py)."""
    project = _laptop_project(tmp_path)
    monkeypatch.chdir(project)
    cluster = remote.resolve("fresh")
    assert cluster is not None
    code, out, first = _ctrain("push", "--cluster", "fresh", "--file", str(cpu_sif))
    assert code == 0, out
    sent = Path(cluster.images_dir) / cpu_sif.name
    assert f"pushed: remote {cluster.profile.host}:{sent}" in out, out
    assert sent.stat().st_size == cpu_sif.stat().st_size
    code, out, again = _ctrain("push", "--cluster", "fresh", "--file", str(cpu_sif))
    assert code == 0 and "already has this file" in out, out
    print(f"remote | ctrain push --cluster (597 MB SIF): first {first:.1f} s, unchanged {again:.2f} s")

    code, out, took = _ctrain("submit", "--cluster", "fresh", "--nodes", "2", f"--image=images/{cpu_sif.name}",
                              "recipes/demo-addition.yaml", "eval.after_training=true",
                              "training.max_steps=40")  # fmt: skip
    assert code == 0, out
    job_id = re.search(r"^(\d+)$", out, re.MULTILINE).group(1)
    print(f"remote | ctrain submit --cluster (checks, project sent, job queued): {took:.1f} s")
    assert re.search(r"cluster fresh: \d+ project file\(s\) sent to ", out), out
    assert json.loads(remote.jobs_path().read_text())[job_id] == ["fresh"]
    there = Path(cluster.profile.project_dir)
    assert (there / "recipes" / "demo-addition.yaml").is_file() and (there / "ctrain.yaml").is_file()
    for never in (".env", "outputs/old", "scratch", "images/local.sif"):
        assert not (there / never).exists(), never
    # Followed from the laptop to the end: the demo trains on 2 nodes and its log ends with the score
    # of the 40-step model (about 0: the bar is for the full 800 steps).
    code, out, took = _ctrain("logs", "-f", "--cluster", "fresh", job_id)
    assert code == 0 and "on 2 node(s)" in out, out[-4000:]
    assert f"job {job_id}: COMPLETED" in out, out[-4000:]
    scores = re.findall(r"accuracy: ([0-9.]+) \((\d+)/(\d+) exact\) \S*demo-addition/final", out)
    assert scores and int(scores[-1][2]) == 500, out[-4000:]
    assert re.search(r"step \d+/40, loss", out), out[-4000:]
    print(f"remote | ctrain logs -f --cluster (the 2-node demo to its end, accuracy {scores[-1][0]}): {took:.1f} s")

    code, out, _ = _ctrain("submit", "--cluster", "fresh", "--dry-run", f"--image=images/{cpu_sif.name}",
                           "recipes/demo-addition.yaml")  # fmt: skip
    assert code == 0 and "all up to date" in out, out  # nothing changed: nothing sent again


def test_cluster_without_ctrain_is_named_before_anything_is_sent(clusters: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(_laptop_project(tmp_path))
    code, out, _ = _ctrain("submit", "--cluster", "noctrain", "recipes/demo-addition.yaml")
    assert code == 1 and "`/nonexistent/bin/ctrain` does not run on ctrain@" in out, out
    assert f"pipx install ctrain-slurm=={__version__}" in out, out
    assert not Path(remote.resolve("noctrain").profile.project_dir).exists()
    code, out, _ = _ctrain("submit", "--cluster", "oldctrain", "recipes/demo-addition.yaml")
    assert code == 1 and f"cluster oldctrain runs ctrain 0.0.1, this is {__version__}: install the same version" \
        in out, out  # fmt: skip
    assert not Path(remote.resolve("oldctrain").profile.project_dir).exists()


def test_data_outside_the_project_is_sent_where_the_job_reads_it(
    clusters: Path, cpu_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recipe naming ../elsewhere/train.jsonl: on the laptop, beside the project, so the project's sync
    leaves it out, and the cluster has nothing there. It goes to PROJECT_DIR/inputs/data/ and the job is
    pointed there; the cluster's ctrain checks the recipe with it (dry run). A key file is never sent."""
    project = _laptop_project(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}]}
            for a in range(600)]  # fmt: skip
    (elsewhere / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(project)
    cluster = remote.resolve("fresh")
    assert _ctrain("push", "--cluster", "fresh", "--file", str(cpu_sif))[0] == 0  # the dry run checks the image
    code, out, _ = _ctrain("submit", "--cluster", "fresh", "--dry-run", f"--image=images/{cpu_sif.name}",
                           "recipes/demo-addition.yaml", "data.source=../elsewhere/train.jsonl")  # fmt: skip
    there = Path(cluster.profile.project_dir) / "inputs" / "data" / "train.jsonl"
    assert code == 0, out
    assert (f"cluster fresh: data.source ../elsewhere/train.jsonl is outside the project: sent to {there} "
            "(1 file(s) changed); the job reads it there (data.source=inputs/data/train.jsonl)") in out, out
    assert there.read_bytes() == (elsewhere / "train.jsonl").read_bytes()
    assert "data.source=inputs/data/train.jsonl" in out  # the cluster's ctrain got the override

    (elsewhere / ".ssh").mkdir()
    (elsewhere / ".ssh" / "data.jsonl").write_text("{}\n")
    code, out, _ = _ctrain("submit", "--cluster", "fresh", "--dry-run", f"--image=images/{cpu_sif.name}",
                           "recipes/demo-addition.yaml", "data.source=../elsewhere/.ssh/data.jsonl")  # fmt: skip
    assert code == 2 and re.search(r"^error: data.source ../elsewhere/.ssh/data.jsonl is where credentials are kept",
                                   out, re.MULTILINE), out  # fmt: skip
    assert "project file(s) sent" not in out and not (there.parent / "data.jsonl").exists(), out  # nothing went


def test_a_full_disk_on_the_cluster_is_found_before_the_image_is_sent(
    clusters: Path, cpu_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(_laptop_project(tmp_path))
    code, out, _ = _ctrain("push", "--cluster", "full", "--file", str(cpu_sif))
    size = f"{cpu_sif.stat().st_size / 1e6:.0f}"  # the image's own size, as the message rounds it
    assert code == 1 and re.search(rf"^error: not enough free space in \S+/full for {size} MB \(1 MB free\)", out), out
    assert not any(Path(remote.resolve("full").images_dir).iterdir())  # refused before anything was sent


def test_a_login_node_without_slurm_is_named(clusters: Path) -> None:
    """The login shell there has no Slurm on its PATH (a module not loaded): said, not a traceback."""
    code, out, _ = _ctrain("status", "--cluster", "noslurm")
    said = r"^error: cluster noslurm: \S+ has no `squeue`: is it the cluster's login node"
    assert code == 1 and re.search(said, out), out


def test_remote_paths_never_pass_through_the_login_shell(login_host: LoginHost, sbatch_project, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A project_dir with a space and `$(...)`, sent with RSYNC_OLD_ARGS=1 in the user's environment
    (how rsync before 3.2.4 passes remote paths: through the login shell): the files arrive in
    exactly that directory and nothing runs on the login node."""
    canary = f"ctrain-rsync-canary-{time.monotonic_ns()}"  # made where the login shell starts, if it ran
    odd = Path(sbatch_project.testbed.shared_dir) / f"odd project $(touch {canary}) `touch {canary}`"
    starts = [Path(pwd.getpwnam(login_host.user).pw_dir), Path(sbatch_project.testbed.shared_dir), Path("/")]
    path = tmp_path / "clusters.yaml"
    path.write_text(yaml.safe_dump({"clusters": {"odd": login_host.profile(project_dir=str(odd))}}))
    project = tmp_path / "project"
    (project / "recipes").mkdir(parents=True)
    (project / "recipes" / "r.yaml").write_text("task: sft\n")
    monkeypatch.setenv("RSYNC_OLD_ARGS", "1")
    before = set(odd.parent.iterdir())
    ssh = remote.Ssh(remote.resolve("odd", path))
    try:
        said: list[str] = []
        remote.sync_project(ssh, project, emit=said.append)
    finally:
        ssh.close()
    assert (odd / "recipes" / "r.yaml").read_text() == "task: sft\n", said
    assert not [where for where in starts if (where / canary).exists()], said  # nothing ran on the login node
    assert set(odd.parent.iterdir()) - before == {odd}, said  # and nothing went anywhere else
    shutil.rmtree(odd, ignore_errors=True)


def _cluster_ctrain_with_hub(directory: Path, endpoint: str) -> Path:
    """The cluster's ctrain (:func:`tests.plugins.remote.user_ctrain`) with huggingface_hub and everything it needs
    beside it, and the hub reached at ``endpoint``, as a login node with internet reaches the Hub."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    lib = directory / "lib-hub"
    wanted, seen = ["huggingface_hub"], set()
    while wanted:
        name = wanted.pop()
        dist = metadata.distribution(name)
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for file in dist.files or ():
            if file.parts[0] == "..":  # its console scripts, outside site-packages
                continue
            (lib / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dist.locate_file(file), lib / file)
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
    for path in (lib, *lib.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    base = user_ctrain(directory).read_text().replace("PYTHONPATH=", f"PYTHONPATH={lib}:", 1)
    launcher = directory / "bin" / "ctrain-hub"
    launcher.write_text(base.replace("exec ", f"HF_ENDPOINT={endpoint} HF_HUB_DISABLE_PROGRESS_BARS=1 exec ", 1))
    launcher.chmod(0o755)
    return launcher


def test_fetch_on_the_cluster_puts_a_model_in_the_cache_its_jobs_mount_and_nothing_on_the_laptop(
    login_host: LoginHost, clusters: Path, sbatch_project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ctrain fetch --cluster`: the download runs on the login node (a hub server it reaches, which
    the laptop's ctrain is never pointed at), into the slurm.hf_cache of the project there, recorded
    with its commit; the laptop's own cache gets nothing. Run again, it downloads nothing."""
    from tests.hubserver import HubRepo, HubServer

    config = {"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "vocab_size": 16, "n_positions": 32}
    model = HubRepo("model", "org/tiny", {"config.json": json.dumps(config).encode(),
                                          "model.safetensors": bytes(range(256)) * 400})  # fmt: skip
    cache = Path(sbatch_project.testbed.shared_dir) / f"hf-cache-{time.monotonic_ns()}"
    project = _laptop_project(tmp_path)
    (project / "ctrain.yaml").write_text(f"slurm:\n  runtime: apptainer\n  hf_cache: {cache}\n")
    monkeypatch.chdir(project)
    laptop_home = tmp_path / "laptop-hf"
    monkeypatch.setenv("HF_HOME", str(laptop_home))
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    try:
        with HubServer([model]) as server:
            profiles = yaml.safe_load(clusters.read_text())
            fresh = profiles["clusters"]["fresh"]
            profiles["clusters"]["hub"] = {**fresh, "ctrain": str(_cluster_ctrain_with_hub(login_host.directory,
                                                                                            server.url))}  # fmt: skip
            clusters.write_text(yaml.safe_dump(profiles))
            code, out, took = _ctrain("fetch", "--cluster", "hub", "org/tiny")
            assert code == 0, out
            snapshot = cache / "hub" / "models--org--tiny" / "snapshots" / model.sha
            assert f"org/tiny: commit {model.sha}" in out, out
            assert (snapshot / "model.safetensors").read_bytes() == model.files["model.safetensors"]
            assert json.loads((cache / "ctrain-fetched.json").read_text()), "the fetch is recorded in the cache"
            assert (snapshot / "config.json").stat().st_uid == pwd.getpwnam(login_host.user).pw_uid  # done there
            assert not laptop_home.exists(), "the laptop's cache got nothing"
            gets = sum(1 for method, path, _ in server.requests if method == "GET" and "resolve" in path)
            code, out, _ = _ctrain("fetch", "--cluster", "hub", "org/tiny")
            assert code == 0, out
            assert sum(1 for method, path, _ in server.requests if method == "GET" and "resolve" in path) == gets
        print(f"remote | ctrain fetch --cluster (project sent, a 100 kB model fetched on the login node): {took:.1f} s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_pull_brings_a_sweeps_results_home_and_nothing_else_of_the_cluster(clusters: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A sweep of two tasks as its jobs left it in the cluster's project (task 0 continued as job 503):
    `ctrain pull` over the testbed's sshd brings each task's metrics, TensorBoard events and timeline and
    every job's log, which `ctrain results` then ranks here; never checkpoints, the final model only with
    --models, nothing of another job, nothing in an output directory that is not ctrain's. Again, it
    brings nothing; a file damaged here comes back whole."""
    from ctrain.jobs import history

    cluster = remote.resolve("fresh")
    there = Path(cluster.profile.project_dir)
    state = there / protocol.STATE_DIR
    state.mkdir(parents=True)
    tasks = []
    for index, (lr, loss, run) in enumerate([("1e-3", 0.7, "501"), ("1e-2", 0.4, "502")]):
        output = there / "outputs" / "demo" / f"learning_rate-{lr}"
        (output / "runs").mkdir(parents=True)
        (output / "metrics.jsonl").write_text(json.dumps({"run": run, "step": 40, "loss": loss, "eval_loss": loss}) + "\n")
        (output / "runs" / "events.out.tfevents.1.node1").write_bytes(b"events" * 100)
        for kept_there in ("checkpoint-20/model.safetensors", "final/model.safetensors", "notes/secret.txt"):
            (output / kept_there).parent.mkdir(parents=True, exist_ok=True)
            (output / kept_there).write_bytes(b"weights")
        (output / "secret.txt").write_text("not ctrain's\n")
        tasks.append({"task": index, "name": output.name, "values": {"training.learning_rate": lr},
                      "output": str(output)})  # fmt: skip
        (state / protocol.timeline_file(run)).write_text("100.0 0 start 90.0 1 0\n101.0 0 launched\n190.0 0 exited 0\n")
        (state / protocol.run_file(f"500_{index}")).write_text(f"{run}\n")
    history.record(there, "500", "demo", ["recipes/demo-addition.yaml"], sweep=tasks)
    history.record(there, "600", "odd", ["recipes/demo-addition.yaml"], Path("/etc"))
    (state / protocol.jobs_file("501")).write_text("501\n503\n")
    (there / "logs").mkdir()
    for job in ("501", "502", "503", "777"):
        (there / "logs" / f"demo-{job}.out").write_text(f"step 40/40, loss 0.5 (job {job})\n")
    (state / protocol.timeline_file("777")).write_text("another job's\n")
    for path in (there, *there.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)

    project = _laptop_project(tmp_path)
    monkeypatch.chdir(project)
    code, out, took = _ctrain("pull", "500", "--cluster", "fresh")
    assert code == 0, out
    here = project / "outputs" / "demo"
    for lr in ("1e-3", "1e-2"):
        task = here / f"learning_rate-{lr}"
        assert (task / "metrics.jsonl").is_file() and (task / "runs" / "events.out.tfevents.1.node1").is_file()
        assert not (task / "checkpoint-20").exists() and not (task / "final").exists()
        assert not (task / "secret.txt").exists() and not (task / "notes").exists()
    assert sorted(p.name for p in (project / "logs").glob("demo-*")) == ["demo-501.out", "demo-502.out", "demo-503.out"]
    assert not (project / ".ctrain" / protocol.timeline_file("777")).exists()
    told = json.loads(CliRunner().invoke(main, ["results", "500", "--json"]).output)
    assert [(r["job"], r["run"], r["best"]) for r in told["runs"]] == [("500_1", "502", True), ("500_0", "501", False)]
    assert told["runs"][0]["account"]["node_hours"] > 0 and told["runs"][0]["output"] == str(here / "learning_rate-1e-2")
    print(f"remote | ctrain pull --cluster (a 2-task sweep's results): {took:.1f} s")

    (here / "learning_rate-1e-3" / "metrics.jsonl").write_text("damaged")
    code, out, _ = _ctrain("pull", "500", "--cluster", "fresh", "--models")
    assert code == 0 and "3 file(s) new or changed" in out, out  # the damaged file and the two final models
    assert json.loads((here / "learning_rate-1e-3" / "metrics.jsonl").read_text())["loss"] == 0.7
    assert (here / "learning_rate-1e-2" / "final" / "model.safetensors").read_bytes() == b"weights"
    assert not (here / "learning_rate-1e-2" / "checkpoint-20").exists()
    assert len([e for e in history.read(project)[0] if e.job == "500"]) == 1  # recorded once

    code, out, _ = _ctrain("pull", "600", "--cluster", "fresh")  # a history line naming /etc as its output
    assert code == 0 and "0 file(s) new or changed" in out, out
    assert not any((project / "pulled").rglob("passwd")) and not any((project / "pulled").rglob("shadow"))
    code, out, _ = _ctrain("pull", "999", "--cluster", "fresh")
    assert code == 2 and "error: job 999: not in the history of fresh's project" in out, out
