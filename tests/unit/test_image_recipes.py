"""The Dockerfile and the Apptainer definitions must not drift apart: same base, environment, install
steps, files, entry point; one pin list. Parsed with spython (the definitions rendered with their
%arguments defaults first, as Apptainer does). The integration tests build both and compare the
installed packages; this catches drift in seconds."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from spython.main.parse.parsers import DockerParser, SingularityParser

from tests.plugins.image import REPO, definition_sections, render_definition

CONTAINERS = REPO / "containers"


def _docker():
    recipes = DockerParser(str(CONTAINERS / "Dockerfile")).recipe
    return list(recipes.values())[-1]  # the final stage


def _definition(name: str, tmp_path: Path, **args: str):
    rendered = tmp_path / name
    rendered.write_text(render_definition(CONTAINERS / name, args))
    return list(SingularityParser(str(rendered)).recipe.values())[-1]


def _names(path: Path) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return [re.split(r"[=<>!~;\[ ]", line, maxsplit=1)[0].lower() for line in lines if line]


def test_standalone_definition_has_the_dockerfiles_base_environment_and_install_steps(tmp_path: Path) -> None:
    docker = _docker()
    standalone = _definition("ctrain-standalone.def", tmp_path, BOOTSTRAP="docker")
    assert standalone.fromHeader == docker.fromHeader  # the same default base image
    assert standalone.environ == [e.replace("${PATH}", "$PATH") for e in docker.environ]
    docker_runs = " ".join(docker.install)
    for step in ("install.sh deps", "install.sh ctrain /opt/ctrain/src", "chmod 1777 /workspace /data /hf_home /outputs"):
        assert step in docker_runs and any(step in line for line in standalone.install), step
    copied = {src for src, _ in docker.files}
    assert {f.split()[0] for f in standalone.files if f.startswith("containers/")} == {
        s for s in copied if s.startswith("containers/")
    }
    docker_labels = {entry[0].split("=", 1)[0] for entry in docker.labels}
    standalone_labels = {label.split()[0] for label in standalone.labels}
    assert docker_labels <= standalone_labels


def test_both_definitions_run_ctrain_and_the_same_self_check(tmp_path: Path) -> None:
    entrypoint = _docker().entrypoint
    sections = {name: definition_sections(CONTAINERS / name) for name in ("ctrain.def", "ctrain-standalone.def")}
    for name in ("runscript", "test", "help"):
        assert sections["ctrain.def"][name] == sections["ctrain-standalone.def"][name], name
    assert f'exec {entrypoint[0]} "$@"' in sections["ctrain.def"]["runscript"]
    assert "/opt/ctrain/build/check.py" in sections["ctrain.def"]["test"]


def test_definition_from_image_needs_an_explicit_image(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="IMAGE"):
        render_definition(CONTAINERS / "ctrain.def", {})
    recipe = _definition("ctrain.def", tmp_path, IMAGE="registry.example.org/ctrain@sha256:" + "0" * 64)
    assert recipe.fromHeader == "registry.example.org/ctrain@sha256:" + "0" * 64


def test_one_pin_list_covers_everything_the_image_installs() -> None:
    pins = dict(line.split("==", 1) for line in (CONTAINERS / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    pinned = {name.lower() for name in pins}
    wanted = _names(CONTAINERS / "requirements.txt")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["train"],
                *project["optional-dependencies"]["deepspeed"]]
    assert {re.split(r"[=<>!~;\[ ]", d, maxsplit=1)[0].lower() for d in declared} <= set(wanted)
    assert set(wanted) <= pinned
    assert len(pins) == len(pinned), "a package is pinned twice"
    for path in ("containers/Dockerfile", "containers/ctrain-standalone.def", "containers/install.sh", "scripts/setup.sh"):
        text = (REPO / path).read_text()
        assert not re.search(r"\b(torch|transformers|trl|datasets|accelerate|deepspeed)==", text), path


def test_build_context_lets_in_only_what_the_dockerfile_copies() -> None:
    patterns = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert patterns[0] == "*"  # an allow-list: .git, .venv, images, tokens never reach the builder
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {src.rstrip("/") for src, _ in _docker().files}
    assert copied == allowed
