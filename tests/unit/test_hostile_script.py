"""Hostile values in every setting that reaches the job script `ctrain submit` renders (from a shared
ctrain.yaml or the command line): each is refused with one `error:`-style message naming its key, or
the script holds exactly the intended #SBATCH directives, exports and arguments, and running its
settings runs nothing else."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
import yaml

from ctrain.config import DIRECTIVE_FIELDS, directive_problem, load_config
from ctrain.files import control_problem
from ctrain.errors import ConfigError
from ctrain.jobs import submit

CANARY = "ctrain-canary"
# Pieces that end a line, quote, substitute, chain or comment in bash or in sbatch's directive parser.
PIECES = ["\n", "\r", "\0", "\t", "\x1b", "'", '"', "\\", f"$(touch {CANARY})", f"`touch {CANARY}`",
          f"; touch {CANARY}", f"\ntouch {CANARY}\n", "&&", "|", ">", "<", " ", "#", "${HOME}", "$HOME", "%j", "=",
          ",", ":", "*", "~", "--x=1", "a", "b1", "/x", "-", "ü"]  # fmt: skip
SEED = 20261127
# One value of each field that renders (other fields: "gpu"); every sbatch option a field declares is here by itself.
BENIGN = {"time": "10", "image": "images/y.sif", "mem": "8G", "dependency": "afterok:123", "mail_type": "END,FAIL"}
CASES_PER_FIELD = 12


def values(field: str) -> list[str]:
    """Fixed nasty values, then random joins of PIECES (seeded: the same cases every run)."""
    rng = random.Random(f"{SEED}-{field}")
    fixed = [f"ok\ntouch {CANARY}", f"x$(touch {CANARY})", f"x`touch {CANARY}`", "a;b", "x\0y", "'", "a b", BENIGN.get(field, "gpu")]
    return fixed + ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6))) for _ in range(CASES_PER_FIELD)]


# Settings of the `slurm:` section that reach the script, with how a value is placed there.
STRING_FIELDS = [*DIRECTIVE_FIELDS, "image", "data", "hf_cache", "outputs", "deepspeed_config", "accelerate_config",
                 "recipe"]  # fmt: skip
OTHER = ["sbatch_args", "mounts", "env", "argument"]

BASE = {"runtime": "apptainer", "nodes": 2, "image": "images/x.sif", "launcher": "deepspeed", "job_name": "base"}


def render(tmp_path: Path, slurm: dict[str, object], arguments: tuple[str, ...] = ()) -> submit.Job:
    (tmp_path / "ctrain.yaml").write_text(yaml.safe_dump({"slurm": slurm}, allow_unicode=True))
    config = load_config(tmp_path / "ctrain.yaml")
    recipe, *overrides = arguments or ("recipes/demo-addition.yaml",)
    return submit.prepare(config, recipe=recipe, overrides=tuple(overrides))


def settings_of(job: submit.Job, cwd: Path) -> tuple[dict[str, str], list[str]]:
    """Run the script's settings block in bash: the CTRAIN_*/env exports and the arguments it sets."""
    text = job.text
    block = text[text.index("# --- settings from ctrain.yaml") : text.index("# --- sbatch/lib/ctrain.sh, inlined")]
    names = " ".join(name for name in ("NCCL_X",) if f"export {name}=" in block)
    probe = (block + '\nfor v in "${!CTRAIN_@}" ' + names + '; do printf "%s=%s\\0" "$v" "${!v}"; done\n'
             'printf "ARG=%s\\0" "$@"\n')  # fmt: skip
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, cwd=cwd, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout  # fmt: skip
    pairs = [item.partition("=") for item in out.split("\0") if item]
    exports = {name: value for name, _, value in pairs if name != "ARG"}
    return exports, [value for name, _, value in pairs if name == "ARG"]


def check_safe(job: submit.Job, baseline: submit.Job, tmp_path: Path) -> tuple[dict[str, str], list[str]]:
    """Only the settings and the header may differ from the baseline, each #SBATCH line is one
    option with a plain value, the whole script parses, and its settings run no command."""
    library = "# --- sbatch/lib/ctrain.sh, inlined"
    assert job.text.split(library, 1)[1] == baseline.text.split(library, 1)[1]
    for line in job.text.splitlines():
        if line.startswith("#SBATCH"):
            value = line.partition("=")[2]
            if value.startswith('"'):  # a value with spaces, in the quotes sbatch removes (config.SPACED_OPTIONS)
                assert value.endswith('"') and not set("'\"\\$`;#") & set(value[1:-1]) and value[1:-1].strip(), line
            else:
                assert len(line.split()) == 2 and not set("'\"\\$`;") & set(line), line
    assert "\0" not in job.text and "\r" not in job.text
    subprocess.run(["bash", "-n"], input=job.text, text=True, check=True)
    result = settings_of(job, tmp_path)
    assert not (tmp_path / CANARY).exists(), "a value ran as a command"
    return result


def refused_clearly(error: ConfigError, key: str) -> None:
    message = str(error)
    assert "\n" not in message and "\0" not in message, message
    assert key in message, (key, message)
    assert len(message) < 400, message


@pytest.mark.parametrize("field", [*STRING_FIELDS, *OTHER])
def test_every_value_that_reaches_the_script_is_refused_or_inert(field: str, tmp_path: Path) -> None:
    (tmp_path / "recipes").mkdir()
    baseline = render(tmp_path, BASE)
    rendered = refused = 0
    for value in values(field):
        slurm: dict[str, object] = dict(BASE)
        arguments: tuple[str, ...] = ()
        key = f"slurm.{field}"
        if field == "sbatch_args":
            slurm["sbatch_args"] = [f"--comment={value}"]
            key = "slurm.sbatch_args"
        elif field == "mounts":
            slurm["mounts"] = [f"/host/{value}:/inside"]
        elif field == "env":
            slurm["env"] = {"NCCL_X": value}
            key = "NCCL_X"
        elif field == "argument":
            arguments = ("recipes/demo-addition.yaml", f"training.run_name={value}")
            key = "the argument"
        else:
            slurm[field] = value
            key = "image" if field == "image" else key  # also --image or IMAGE: messages say "the image"
        # A control character anywhere, or a directive's value outside what Slurm's values are made of,
        # must be refused; other values may be refused for what they are (a bad image reference).
        option = DIRECTIVE_FIELDS.get(field, "comment")  # sbatch_args: --comment=VALUE
        must_refuse = control_problem(value) or (field in (*DIRECTIVE_FIELDS, "sbatch_args")
                                                 and directive_problem(value, option))  # fmt: skip
        try:
            job = render(tmp_path, slurm, arguments)
        except ConfigError as error:
            refused_clearly(error, key)
            refused += 1
            continue
        assert not must_refuse, (field, value, must_refuse)
        rendered += 1
        exports, args = check_safe(job, baseline, tmp_path)
        if field in DIRECTIVE_FIELDS or field == "sbatch_args":
            assert submit.directive(option, value) in job.text.splitlines()
        elif field == "env":
            assert exports["NCCL_X"] == value
        elif field == "argument":
            assert args == list(arguments)
        elif field == "recipe":
            assert args == ["recipes/demo-addition.yaml"]  # the command line's recipe wins
        elif field == "mounts":
            assert exports["CTRAIN_MOUNTS"] == f"/host/{value}:/inside"
        elif field == "image":
            assert exports["CTRAIN_IMAGE"] in (value, str(tmp_path / value))
        else:
            assert any(value in exported for exported in exports.values()), (value, exports)
    # Each field saw both outcomes: the checks are not refusing everything.
    assert refused and rendered, (field, rendered, refused)


def test_a_newline_in_the_account_from_the_command_line_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ctrain.yaml").write_text("slurm:\n  runtime: apptainer\n")
    config = load_config(tmp_path / "ctrain.yaml")
    with pytest.raises(ConfigError) as error:
        submit.prepare(config, account="proj\ntouch /tmp/x")
    assert str(error.value) == (
        "slurm.account (--account) 'proj\\ntouch /tmp/x' contains '\\n'; an sbatch option's value here may hold "
        "letters, digits and _.,:@+%&|!()[]*=/~^{}- only"
    )
