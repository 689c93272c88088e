"""The hub names a job needs and the cache check before it is queued (ctrain.train.hubrefs): what a
recipe names, how `ctrain fetch` takes a name, the cache's own index read offline, and the one line
that fixes a job whose names are not there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ctrain.errors import ConfigError
from ctrain.train import fetch
from ctrain.train.hubrefs import HubRef, cached_commit, check_cached, fetch_line, parse, recipe_refs
from ctrain.train.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def snapshot(hub: Path, ref: HubRef, commit: str = COMMIT, branch: str = "main") -> None:
    """A repository in a hub cache as huggingface_hub leaves it: refs/BRANCH holds the commit, and
    snapshots/COMMIT its files."""
    folder = ref.folder(hub)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / branch).write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)


def test_a_recipe_names_its_model_tokenizer_and_data_set_on_the_hub(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(REPO)
    refs = recipe_refs(load_recipe(REPO / "recipes" / "llama-3.1-8b-lora.yaml"))
    assert [(r.kind, r.setting) for r in refs] == [("model", "model.path"), ("dataset", "data.source")]
    assert refs[0].name == "meta-llama/Llama-3.1-8B-Instruct"
    demo = load_recipe(REPO / "recipes" / "demo-addition.yaml")
    assert recipe_refs(demo) == []  # a builtin data set, a model type: nothing on the hub


def test_a_local_model_directory_is_not_a_hub_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "r.yaml").write_text("model: {path: models/tiny}\ntokenizer: {path: org/tok}\n"
                                     "data: {source: org/data, revision: v2}\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    refs = recipe_refs(load_recipe(tmp_path / "r.yaml"))
    assert [(r.kind, r.name, r.revision) for r in refs] == [("model", "org/tok", None), ("dataset", "org/data", "v2")]


@pytest.mark.parametrize(("typed", "dataset", "revision", "shown"), [
    ("Qwen/Qwen2.5-0.5B", False, None, "Qwen/Qwen2.5-0.5B"),
    ("datasets/trl-lib/Capybara", False, None, "datasets/trl-lib/Capybara"),
    ("trl-lib/Capybara", True, None, "datasets/trl-lib/Capybara"),
    ("gpt2@v1.0", False, None, "gpt2@v1.0"),
    ("org/m", False, COMMIT, f"org/m@{COMMIT}"),
])  # fmt: skip
def test_fetch_takes_names_as_the_hub_writes_them(typed: str, dataset: bool, revision: str | None, shown: str) -> None:
    assert parse(typed, dataset=dataset, revision=revision).shown == shown


@pytest.mark.parametrize(("typed", "error"), [
    ("../etc/passwd", "is not a hub repository name"),
    ("org/$(reboot)", "is not a hub repository name"),
    ("org/a/b", "is not a hub repository name"),
    ("org/m@main;rm", "is not a branch, tag or commit"),
    ("org/m@../../x", "is not a branch, tag or commit"),
    ("org/m\nx", "is not a hub repository name"),
    ("org/m\n", "is not a hub repository name"),
    ("org/m@v1\n", "is not a branch, tag or commit"),
    ("org/m'x\"", "is not a hub repository name"),
    ("org/m@v1\n$(reboot)", "is not a branch, tag or commit"),
])  # fmt: skip
def test_a_name_that_is_no_repository_is_refused_before_any_path_is_made_of_it(typed: str, error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse(typed, setting="fetch")


def test_the_cache_index_says_which_revisions_are_there(tmp_path: Path) -> None:
    ref = HubRef("model", "org/m")
    assert cached_commit(tmp_path, ref) is None
    snapshot(tmp_path, ref)
    assert cached_commit(tmp_path, ref) == COMMIT
    assert cached_commit(tmp_path, HubRef("model", "org/m", COMMIT)) == COMMIT
    assert cached_commit(tmp_path, HubRef("model", "org/m", "v2")) is None
    assert cached_commit(tmp_path, HubRef("dataset", "org/m")) is None  # a data set of that name is another repo
    (ref.folder(tmp_path) / "refs" / "main").write_text("not a commit")
    assert cached_commit(tmp_path, ref) is None


def test_a_job_whose_names_are_not_cached_gets_the_one_line_that_fetches_them(tmp_path: Path) -> None:
    model, data = HubRef("model", "org/m", setting="model.path"), HubRef("dataset", "org/d", "v2", setting="data.source")
    with pytest.raises(ConfigError) as caught:
        check_cached(tmp_path, [model, data])
    assert str(caught.value) == (
        f"model.path org/m, data.source datasets/org/d@v2 not in the Hugging Face cache the job mounts ({tmp_path}), "
        "and compute nodes have no internet: run ctrain fetch org/m datasets/org/d@v2 first (on a login node, or "
        "with --cluster)")
    snapshot(tmp_path / "hub", model)
    snapshot(tmp_path / "hub", data, branch="v2")
    check_cached(tmp_path, [model, data])
    assert fetch_line([model, model]) == "ctrain fetch org/m"


def test_fetch_and_the_library_mean_the_same_cache_when_none_is_set(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """ctrain fetch's default cache is the sbatch library's CTRAIN_HF_CACHE default, with HF_HOME set and not."""
    for hf_home in (str(tmp_path / "hf"), None):
        env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "CTRAIN_RUNTIME": "apptainer",
               **({"HF_HOME": hf_home} if hf_home else {})}
        library = subprocess.run(
            ["bash", "-ec", 'source sbatch/lib/settings.sh && ctrain_defaults 2>&1 && echo "$CTRAIN_HF_CACHE"'],
            cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        monkeypatch.setenv("HOME", str(tmp_path))
        if hf_home:
            monkeypatch.setenv("HF_HOME", hf_home)
        else:
            monkeypatch.delenv("HF_HOME", raising=False)
        assert str(fetch.hf_home(None)) == library
    assert fetch.hf_home(tmp_path / "set") == tmp_path / "set"
