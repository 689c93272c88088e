"""``ctrain init`` (refuse, --force, --upgrade) and ``ctrain.resources``, the one place that finds
ctrain's own files, in agreement with the build hook that packages them."""

from __future__ import annotations

import ast
import errno
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain import files, project, protocol, resources
from ctrain.errors import ConfigError
from ctrain.jobs import submit
from ctrain.cli import main
from ctrain.config import load_config

REPO = Path(__file__).resolve().parents[2]


def ctrain(*args: str | os.PathLike[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def new(tmp_path: Path) -> Path:
    path = tmp_path / "proj"
    code, _, err = ctrain("init", path)
    assert code == 0, err
    return path


# --- resources ------------------------------------------------------------------------------------


def test_resources_come_from_the_checkout_in_dev_mode() -> None:
    assert resources.is_checkout()
    assert resources.root() == REPO
    assert resources.path("sbatch", "lib", "ctrain.sh") == REPO / "sbatch" / "lib" / "ctrain.sh"
    assert resources.display(REPO / "cluster" / "pcluster.yaml") == "cluster/pcluster.yaml"


def test_resources_refuse_what_ctrain_does_not_ship() -> None:
    with pytest.raises(ValueError):
        resources.path("tests")


def test_build_hook_and_sdist_package_what_resources_finds() -> None:
    tree_ = ast.parse((REPO / "setup.py").read_text())
    data = next(
        ast.literal_eval(node.value)
        for node in tree_.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "DATA"
    )
    assert tuple(data) == resources.DIRECTORIES
    grafts = {line.split()[1] for line in (REPO / "MANIFEST.in").read_text().splitlines() if line.startswith("graft ")}
    assert set(resources.DIRECTORIES) <= grafts
    assert all((REPO / name).is_dir() for name in resources.DIRECTORIES)


def test_no_module_counts_parent_directories_to_find_ctrains_files() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "src" / "ctrain").rglob("*.py")
        if p.name != "resources.py" and ".parents[" in p.read_text()
    ]
    assert offenders == []


def test_submit_uses_the_projects_scripts_else_the_shipped_ones(tmp_path: Path, new: Path) -> None:
    assert submit.scripts_dir(new) == new / "sbatch"
    assert submit.scripts_dir(tmp_path / "empty") == REPO / "sbatch"


# --- init -----------------------------------------------------------------------------------------


def test_init_writes_a_project_whose_files_are_ctrains(new: Path) -> None:
    written = tree(new)
    for rel in [*resources.files("sbatch"), *resources.files("containers"), *resources.files("recipes")]:
        assert written[str(rel)] == (REPO / rel).read_bytes(), rel
    assert {"ctrain.yaml", ".gitignore", str(project.MANIFEST)} <= set(written)
    manifest = json.loads(written[str(project.MANIFEST)])
    assert set(manifest["files"]) == set(written) - {str(project.MANIFEST)}


def test_the_starter_config_is_valid_and_names_the_choices(new: Path) -> None:
    config = load_config(new / "ctrain.yaml")
    assert config.slurm.runtime == "apptainer"
    assert config.slurm.recipe is not None and (new / config.slurm.recipe).is_file()
    text = (new / "ctrain.yaml").read_text()
    for choice in ("runtime:", "image:", "partition:", "account:", "gpus_per_node:"):
        assert choice in text, choice


def test_the_gitignore_covers_what_ctrain_writes(new: Path) -> None:
    ignored = (new / ".gitignore").read_text().splitlines()
    config = load_config(new / "ctrain.yaml")
    for directory in (config.convert.output_dir, Path("outputs"), Path("logs")):
        assert f"/{directory}/" in ignored, directory


@pytest.mark.parametrize("existing", ["ctrain.yaml", "sbatch/lib/ctrain.sh", "recipes/demo-addition.yaml"])
def test_init_refuses_to_overwrite_and_writes_nothing(tmp_path: Path, existing: str) -> None:
    (tmp_path / existing).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / existing).write_text("mine\n")
    before = tree(tmp_path)
    code, _, err = ctrain("init", tmp_path)
    assert code != 0
    assert err.startswith("error: ") and err.count("\n") == 1 and existing in err and "--force" in err
    assert tree(tmp_path) == before


def test_init_refuses_a_file_as_the_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    code, _, err = ctrain("init", tmp_path / "f")
    assert code != 0 and err.startswith("error: ") and "Traceback" not in err


def test_init_takes_back_what_it_wrote_when_the_disk_fills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = files.atomic_write_text
    calls = []

    def filling(path: Path, text: str) -> None:
        calls.append(path)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, text)

    monkeypatch.setattr(files, "atomic_write_text", filling)
    code, _, err = ctrain("init", tmp_path / "proj")
    assert code != 0 and err.startswith("error: ") and "space" in err
    assert tree(tmp_path) == {}


def test_force_refreshes_ctrains_files_and_keeps_the_users(new: Path) -> None:
    lib = new / "sbatch" / "lib" / "ctrain.sh"
    lib.write_text("edited\n")
    (new / "recipes" / "demo-addition.yaml").write_text("my recipe\n")
    (new / "ctrain.yaml").write_text("slurm:\n  partition: mine\n")
    (new / "containers" / "Dockerfile").unlink()
    code, _, err = ctrain("init", "--force", new)
    assert code == 0, err
    assert lib.read_bytes() == (REPO / "sbatch" / "lib" / "ctrain.sh").read_bytes()
    assert (new / "containers" / "Dockerfile").read_bytes() == (REPO / "containers" / "Dockerfile").read_bytes()
    assert (new / "recipes" / "demo-addition.yaml").read_text() == "my recipe\n"
    assert (new / "ctrain.yaml").read_text() == "slurm:\n  partition: mine\n"
    assert "kept ctrain.yaml" in err and "kept recipes/demo-addition.yaml" in err
    assert "replaced sbatch/lib/ctrain.sh" in err and "your edited copy is in sbatch/lib/ctrain.sh.edited" in err
    assert (new / "sbatch" / "lib" / "ctrain.sh.edited").read_text() == "edited\n"  # nothing the user wrote is lost


def test_force_twice_keeps_every_edit_byte_for_byte(new: Path) -> None:
    """A second edit and --force must not overwrite the first edit's copy, and bytes that are not UTF-8 stay."""
    lib = new / "sbatch" / "lib" / "ctrain.sh"
    lib.write_bytes(b"first edit\n")
    assert ctrain("init", "--force", new)[0] == 0
    lib.write_bytes(b"second edit \xff\n")
    code, _, err = ctrain("init", "--force", new)
    assert code == 0, err
    assert "your edited copy is in sbatch/lib/ctrain.sh.edited.1" in err
    assert (new / "sbatch/lib/ctrain.sh.edited").read_bytes() == b"first edit\n"
    assert (new / "sbatch/lib/ctrain.sh.edited.1").read_bytes() == b"second edit \xff\n"
    assert lib.read_bytes() == (REPO / "sbatch" / "lib" / "ctrain.sh").read_bytes()


def test_a_manifest_nested_too_deep_is_one_error(new: Path) -> None:
    from ctrain.project import MANIFEST

    (new / MANIFEST).write_text('{"files":' + "[" * 50_000 + "]" * 50_000 + "}")
    code, _, err = ctrain("init", "--force", new)
    assert code != 0 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "nests deeper than 64 levels" in err and "ctrain init --force" in err


def test_a_new_project_has_what_its_recipes_errors_and_jobs_refer_to(new: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """configs/ (the DeepSpeed and accelerate configs the ZeRO-3 recipe and --launcher deepspeed
    name), `ctrain docs NAME` for every docs/NAME.md the scripts cite (no copy of the documentation
    in the project), and a .gitignore for the job state."""
    for rel in resources.files("configs"):
        assert (new / rel).read_bytes() == (REPO / rel).read_bytes(), rel
    assert not (new / "docs").exists()
    cited = {m for p in (new / "sbatch").rglob("*") if p.is_file() for m in re.findall(r"docs/(\w+)\.md", p.read_text())}
    assert cited
    for name in cited:
        code, out, err = ctrain("docs", name)
        assert code == 0 and out == (REPO / "docs" / f"{name}.md").read_text(), err
    assert "/.ctrain/" in (new / ".gitignore").read_text().splitlines()
    monkeypatch.chdir(new)
    code, out, err = ctrain("train", "--check", "recipes/llama-3.1-8b-sft-zero3.yaml")
    assert code == 0 and "is valid" in out, err


def test_force_refreshes_a_users_file_that_is_an_unchanged_older_copy(new: Path) -> None:
    """A recipe init wrote from an older ctrain and nobody edited: the manifest's hash still matches."""
    recipe = new / "recipes" / "demo-addition.yaml"
    recipe.write_text("what an older ctrain shipped\n")
    manifest = json.loads((new / project.MANIFEST).read_text())
    manifest["files"]["recipes/demo-addition.yaml"] = project._sha256("what an older ctrain shipped\n")
    (new / project.MANIFEST).write_text(json.dumps(manifest))
    assert ctrain("init", "--force", new)[0] == 0
    assert recipe.read_bytes() == (REPO / "recipes" / "demo-addition.yaml").read_bytes()


def test_upgrade_reports_nothing_for_a_fresh_project(new: Path) -> None:
    code, out, err = ctrain("init", "--upgrade", new)
    assert code == 0 and out == "" and "0 of ctrain's files differ" in err


def test_upgrade_fails_when_ctrains_files_differ_and_lists_the_users(new: Path) -> None:
    (new / "sbatch" / "pyxis.sbatch").write_text("#!/bin/bash\n")
    (new / "containers" / "install.sh").unlink()
    (new / "recipes" / "demo-addition.yaml").write_text("mine\n")
    before = tree(new)
    code, out, err = ctrain("init", "--upgrade", new)
    assert code == 1
    rows = {tuple(line.split()) for line in out.splitlines()[1:]}
    assert rows == {
        ("sbatch/pyxis.sbatch", "ctrain's", "edited"),
        ("containers/install.sh", "ctrain's", "missing"),
        ("recipes/demo-addition.yaml", "yours", "edited"),
    }
    assert "2 of ctrain's files differ" in err and "--force" in err
    assert tree(new) == before


def test_upgrade_passes_when_only_the_users_files_differ(new: Path) -> None:
    (new / "ctrain.yaml").write_text("slurm:\n  runtime: pyxis\n")
    code, out, _ = ctrain("init", "--upgrade", new)
    assert code == 0 and "ctrain.yaml" in out


def test_upgrade_of_a_directory_that_is_no_project(tmp_path: Path) -> None:
    code, _, err = ctrain("init", "--upgrade", tmp_path)
    assert code != 0 and err.startswith("error: ") and "ctrain init" in err


def test_force_and_upgrade_exclude_each_other(new: Path) -> None:
    code, _, err = ctrain("init", "--force", "--upgrade", new)
    assert code != 0 and err.startswith("error: ")


# --- ctrain build from a project ------------------------------------------------------------------


def test_a_checkout_is_its_own_build_context() -> None:
    from ctrain.image import build

    with build.source_context(REPO) as context:
        assert context == REPO


def test_a_project_builds_from_its_containers_and_the_running_ctrain(new: Path) -> None:
    from ctrain.image import build

    dockerfile = new / "containers" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "# the project's pins\n")
    with build.source_context(new) as context:
        assert context != new
        build.check_context(context, "buildah")
        build.check_context(context, "apptainer")
        assert (context / "containers" / "Dockerfile").read_text().endswith("# the project's pins\n")
        assert (context / "pyproject.toml").read_bytes() == (REPO / "pyproject.toml").read_bytes()
        staged = {str(p.relative_to(context / "src")) for p in (context / "src").rglob("*") if p.is_file()}
        source = {str(p.relative_to(REPO / "src")) for p in (REPO / "src" / "ctrain").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip
        assert staged == source
        assert build.source_version(context) == build.source_version(REPO)
    assert not context.exists()


def test_a_directory_without_containers_builds_from_ctrains_own(tmp_path: Path) -> None:
    from ctrain.image import build

    with build.source_context(tmp_path) as context:
        assert (context / "containers" / "install.sh").read_bytes() == (REPO / "containers" / "install.sh").read_bytes()


def test_convert_uses_the_projects_definition_else_ctrains(tmp_path: Path, new: Path) -> None:
    from ctrain.image import convert

    assert convert.definition(new) == new / "containers" / "ctrain.def"
    assert convert.definition(tmp_path / "elsewhere") == REPO / "containers" / "ctrain.def"


def laptop_dry_run(project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   *args: str) -> tuple[str, str]:  # fmt: skip
    """`ctrain submit --dry-run --nodes 2 [ARGS] recipes/demo-addition.yaml` in ``project`` on a laptop:
    bash (ctrain checks the rendered script with bash -n) and no Slurm on PATH; its stdout and stderr."""
    monkeypatch.chdir(project)
    laptop = tmp_path / "bin"
    laptop.mkdir()
    (laptop / "bash").symlink_to(shutil.which("bash"))
    monkeypatch.setenv("PATH", str(laptop))
    code, out, err = ctrain("submit", "--dry-run", "--nodes", "2", *(args or ["recipes/demo-addition.yaml"]))
    assert code == 0, err
    return out, err


@pytest.mark.parametrize(("recipe", "extra", "gets", "source"), [
    ("recipes/llama-3.1-8b-sft-zero3.yaml", [], "configs/deepspeed/zero3.json", "the recipe's"),
    ("recipes/demo-addition.yaml", [], "configs/deepspeed/zero2.json", "the launcher's"),
    ("recipes/llama-3.1-8b-sft-zero3.yaml", ["training.deepspeed=configs/deepspeed/zero2.json"],
     "configs/deepspeed/zero2.json", "the recipe's or an override's"),
])  # fmt: skip
def test_the_recipes_deepspeed_config_wins_over_the_launchers_and_the_dry_run_names_it(
    new: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str, extra: list[str], gets: str, source: str
) -> None:
    """--launcher deepspeed offers CTRAIN_DEEPSPEED_CONFIG as a default (training.deepspeed?=): the ZeRO-3
    recipe keeps its zero3.json, a recipe naming none gets the launcher's zero2.json, an override wins
    over both; the dry run says which, and the recipe loaded with the script's own overrides agrees."""
    from ctrain.train.recipe import load_recipe

    out, err = laptop_dry_run(new, tmp_path, monkeypatch, "--launcher", "deepspeed", recipe, *extra)
    assert f"note: DeepSpeed config the ranks get: {gets} ({source}" in err, err
    arguments = re.search(r"^set -- (.*)$", out, re.MULTILINE)
    assert arguments, out[-2000:]
    words = shlex.split(arguments.group(1))
    assert words[0] == recipe and words[1:] == extra
    added = protocol.launcher_overrides("deepspeed", "configs/deepspeed/zero2.json", own_command=False)
    assert load_recipe(new / recipe, [*extra, *added]).training.deepspeed == gets


def test_a_new_projects_dry_run_shows_the_script_before_any_image_exists(
    new: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What init's "next:" line sends a newcomer to, on a laptop (no Slurm on PATH), before `ctrain
    build`: the script with the image path it will use, and one warning that the image is missing.
    A real submit of the same refuses, before anything is queued."""
    out, err = laptop_dry_run(new, tmp_path, monkeypatch)
    image = new / "images" / "ctrain-latest.sif"
    assert f"export CTRAIN_IMAGE={image}" in out
    assert f"warning: image {image} does not exist" in err and "this dry run does not" in err
    code, out, err = ctrain("submit", "--write-script", str(tmp_path / "job.sbatch"), "recipes/demo-addition.yaml")
    assert code != 0 and f"error: image {image} does not exist" in err
    assert not (tmp_path / "job.sbatch").exists()


def test_one_setting_switches_a_new_project_to_pyxis(new: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """slurm.runtime: pyxis, and nothing else: convert writes a squashfs, the job runs it, and the
    missing image is named as the .sqsh that `ctrain convert` will write."""
    config = new / "ctrain.yaml"
    config.write_text(config.read_text().replace("  runtime: apptainer\n", "  runtime: pyxis\n"))
    loaded = load_config(config)
    assert loaded.slurm.runtime == "pyxis" and loaded.image_format == "sqsh"
    out, err = laptop_dry_run(new, tmp_path, monkeypatch)
    image = new / "images" / "ctrain-latest.sqsh"
    assert f"export CTRAIN_IMAGE={image}" in out and "--container-image" in out
    assert f"image {image} does not exist: build and convert it (`ctrain build && ctrain convert --to sqsh`)" in err
    assert ".sif" not in err


def test_submit_says_when_the_projects_scripts_are_behind_and_refuses_newer_ones(new: Path) -> None:
    """The library carries CTRAIN_LIB_VERSION and a line per version: a project's copy from an older
    ctrain gets a warning naming what it misses and the fix; one from a newer ctrain is refused."""
    lib = new / "sbatch" / "lib" / "ctrain.sh"
    text = lib.read_text()
    current = submit.library_version(text)
    assert current >= 2 and submit.library_notes(lib) == []
    lib.write_text(text.replace(f"CTRAIN_LIB_VERSION={current}\n", ""))  # a copy from before the versions
    (note,) = submit.library_notes(lib)
    assert note.startswith(f"warning: the project's sbatch/ is version 1 of ctrain's sbatch library and this ctrain "
                           f"has version {current}; it misses: the container gets only the host variables")  # fmt: skip
    assert "ctrain init --force" in note
    lib.write_text(text.replace(f"CTRAIN_LIB_VERSION={current}\n", f"CTRAIN_LIB_VERSION={current + 1}\n"))
    with pytest.raises(ConfigError, match=f"is version {current + 1} of the sbatch library, from a newer ctrain"):
        submit.library_notes(lib)


def test_a_recipe_path_is_typed_relative_to_where_you_are(new: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """As for `ctrain train`: in the project's recipes/, `submit demo-addition.yaml` is that file, and
    the job gets it relative to the project directory, where it runs."""
    assert submit.from_here("recipes/demo-addition.yaml", new) == "recipes/demo-addition.yaml"  # from anywhere
    monkeypatch.chdir(new / "recipes")
    assert submit.from_here("demo-addition.yaml", new) == "recipes/demo-addition.yaml"
    assert submit.from_here("recipes/demo-addition.yaml", new) == "recipes/demo-addition.yaml"  # no file here
    monkeypatch.chdir(new / "recipes")
    monkeypatch.setattr(submit, "check", lambda job, **_: [])
    code, out, err = ctrain("submit", "--dry-run", "demo-addition.yaml", "training.max_steps=5")
    assert code == 0, err
    assert "recipes/demo-addition.yaml training.max_steps=5" in out


def test_a_project_path_no_container_can_mount_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    code, _, err = ctrain("init", tmp_path / "my:proj")
    assert code == 2 and err.startswith("error: ") and "':'" in err and "--bind" in err, err
    assert not (tmp_path / "my:proj").exists()


def test_docs_lists_the_installed_pages_and_names_the_closest_to_a_misspelt_one() -> None:
    code, out, _ = ctrain("docs")
    listed = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert code == 0 and listed["sbatch"] == str(resources.root() / "docs" / "sbatch.md")
    code, _, err = ctrain("docs", "sbach")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: no documentation page 'sbach' (did you mean 'sbatch'?); the pages: ")


def test_docs_lists_and_shows_the_guides_by_their_path_or_their_own_name() -> None:
    """The guides by task (docs/guides/) are installed pages too: listed as guides/NAME after the
    top-level pages, shown by guides/NAME, docs/guides/NAME.md or NAME alone, and a misspelt one is
    named; a top-level page keeps its short name."""
    guides = sorted(p.stem for p in (REPO / "docs" / "guides").glob("*.md"))
    assert {"offline-nodes", "choose-a-strategy", "move-to-pyxis", "read-a-failure-line", "run-a-sweep"} <= set(guides)
    code, out, err = ctrain("docs")
    assert code == 0, err
    names = [line.split(maxsplit=1)[0] for line in out.splitlines()]
    listed = dict(line.split(maxsplit=1) for line in out.splitlines())
    for name in guides:
        assert listed[f"guides/{name}"] == str(resources.root() / "docs" / "guides" / f"{name}.md")
    assert names.index("sbatch") < names.index("guides/offline-nodes") < names.index("log/2026-11-21-image")
    text = (REPO / "docs" / "guides" / "offline-nodes.md").read_text()
    for asked in ("guides/offline-nodes", "docs/guides/offline-nodes.md", "offline-nodes"):
        code, out, err = ctrain("docs", asked)
        assert code == 0 and out == text, (asked, err)
    code, out, _ = ctrain("docs", "training")
    assert code == 0 and out == (REPO / "docs" / "training.md").read_text()
    code, _, err = ctrain("docs", "ofline-nodes")
    assert code == 2 and err.count("\n") == 1, err
    assert "(did you mean 'offline-nodes'?)" in err and "guides/run-a-sweep" in err, err


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def test_init_in_a_repository_appends_ctrains_ignore_lines_once_and_git_ignores_an_image(tmp_path: Path) -> None:
    """An existing git repository with its own .gitignore: init keeps the user's lines, appends
    ctrain's in one marked block and says so; a second init (--force) adds nothing; real git then
    ignores a SIF, outputs and the job state, and still sees the user's files."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / ".gitignore").write_text("__pycache__/\n*.pyc")  # theirs, no final newline
    (repo / "train.py").write_text("print('mine')\n")
    code, _, err = ctrain("init", repo)
    assert code == 0, err
    text = (repo / ".gitignore").read_text()
    assert text.startswith("__pycache__/\n*.pyc\n\n" + project.BLOCK_START + "\n")
    assert text.endswith(project.BLOCK_END + "\n") and text.count(project.BLOCK_START) == 1
    assert "added ctrain's lines to .gitignore in a block marked" in err and "*.sif" in err
    assert "edited since ctrain init" not in err
    code, _, err = ctrain("init", "--force", repo)
    assert code == 0 and (repo / ".gitignore").read_text() == text, err
    assert ".gitignore" not in err
    for ignored in ("images/ctrain.sif", "outputs/run/model.safetensors", ".ctrain/1/state", "logs/x-1.out"):
        (repo / ignored).parent.mkdir(parents=True, exist_ok=True)
        (repo / ignored).write_text("x")
    git(repo, "add", "-A")
    staged = git(repo, "diff", "--cached", "--name-only").split()
    assert "train.py" in staged and "ctrain.yaml" in staged and "sbatch/lib/ctrain.sh" in staged
    assert not [p for p in staged if p.startswith(("images/", "outputs/", ".ctrain/", "logs/"))], staged


def test_an_older_block_is_replaced_in_place_and_a_changed_one_is_not_doubled() -> None:
    block = [project.BLOCK_START, "/images/", project.BLOCK_END]
    merged = project.ignore_block("\n".join(["a", *block, "b"]) + "\n")
    assert merged is not None
    lines = merged.splitlines()
    assert lines[0] == "a" and lines[-1] == "b" and lines.count(project.BLOCK_START) == 1
    assert lines[1:-1] == [project.BLOCK_START, *project.ignore_lines(), project.BLOCK_END]
    assert project.ignore_block(merged) is None


def test_force_says_a_file_it_never_wrote_is_yours_not_edited(tmp_path: Path) -> None:
    (tmp_path / "ctrain.yaml").write_text("runtime: apptainer\n")
    code, _, err = ctrain("init", "--force", tmp_path)
    assert code == 0, err
    assert "kept ctrain.yaml (yours, not written by ctrain init)" in err and "edited since" not in err
    assert (tmp_path / "ctrain.yaml").read_text() == "runtime: apptainer\n"
