"""Cluster profiles and the SSH runner's command lines and messages.

The real sshd: tests/integration/test_remote.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctrain import remote
from ctrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "clusters.yaml"
    path.write_text(text)
    return path


def test_no_file_means_this_machine(tmp_path: Path) -> None:
    assert remote.resolve(None, tmp_path / "missing.yaml") is None


def test_default_and_named_profiles(tmp_path: Path) -> None:
    path = _write(tmp_path, "default: a\nclusters:\n  a: {host: login.a, project_dir: /shared/p}\n"
                            "  b: {host: b, user: me, port: 2222, images_dir: /scratch/img, "
                            "runtime: pyxis}\n")  # fmt: skip
    a = remote.resolve(None, path)
    assert a is not None and a.name == "a" and a.images_dir == "/shared/p/images" and a.target == "login.a"
    b = remote.resolve("b", path)
    assert b is not None and b.target == "me@b:2222" and b.images_dir == "/scratch/img"
    with pytest.raises(ConfigError, match=r"no cluster named 'c' in \S+ \(clusters: a, b\)"):
        remote.resolve("c", path)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("clusters:\n  a: {user: me}\n", r"clusters.yaml: 'clusters.a.host' is not set"),
        ("clusters:\n  a: {host: '-oProxyCommand=x'}\n", r"'clusters.a.host' is '-oProxyCommand=x'"),
        ("clusters:\n  a: {host: h, user: 'a@b'}\n", r"'clusters.a.user' is 'a@b'"),
        ("clusters:\n  a: {host: h, port: 70000}\n", r"line 2: 'clusters.a.port' is 70000"),
        ("clusters:\n  a: {host: h, project_dir: relative/p}\n",
         r"'clusters.a.project_dir' is 'relative/p': give an absolute"),
        ("clusters:\n  a: {host: h, hots: x}\n", r"unknown key 'clusters.a.hots' \(did you mean 'host'\?\)"),
        ("default: z\nclusters:\n  a: {host: h}\n", r"'default' is 'z', which is not one of the clusters \(a\)"),
        ("clusters:\n  'a b': {host: h}\n", r"cluster name 'a b'"),
    ],
)
def test_bad_profiles_are_named(tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        remote.load_profiles(_write(tmp_path, text))


def test_ssh_command_never_prompts_and_shares_one_connection(tmp_path: Path) -> None:
    cluster = remote.Cluster("x", remote.Profile(host="login", user="me", port=2222, identity_file=Path("/k"),
                                                 ssh_options=["-o", "ProxyJump=bastion"]))  # fmt: skip
    argv = remote.Ssh(cluster, tmp_path).argv("squeue --me")
    assert argv[:2] == ["ssh", "-o"] and "BatchMode=yes" in argv and f"ControlPath={tmp_path}/%C" in argv
    assert argv[-5:] == ["-o", "ProxyJump=bastion", "login", "--", "squeue --me"]
    assert ["-p", "2222"] == argv[argv.index("-p"):argv.index("-p") + 2] and "IdentitiesOnly=yes" in argv


@pytest.mark.parametrize(
    ("stderr", "said"),
    [
        ("ssh: Could not resolve hostname nope: Name or service not known", "host 'login' is unknown"),
        ("ssh: Could not resolve hostname login: Temporary failure in name resolution",
         "cannot look up 'login': no name server answers (no network here"),
        ("ssh: connect to host login port 22: Connection refused", "me@login refused the connection"),
        ("ssh: connect to host login port 22: Connection timed out", "me@login does not answer"),
        ("me@login: Permission denied (publickey).", "refused the login for me: ssh tried /k"),
        ("Host key verification failed.", "the host key of me@login is unknown or has changed"),
        ("kex_exchange_identification: something new", "ssh to me@login failed: kex_exchange_identification"),
    ],
)
def test_what_ssh_says_becomes_a_cause_and_a_fix(tmp_path: Path, stderr: str, said: str) -> None:
    cluster = remote.Cluster("x", remote.Profile(host="login", user="me", identity_file=Path("/k")))
    message = str(remote.Ssh(cluster, tmp_path)._problem(stderr))
    assert message.startswith("cluster x: ") and said in message, message


def test_a_saved_profile_loads_and_replaces_one_of_the_same_name(tmp_path: Path) -> None:
    path = _write(tmp_path, "default: a\nclusters:\n  a: {host: login.a}\n")
    first = remote.Profile(host="1.2.3.4", user="ubuntu", runtime="pyxis", project_dir="/fsx/u/p")
    remote.save_profile("b", first, path)
    remote.save_profile("b", remote.Profile(host="5.6.7.8", user="ubuntu", runtime="pyxis"), path)
    found = remote.load_profiles(path)
    assert found.default == "a" and found.clusters["a"].host == "login.a"
    assert found.clusters["b"] == remote.Profile(host="5.6.7.8", user="ubuntu", runtime="pyxis")
    with pytest.raises(ConfigError, match="'clusters.c.host' is '-x'"):
        remote.save_profile("c", remote.Profile(host="-x"), path)
    assert "c" not in remote.load_profiles(path).clusters


def test_unsent_paths_are_the_recipe_paths_outside_the_project(tmp_path: Path) -> None:
    """What `submit --cluster` would not send: paths the recipe names that exist here, outside the project.
    Inside the project, missing here, builtins and hub names are not among them."""
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    (root / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "train.jsonl").write_text("{}\n")
    (tmp_path / "model").mkdir()
    recipe = root / "recipe.yaml"
    recipe.write_text((REPO / "recipes" / "demo-addition.yaml").read_text())
    assert remote.unsent_paths(recipe, [], root) == {}  # builtin:addition
    assert remote.unsent_paths(recipe, ["data.source=data/train.jsonl"], root) == {}
    assert remote.unsent_paths(recipe, ["data.source=../missing.jsonl"], root) == {}
    assert remote.unsent_paths(recipe, ["data.source=../shared/train.jsonl"], root) == {
        "data.source": "../shared/train.jsonl"
    }
    absolute = str(tmp_path / "shared" / "train.jsonl")
    assert remote.unsent_paths(recipe, [f"data.source={absolute}"], root) == {"data.source": absolute}
    assert remote.unsent_paths(recipe, ["training.max_steps=many"], root) == {}  # the cluster's ctrain says why


def test_a_profile_without_project_dir_is_refused_before_connecting(tmp_path: Path, monkeypatch) -> None:
    """`ctrain submit --cluster` needs the project's directory there: said before any SSH (the host
    here does not exist, so a connection would fail with another message)."""
    from click.testing import CliRunner

    from ctrain.cli import main

    config = tmp_path / "config"
    (config / "ctrain").mkdir(parents=True)
    (config / "ctrain" / "clusters.yaml").write_text("clusters:\n  hpc: {host: no-such-host.invalid}\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "ctrain.yaml").write_text("slurm: {}\n")
    monkeypatch.chdir(tmp_path / "p")
    result = CliRunner().invoke(main, ["submit", "--cluster", "hpc", "--dry-run", "recipes/demo-addition.yaml"])
    assert result.exit_code == 2, result.output
    assert "cluster hpc: set `project_dir` in" in result.stderr and "ssh" not in result.stderr.lower()


def test_status_on_a_laptop_names_the_cluster_file_not_slurm(tmp_path: Path, monkeypatch) -> None:
    """No Slurm commands and no clusters.yaml: what is missing is a cluster to reach."""
    import shutil

    from click.testing import CliRunner

    from ctrain.cli import main

    laptop = tmp_path / "bin"
    laptop.mkdir()
    (laptop / "ssh").symlink_to(shutil.which("ssh") or "/usr/bin/ssh")
    monkeypatch.setenv("PATH", str(laptop))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["status"])
    assert result.exit_code == 3, result.output
    assert f"add your cluster's login node to {tmp_path}/config/ctrain/clusters.yaml" in result.stderr
    assert "apt-get" not in result.stderr
