"""ctrain as a user installs it: a wheel built from this checkout, installed into a fresh virtual
environment outside the checkout, run in a new project that ``ctrain init`` wrote.

The fresh environment sees the test environment's packages through a ``.pth`` file (so click,
PyYAML and ParallelCluster are not installed again), but its own site-packages, holding the
wheel, comes first: the test checks that the ``ctrain`` it runs is the installed one and that no
path into this checkout is used.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from ctrain import __version__
from tests.conftest import need
from tests.plugins.slurm import Project

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from: the files a clean clone has (no build/, egg-info or caches).
_SOURCE = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "src", "sbatch", "containers", "cluster",
           "configs", "recipes", "docs")  # fmt: skip
_CLUSTER = {
    "region": "us-east-1",
    "head_node_subnet": "subnet-0123456789abcdef0",
    "key_pair": "my-key",
    "scripts_s3_uri": "s3://my-bucket/ctrain",
}
MARKER = "# this project's copy of the library (tests/integration/test_install.py)"


@dataclass(frozen=True)
class Installed:
    """The fresh environment: its ``ctrain`` executable and the environment to run it with."""

    ctrain: Path
    site: Path
    env: dict[str, str]

    def run(self, *args: str | os.PathLike[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(self.ctrain), *map(str, args)], cwd=cwd, env=self.env, capture_output=True,
                                text=True, timeout=300, check=False)  # fmt: skip
        if check:
            assert result.returncode == 0, f"ctrain {' '.join(map(str, args))}:\n{result.stdout}\n{result.stderr}"
        return result


def _ignore(_: str, names: list[str]) -> list[str]:
    return [n for n in names if n in ("__pycache__", "build", "dist") or n.endswith((".egg-info", ".pyc"))]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """``pip wheel`` of a clean copy of the checkout, installed with pip into a new venv."""
    top = tmp_path_factory.mktemp("install")
    source = top / "source"
    for name in _SOURCE:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=_ignore)
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(origin, source / name)
    wheels = top / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    (wheel,) = wheels.glob("ctrain_slurm-*.whl")
    venv = top / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz-test-environment.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CTRAIN_CONFIG", "VIRTUAL_ENV")}
    # The fresh venv first; the test environment's tools (pcluster) after it, as on a user's PATH.
    env["PATH"] = os.pathsep.join([str(venv / "bin"), str(Path(sys.executable).parent), env.get("PATH", "")])
    found = subprocess.run([python, "-c", "import ctrain, ctrain.resources as r; print(ctrain.__file__); print(r.root())"],
                           capture_output=True, text=True, check=True, env=env, cwd=top).stdout.split()  # fmt: skip
    assert found[0].startswith(str(site)), f"ctrain imported from {found[0]}, not the fresh venv's {site}"
    assert found[1] == str(site / "ctrain" / "_data"), found
    return Installed(venv / "bin" / "ctrain", site, env)


@pytest.fixture(scope="module")
def new_project(installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ctrain init`` in an empty directory outside the checkout."""
    path = tmp_path_factory.mktemp("user") / "my-project"
    path.mkdir()
    installed.run("init", cwd=path)
    return path


def _kept(path: Path) -> bool:
    """A shipped file, not a cache pip or Python wrote beside it."""
    return path.is_file() and "__pycache__" not in path.parts


def test_wheel_carries_ctrains_files(installed: Installed) -> None:
    data = installed.site / "ctrain" / "_data"
    for name in ("sbatch", "containers", "cluster", "configs", "recipes"):
        shipped = sorted(p.relative_to(REPO) for p in (REPO / name).rglob("*") if _kept(p))
        packaged = sorted(p.relative_to(data) for p in (data / name).rglob("*") if _kept(p))
        assert packaged == shipped, name
    assert (data / "sbatch" / "lib" / "ctrain.sh").read_bytes() == (REPO / "sbatch" / "lib" / "ctrain.sh").read_bytes()
    assert (data / "pyproject.toml").read_bytes() == (REPO / "pyproject.toml").read_bytes()


def test_the_installed_ctrain_stages_an_image_build_context(new_project: Path, installed: Installed) -> None:
    """What ``ctrain build`` hands the builder from a project (the build itself is test_image.py's)."""
    code = (
        "from pathlib import Path\n"
        "from ctrain.image import build\n"
        "with build.source_context(Path('.')) as c:\n"
        "    build.check_context(c, 'buildah'); build.check_context(c, 'apptainer')\n"
        "    print(build.source_version(c), sorted(p.name for p in c.iterdir()), (c / 'src/ctrain/_data').exists())\n"
    )
    python = installed.ctrain.with_name("python")
    out = subprocess.run([python, "-c", code], cwd=new_project, env=installed.env, capture_output=True, text=True,
                         check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 1) == [__version__, "['containers', 'pyproject.toml', 'src'] False\n"]


def test_init_writes_a_project(new_project: Path, installed: Installed) -> None:
    for name in ("ctrain.yaml", ".gitignore", "recipes/demo-addition.yaml", "sbatch/lib/ctrain.sh",
                 "sbatch/pyxis_multinode.sbatch", "containers/Dockerfile", "containers/ctrain-standalone.def"):  # fmt: skip
        assert (new_project / name).is_file(), name
    again = installed.run("init", cwd=new_project, check=False)
    assert again.returncode != 0 and again.stderr.startswith("error: ") and "--force" in again.stderr


def test_the_readmes_own_project_quickstart_from_the_wheel(installed: Installed, tmp_path: Path) -> None:
    """The README's "In your own project", from the wheel in a fresh venv outside the checkout: init,
    the dry run before any image exists (a warning, the script), and `train --check` of every
    recipe the project got (no torch needed; hub names are noted, not fetched)."""
    installed.run("init", "my-project", cwd=tmp_path)
    project = tmp_path / "my-project"
    dry = installed.run("submit", "--dry-run", "--nodes", "2", "recipes/demo-addition.yaml", cwd=project)
    assert "#SBATCH --nodes=2" in dry.stdout and f"CTRAIN_IMAGE={project}/images/ctrain-latest.sif" in dry.stdout
    assert "warning: image" in dry.stderr and "this dry run does not" in dry.stderr
    recipes = sorted((project / "recipes").glob("*.yaml"))
    assert len(recipes) == len(list((REPO / "recipes").glob("*.yaml"))) > 3
    # The LoRA demo adapts the demo's trained model: before that run, --check names what is missing.
    needs_a_run = {"demo-lora.yaml": "error: model.path: outputs/demo-addition/final does not exist"}
    for recipe in recipes:
        checked = installed.run("train", "--check", recipe.relative_to(project), cwd=project, check=False)
        if recipe.name in needs_a_run:
            assert checked.returncode == 2 and checked.stderr.startswith(needs_a_run[recipe.name]), checked.stderr
        else:
            assert checked.returncode == 0 and "is valid" in checked.stdout, (recipe.name, checked.stderr)


def test_dry_run_uses_the_projects_sbatch_library(new_project: Path, installed: Installed) -> None:
    lib = new_project / "sbatch" / "lib" / "ctrain.sh"
    lib.write_text(lib.read_text() + MARKER + "\n")
    image = new_project / "images" / "ctrain-latest.sif"
    image.parent.mkdir(exist_ok=True)
    image.write_bytes(b"#!/usr/bin/env run-singularity\nSIF_MAGIC0001" + bytes(64))  # only its header is read
    result = installed.run("submit", "--dry-run", "--nodes", "2", "recipes/demo-addition.yaml", cwd=new_project)
    assert MARKER in result.stdout
    assert "#SBATCH --nodes=2" in result.stdout
    assert f"# in {new_project}:" in result.stdout
    assert str(REPO) not in result.stdout
    upgrade = installed.run("init", "--upgrade", cwd=new_project, check=False)
    assert upgrade.returncode == 1, upgrade.stderr
    assert "sbatch/lib/ctrain.sh" in upgrade.stdout and "edited" in upgrade.stdout


def test_cluster_init_and_validate_from_the_project(new_project: Path, installed: Installed) -> None:
    need(shutil.which("pcluster", path=installed.env["PATH"]) is not None, "the pcluster CLI (pip install 'ctrain-slurm[aws]')")
    config = yaml.safe_load((new_project / "ctrain.yaml").read_text())
    config["cluster"].update(_CLUSTER)
    (new_project / "ctrain.yaml").write_text(yaml.safe_dump(config))
    env = {**installed.env, "AWS_EC2_METADATA_DISABLED": "true", "HOME": str(new_project)}
    env = {k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_EC2_METADATA_DISABLED"}
    run = Installed(installed.ctrain, installed.site, env).run
    written = Path(run("cluster", "init", cwd=new_project).stdout.strip())
    assert written == new_project / "pcluster.yaml"
    assert "# from cluster/pcluster.yaml" in written.read_text()  # the shipped template, named as users know it
    result = run("cluster", "validate", cwd=new_project)
    assert result.stdout.strip().endswith("pcluster.yaml: valid (ParallelCluster schema and offline validators, ctrain rules)")


@pytest.mark.full
@pytest.mark.slow
def test_submit_from_the_project_runs_on_the_testbed(installed: Installed, testbed, cpu_sif: Path) -> None:
    """A real 2-node job from a project ``ctrain init`` wrote on the shared filesystem; ctrain (as
    root, the login node) writes the script, the testbed's user queues it.
    Full tier alone; CI tier: test_dry_run_uses_the_projects_sbatch_library (the installed wheel's project
    renders its job) and test_quickstart_trains_the_demo_on_two_nodes_and_passes_the_bar (a project's job on the
    testbed)."""
    path = Path(testbed.shared_dir) / "installed-project"
    shutil.rmtree(path, ignore_errors=True)
    installed.run("init", path, cwd=Path(testbed.shared_dir))
    (path / "logs").mkdir()
    project = Project(path, testbed)
    script = path / "logs" / f"installed-{time.monotonic_ns()}.sbatch"
    installed.run("submit", f"--image={cpu_sif}", "--nodes=2", "--ntasks-per-node=1", f"--write-script={script}",
                  "recipes/demo-addition.yaml", "training.max_steps=2", "training.logging_steps=1",
                  "training.save_steps=1000", cwd=path)  # fmt: skip
    project.own(path)
    job_id = project.sbatch(str(script))
    state = testbed.wait(job_id, timeout=900)
    log = project.log(job_id)
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{log[-6000:]}"
    assert "on 2 node(s)" in log
    assert json.loads((path / ".ctrain-init.json").read_text())["files"]
