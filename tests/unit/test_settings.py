"""Typed settings: unknown keys, wrong types and bad choices are named; overrides apply."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from ctrain.config import ProjectConfig, find_config, load_config
from ctrain.errors import ConfigError
from ctrain.settings import apply_overrides, from_mapping, load_yaml, override, to_mapping


@dataclass
class Inner:
    size: int = 1
    rate: float = 0.5
    mode: Literal["a", "b"] = "a"


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)
    where: Path | None = None
    flag: bool = False

    def validate(self) -> None:
        if self.inner.size > 100:
            raise ConfigError("inner.size must be at most 100")


def test_defaults_and_nested_values() -> None:
    obj = from_mapping(Outer, {"name": "n", "inner": {"size": 3, "rate": 1}, "tags": ["a"], "where": "~/d"})
    assert obj.inner == Inner(size=3, rate=1.0)
    assert isinstance(obj.inner.rate, float)
    assert obj.where == Path("~/d").expanduser()
    assert obj.tags == ["a"]


def test_unknown_key_lists_valid_keys_and_suggests() -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(Outer, {"inner": {"sise": 3}})
    message = str(info.value)
    assert "unknown key 'inner.sise'" in message
    assert "did you mean 'size'" in message
    assert "mode, rate, size" in message


def test_wrong_type_names_the_path() -> None:
    with pytest.raises(ConfigError, match="'inner.size' must be an integer, got 'big'"):
        from_mapping(Outer, {"inner": {"size": "big"}})
    with pytest.raises(ConfigError, match="'flag' must be true or false"):
        from_mapping(Outer, {"flag": "yes"})
    with pytest.raises(ConfigError, match="'inner.size' must be an integer"):
        from_mapping(Outer, {"inner": {"size": True}})


def test_literal_lists_valid_values() -> None:
    with pytest.raises(ConfigError, match="'inner.mode' is 'c'; valid values: a, b"):
        from_mapping(Outer, {"inner": {"mode": "c"}})


@dataclass
class Switch:
    compile: Literal["auto", "layers", "off"] = "auto"


def test_literal_choice_that_yaml_reads_as_a_boolean() -> None:
    """``compile: off`` in a file or ``fast.compile=off`` on the command line: YAML makes it False."""
    assert from_mapping(Switch, apply_overrides({}, ["compile=off"])).compile == "off"
    assert from_mapping(Switch, load_yaml_text("compile: off\n")).compile == "off"
    with pytest.raises(ConfigError, match="'compile' is True; valid values: auto, layers, off"):
        from_mapping(Switch, {"compile": True})


def load_yaml_text(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def test_validate_hook_runs() -> None:
    with pytest.raises(ConfigError, match="at most 100"):
        from_mapping(Outer, {"inner": {"size": 101}})


def test_round_trip() -> None:
    obj = from_mapping(Outer, {"inner": {"mode": "b"}, "where": "/tmp/x"})
    assert from_mapping(Outer, to_mapping(obj)) == obj


def test_overrides_parse_yaml_values() -> None:
    data = apply_overrides({"inner": {"size": 1}}, ["inner.size=7", "inner.rate=2e-3", "name=hello world", "flag=true"])
    obj = from_mapping(Outer, data)
    assert (obj.inner.size, obj.inner.rate, obj.name, obj.flag) == (7, 0.002, "hello world", True)


def test_bad_override_is_clear() -> None:
    with pytest.raises(ConfigError, match="must look like key=value"):
        apply_overrides({}, ["inner.size"])
    with pytest.raises(ConfigError, match="'name' is not a section"):
        apply_overrides({"name": "x"}, ["name.sub=1"])


def test_load_yaml_errors_name_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line 2, column 1: not valid YAML"):
        load_yaml(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping of settings"):
        load_yaml(scalar)
    with pytest.raises(ConfigError, match="cannot read"):
        load_yaml(tmp_path / "missing.yaml")


def test_project_config_found_upwards_and_relative_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CTRAIN_CONFIG", raising=False)
    (tmp_path / "ctrain.yaml").write_text("image:\n  name: team/llm\n  tag: v1\nconvert:\n  output_dir: out/images\n")
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert find_config() == (tmp_path / "ctrain.yaml").resolve()
    config = load_config()
    assert config.image.name == "team/llm" and config.image.tag == "v1"
    assert config.resolve(config.convert.output_dir) == tmp_path.resolve() / "out" / "images"


def test_project_config_unknown_key_names_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "ctrain.yaml"
    path.write_text("imgae:\n  name: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "did you mean 'image'" in str(info.value)


def test_no_config_gives_defaults(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CTRAIN_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert load_config() == ProjectConfig()


def test_env_config_must_exist(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CTRAIN_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="CTRAIN_CONFIG points at"):
        find_config()


# --- override: command-line flags on top of a section -----------------------------------------------


@dataclass
class Checked:
    """A section whose construction and validate() both check."""

    low: int = 0
    high: int = 10
    mode: Literal["fast", "safe"] = "safe"
    where: Path | None = None
    built: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.low < 0:
            raise ConfigError("low must not be negative")
        self.built += 1

    def validate(self) -> None:
        if self.low > self.high:
            raise ConfigError(f"need low <= high, got {self.low} > {self.high}")


def test_override_applies_converts_and_leaves_the_original() -> None:
    original = Checked()
    changed = override(original, {"high": 20, "mode": "fast", "where": "~/d"}, where="sec")
    assert (changed.high, changed.mode, changed.where) == (20, "fast", Path("~/d").expanduser())
    assert original == Checked() and changed is not original


def test_override_ignores_none() -> None:
    original = Checked(low=2, high=5)
    changed = override(original, {"low": None, "high": None, "mode": None})
    assert changed == original


def test_override_rejects_unknown_key_listing_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'sec.hihg' \(did you mean 'high'\?\); valid keys under sec: "
                       "high, low, mode, where") as info:  # fmt: skip
        override(Checked(), {"hihg": 3}, where="sec")
    assert info.value.key == "sec.hihg"
    with pytest.raises(ConfigError, match="unknown key 'nope'"):  # even when the flag was not given
        override(Checked(), {"nope": None})


def test_override_type_checks_as_from_mapping_does() -> None:
    with pytest.raises(ConfigError, match="'sec.high' must be an integer, got 'many'"):
        override(Checked(), {"high": "many"}, where="sec")
    with pytest.raises(ConfigError, match="'sec.mode' is 'quick'; valid values: fast, safe"):
        override(Checked(), {"mode": "quick"}, where="sec")
    with pytest.raises(ConfigError, match="'flag' must be true or false"):
        override(Outer(), {"flag": "yes"})


def test_override_reruns_post_init_and_validate() -> None:
    original = Checked()
    original.built = 5
    assert override(original, {"low": 1}).built == 1  # constructed again, not copied
    with pytest.raises(ConfigError, match="low must not be negative"):
        override(Checked(), {"low": -1})
    with pytest.raises(ConfigError, match="need low <= high, got 11 > 10"):
        override(Checked(), {"low": 11})
    with pytest.raises(ConfigError, match="inner.size must be at most 100"):
        override(Outer(), {"inner": {"size": 101}})


def test_override_on_project_sections() -> None:
    config = ProjectConfig()
    assert override(config.slurm, {"nodes": 2, "time": "01:00:00"}, where="slurm").nodes == 2
    with pytest.raises(ConfigError, match="'slurm.launcher' is 'mpirun'"):
        override(config.slurm, {"launcher": "mpirun"}, where="slurm")
    with pytest.raises(ConfigError, match="image.tag"):
        override(config.image, {"tag": "a b"}, where="image")
    with pytest.raises(TypeError):
        override(Checked, {"low": 1})


# --- hostile files and keys -----------------------------------------------------------------------


class Blocked(Exception):
    """Not an OSError (as TimeoutError is), so no reader's ``except OSError`` can swallow it."""


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail, instead of hanging the suite, when the block is still blocked after ``seconds`` (a FIFO)."""

    def expire(*_: object) -> None:
        raise Blocked(f"still blocked after {seconds}s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_a_settings_file_that_is_a_device_or_a_fifo_is_refused_unread(tmp_path: Path) -> None:
    """st_size is 0 for both: a device (/dev/zero) would be read until memory ran out, a FIFO forever."""
    device = tmp_path / "device.yaml"
    device.symlink_to("/dev/null")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path in (device, fifo):
        with within(5), pytest.raises(ConfigError, match=f"{re.escape(str(path))} is not a regular file"):
            load_yaml(path)


@pytest.mark.parametrize("key, reads_as", [("yes", "true/false"), ("Off", "true/false"), ("~", "null"),
                                           ("null", "null")])  # fmt: skip
def test_a_key_yaml_reads_as_a_boolean_or_null_is_named_as_written_with_its_line(tmp_path: Path, key: str,
                                                                                   reads_as: str) -> None:  # fmt: skip
    path = tmp_path / "ctrain.yaml"
    path.write_text(f"slurm:\n  nodes: 1\n{key}: 1\n")
    with pytest.raises(ConfigError, match=rf"line 3: the key '{re.escape(key)}' is read by YAML as .*{reads_as}"):
        load_config(path)
    path.write_text(f"'{key}': 1\n")  # quoted it is a name: an unknown key, by the name written
    with pytest.raises(ConfigError, match=rf"line 1: unknown key '{re.escape(key)}'"):
        load_config(path)


@pytest.mark.parametrize("item", [".=5", "a..b=5", "training.=5", " . =1"])
def test_an_override_with_an_empty_name_is_blamed_on_the_override(item: str) -> None:
    with pytest.raises(ConfigError, match=rf"^override {re.escape(repr(item))}: .* is not a setting's name"):
        apply_overrides({}, [item])


def test_a_project_config_that_is_no_regular_file_is_an_error_not_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skipped, it would run on defaults without a word; --config /dev/null would make /dev the project."""
    monkeypatch.delenv("CTRAIN_CONFIG", raising=False)
    for made, says in [(lambda p: p.symlink_to(tmp_path / "gone.yaml"), "(a symbolic link to nothing)"),
                       (lambda p: p.mkdir(), "is a directory"),
                       (lambda p: p.symlink_to("/dev/null"), "is not a regular file")]:  # fmt: skip
        here = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        here.mkdir()
        made(here / "ctrain.yaml")
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(find_config(here))
    with pytest.raises(ConfigError, match="/dev/null is not a regular file"):
        load_config(Path("/dev/null"))


# --- YAML 1.1's base-60 numbers ------------------------------------------------------------------


def test_a_time_written_without_quotes_stays_the_time_written(tmp_path: Path) -> None:
    """PyYAML's YAML 1.1 reads 1:00:00 as 3600 (base 60), which Slurm would take as 3600 minutes."""
    from ctrain.jobs import submit

    (tmp_path / "ctrain.yaml").write_text("slurm:\n  time: 1:00:00\n")
    config = load_config(tmp_path / "ctrain.yaml")
    assert config.slurm.time == "1:00:00"
    assert "#SBATCH --time=1:00:00\n" in submit.prepare(config, recipe="recipes/demo-addition.yaml").text
    (tmp_path / "recipe.yaml").write_text("a: 1:30\nb: 30:00\nc: -1:30.5\nd: 90\ne: 1.5\n")
    assert load_yaml(tmp_path / "recipe.yaml") == {"a": "1:30", "b": "30:00", "c": "-1:30.5", "d": 90, "e": 1.5}
    assert apply_overrides({}, ["slurm.time=30:00"]) == {"slurm": {"time": "30:00"}}


def test_a_default_override_sets_only_what_nothing_set_before_it() -> None:
    """``KEY?=VALUE`` (how the deepspeed launcher offers its config): the file's value and an earlier
    override stay; a missing or null key gets it; a plain override after it still wins."""
    data = apply_overrides({"inner": {"size": 1, "rate": None}}, ["inner.size?=7", "inner.rate?=0.5", "name?=x"])
    assert data == {"inner": {"size": 1, "rate": 0.5}, "name": "x"}
    assert apply_overrides({}, ["name=mine", "name?=theirs"]) == {"name": "mine"}
    assert apply_overrides({}, ["name?=theirs", "name=mine"]) == {"name": "mine"}
