"""sbatch options as `slurm:` settings, each declared once on its SlurmConfig field: the #SBATCH line, the flags of
`ctrain submit` and `ctrain preflight`, the checks. The options added by declaration alone (qos, constraint,
dependency, exclude, reservation, mail_type, mail_user) reach the rendered header from ctrain.yaml and from their
flag, and each is refused with one `error:` naming its key when it holds a newline, quotes or `$(...)`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from ctrain.cli import main
from ctrain.config import SlurmConfig, load_config
from ctrain.errors import ConfigError
from ctrain.jobs import cli, flags, submit
from ctrain.jobs.options import sbatch_options
from ctrain.jobvalues import KNOWN, SETTING, SHORT, directive_problem
from ctrain.slurmconfig import DIRECTIVE_FIELDS, OPTIONS, SETTINGS, VARIABLES, value_type

# A value sbatch takes for each field that sets an option (a field added without one here fails
# test_every_sbatch_field_is_an_option_flag_and_header_line, so each new option is tried).
GOOD = {"job_name": "demo run", "partition": "gpu", "account": "lab", "qos": "high", "time": "30", "nodes": 2,
        "gpus_per_node": 4, "ntasks_per_node": 2, "cpus_per_task": 16, "mem": "64G", "exclusive": True,
        "constraint": "a100|h100", "signal_lead": 120, "dependency": "afterok:123:456", "exclude": "node[01-04],gpu7",
        "reservation": "maint", "mail_type": "END,FAIL", "mail_user": "me@lab.example.org"}  # fmt: skip
NEW = ["qos", "constraint", "dependency", "exclude", "reservation", "mail_type", "mail_user"]
HOSTILE = ["a\nb", "ok\n#SBATCH --uid=0", 'a"b', "a'b", "$(touch canary)", "x`id`", "a;b", "a b"]


def project(root: Path, slurm: dict[str, object] | None = None) -> Path:
    (root / "ctrain.yaml").write_text(yaml.safe_dump({"slurm": {"runtime": "apptainer", **(slurm or {})}}))
    return root


def header(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def line(name: str) -> str:
    option = OPTIONS[name]
    value = GOOD[name]
    return submit.directive(option, None if value is True else SETTINGS[name].form.format(value))


def test_every_sbatch_field_is_an_option_flag_and_header_line() -> None:
    """Derived, not listed: each field declared with an sbatch option is a flag of submit and preflight under
    sbatch's own name (and letter), an #SBATCH line when set, and, when its value is text, checked as one."""
    assert set(GOOD) == set(OPTIONS), "give GOOD a value for each sbatch option a field declares"
    options = {name: opt for name, opt in OPTIONS.items() if name != "signal_lead"}  # USR1's lead: a setting only
    for command, without in ((cli.submit, set()), (cli.preflight, {"job_name"})):
        params = {param.name: param for param in command.params if isinstance(param, click.Option)}
        for name, option in options.items():
            if name in without:
                assert name not in params
                continue
            assert f"--{option}" in params[name].opts, (command.name, name)
            assert option not in SHORT or f"-{SHORT[option]}" in params[name].opts, (command.name, name)
    for together in ({n for n in OPTIONS if n != "ntasks_per_node"}, {"ntasks_per_node"}):  # one or the other
        config = SlurmConfig(**{name: GOOD[name] for name in together})
        config.validate()
        assert dict(sbatch_options(config)) == {OPTIONS[n]: line(n).partition("=")[2].strip('"') or None
                                                for n in together}  # fmt: skip
    for name, option in OPTIONS.items():
        assert (name in DIRECTIVE_FIELDS) == (value_type(name) is str) and option in KNOWN, name
    assert set(VARIABLES.values()) >= {"CTRAIN_IMAGE", "CTRAIN_LAUNCHER", "CTRAIN_PREFLIGHT", "CTRAIN_PASS_ENV"}
    assert all(SETTING in f.metadata for f in dataclasses.fields(SlurmConfig))


def test_the_flags_of_today_keep_their_names() -> None:
    submit_flags = {opt for param in cli.submit.params for opt in param.opts}
    assert {"--script", "--runtime", "--nodes", "-N", "--time", "-t", "--partition", "-p", "--account", "-A",
            "--gpus-per-node", "--ntasks-per-node", "--cpus-per-task", "-c", "--mem", "--exclusive", "--image",
            "--launcher", "--job-name", "-J", "--dry-run", "--write-script", "--wait", "--cluster"} <= submit_flags
    preflight_flags = {opt for param in cli.preflight.params for opt in param.opts}
    assert {"--nodes", "-N", "--gpus-per-node", "--ntasks-per-node", "--partition", "-p", "--time", "-t", "--runtime",
            "--image", "--quick"} <= preflight_flags  # fmt: skip
    assert flags.flag_names("cpus_per_task") == ["--cpus-per-task", "-c"] and flags.flag_names("image") == ["--image"]


@pytest.mark.parametrize("name", NEW)
def test_a_new_option_reaches_the_header_from_the_config(tmp_path: Path, name: str) -> None:
    config = load_config(project(tmp_path, {name: GOOD[name]}) / "ctrain.yaml")
    job = submit.prepare(config, recipe="recipes/demo-addition.yaml")
    assert line(name) in header(job.text), header(job.text)
    assert job.options[OPTIONS[name]] == GOOD[name]
    preflight = submit.preflight_job(load_config(tmp_path / "ctrain.yaml"), **{name: GOOD[name]})
    assert line(name) in header(preflight.text)


@pytest.mark.parametrize("name", NEW)
def test_a_new_option_reaches_the_header_from_its_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       name: str) -> None:  # fmt: skip
    monkeypatch.chdir(project(tmp_path))
    monkeypatch.setattr(submit, "check", lambda job, **_: [])  # the checks need an image and a cluster
    for flag in flags.flag_names(name):
        result = CliRunner().invoke(main, ["submit", "--dry-run", flag, str(GOOD[name]), "recipes/demo-addition.yaml"])
        assert result.exit_code == 0, result.output
        assert line(name) in header(result.stdout), (flag, header(result.stdout))
    # The flag wins over ctrain.yaml's value.
    project(tmp_path, {name: GOOD[name]})
    other = {"mail_type": "BEGIN", "dependency": "singleton"}.get(name, "other")
    result = CliRunner().invoke(main, ["submit", "--dry-run", f"--{OPTIONS[name]}", other, "recipes/demo-addition.yaml"])
    assert submit.directive(OPTIONS[name], other) in header(result.stdout), header(result.stdout)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_a_new_option_refuses_what_would_escape_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                         value: str) -> None:  # fmt: skip
    if value == "a b" and name == "constraint":  # a constraint expression may hold spaces, written in quotes
        assert submit.directive("constraint", value) == '#SBATCH --constraint="a b"'
        return
    key = f"slurm.{name} (--{OPTIONS[name]})"
    with pytest.raises(ConfigError) as error:
        SlurmConfig(**{name: value}).validate()
    assert str(error.value).startswith(key) and "\n" not in str(error.value), str(error.value)
    with pytest.raises(ConfigError, match=r"ctrain.yaml line \d+: slurm\." + name):
        load_config(project(tmp_path, {name: value}) / "ctrain.yaml")
    monkeypatch.chdir(project(tmp_path))
    result = CliRunner().invoke(main, ["submit", "--dry-run", f"--{OPTIONS[name]}", value, "recipes/x.yaml"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and errors == [result.stderr.strip()] and key in errors[0], result.output
    assert "Traceback" not in result.output and not (tmp_path / "canary").exists()


@pytest.mark.parametrize("name, bad, says", [
    ("mail_type", "END,SOMETIMES", "events joined by , from NONE, BEGIN, END"),
    ("mail_type", "", "is empty"),
    ("dependency", "after123", "TYPE:JOBID[:JOBID...] (afterok:123) or singleton"),
    ("dependency", "afterok:1,afterok:2?afterok:3", "several joined by , (all) or ? (any)"),
    ("qos", "high:low", "is not a QOS name"),
    ("mail_user", "me@", "is not a mail address or user name"),
    ("reservation", "a/b", "is not a reservation's name"),
    ("exclude", "node1:2", "is not a list of nodes"),
])  # fmt: skip
def test_each_new_option_takes_what_sbatch_takes(name: str, bad: str, says: str) -> None:
    with pytest.raises(ConfigError, match=rf"^slurm\.{name} .*{__import__('re').escape(says)}"):
        SlurmConfig(**{name: bad}).validate()


def test_values_sbatch_takes_are_taken_in_settings_and_sbatch_args_alike() -> None:
    for value in ("afterok:123", "singleton", "afterany:1_2:3+10", "afterok:1?afternotok:2", "after:5,singleton"):
        SlurmConfig(dependency=value).validate()
        SlurmConfig(sbatch_args=[f"--dependency={value}"]).validate()
        assert directive_problem(value, "dependency") is None
    for value in ("end", "ALL", "TIME_LIMIT_90,ARRAY_TASKS", "BEGIN,END,FAIL,REQUEUE,INVALID_DEPEND,STAGE_OUT"):
        SlurmConfig(mail_type=value).validate()
    with pytest.raises(ConfigError, match=r"slurm.sbatch_args entry '--mail-type=SOMETIMES': --mail-type is not"):
        SlurmConfig(sbatch_args=["--mail-type=SOMETIMES"]).validate()
    assert directive_problem("a?b", "qos") is not None  # '?' only where sbatch reads it (a dependency's "any")
