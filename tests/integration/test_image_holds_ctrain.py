"""A recipe job whose image holds no ctrain (a stock PyTorch image, say) is refused before it is queued:
its squashfs, or a SIF's system partition, read with the real unsquashfs; images made here with the
real mksquashfs and `apptainer sif`, with ctrain where ctrain's image has it, where pip puts a package,
and nowhere."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctrain.cli import main
from ctrain.image.checks import holds_ctrain, image_facts
from ctrain.image.facts import FACTS_PATH
from tests.conftest import need

pytestmark = pytest.mark.integration

LAYOUTS = {
    "ctrains": "opt/ctrain/venv/bin/ctrain",
    "pips": "usr/local/lib/python3.11/site-packages/ctrain/__init__.py",
    "none": "usr/lib/python3/dist-packages/torch/__init__.py",
}


def squashfs(tmp_path: Path, layout: str) -> Path:
    need(bool(shutil.which("mksquashfs")), "mksquashfs (scripts/setup.sh testbed)")
    tmp_path.mkdir(exist_ok=True)
    root = tmp_path / f"root-{layout}"
    (root / LAYOUTS[layout]).parent.mkdir(parents=True)
    (root / LAYOUTS[layout]).write_text("x\n")
    image = tmp_path / f"{layout}.sqsh"
    subprocess.run(["mksquashfs", str(root), str(image), "-quiet", "-noappend", "-no-progress"], check=True)
    return image


def sif(tmp_path: Path, layout: str) -> Path:
    need(bool(shutil.which("apptainer")), "apptainer (scripts/setup.sh apptainer)")
    tmp_path.mkdir(exist_ok=True)
    image = tmp_path / f"{layout}.sif"
    subprocess.run(["apptainer", "sif", "new", str(image)], check=True, capture_output=True)
    subprocess.run(["apptainer", "sif", "add", "--datatype", "4", "--partfs", "1", "--parttype", "2", "--partarch", "2",
                    "--groupid", "1", str(image), str(squashfs(tmp_path, layout))], check=True, capture_output=True)  # fmt: skip
    return image


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ctrain_is_found_in_a_squashfs_and_a_sif_wherever_it_is_installed(tmp_path: Path, layout: str) -> None:
    expected = layout != "none"
    assert holds_ctrain(str(squashfs(tmp_path, layout)), "pyxis", tmp_path) is expected
    assert holds_ctrain(str(sif(tmp_path / "sif", layout)), "apptainer", tmp_path) is expected


def test_a_recipe_job_on_an_image_without_ctrain_is_refused_and_a_registry_reference_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "proj"
    assert CliRunner().invoke(main, ["init", str(project)]).exit_code == 0
    stock = sif(tmp_path, "none")
    monkeypatch.chdir(project)
    monkeypatch.setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    refused = CliRunner().invoke(main, ["submit", "--dry-run", f"--image={stock}", "recipes/demo-addition.yaml"])
    assert refused.exit_code == 2 and refused.stderr.startswith(
        f"error: image {stock} holds no ctrain, and the job runs `python -m ctrain` in it on every node"), refused.stderr
    own = CliRunner().invoke(main, ["submit", "--dry-run", f"--image={stock}", "--", "python", "-c", "print(1)"])
    assert own.exit_code == 0, own.stderr
    ours = CliRunner().invoke(main, ["submit", "--dry-run", f"--image={sif(tmp_path / 'ours', 'pips')}",
                                     "recipes/demo-addition.yaml"])  # fmt: skip
    assert ours.exit_code == 0 and "holds no ctrain" not in ours.stderr, ours.stderr
    registry = CliRunner().invoke(main, ["submit", "--dry-run", "--runtime=pyxis", "--image=nvcr.io#nvidia/pytorch:25.01-py3",
                                         "recipes/demo-addition.yaml"])  # fmt: skip
    assert registry.exit_code == 0, registry.stderr
    assert "warning: image nvcr.io#nvidia/pytorch:25.01-py3 is a registry reference, so whether it holds ctrain" in registry.stderr


def test_what_an_image_says_it_is_reaches_the_jobs_notes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need(bool(shutil.which("mksquashfs")), "mksquashfs (scripts/setup.sh testbed)")
    root = tmp_path / "root"
    (root / "opt/ctrain/venv/bin").mkdir(parents=True)
    (root / "opt/ctrain/venv/bin/ctrain").write_text("x\n")
    stated = {"ctrain": "0.1.0", "torch": "2.9.1+cu130", "cuda": "13.0", "min_driver": "580.65.06"}
    (root / FACTS_PATH).write_text(json.dumps(stated))
    image = tmp_path / "gpu.sqsh"
    subprocess.run(["mksquashfs", str(root), str(image), "-quiet", "-noappend", "-no-progress"], check=True)
    project = tmp_path / "proj"
    assert CliRunner().invoke(main, ["init", str(project)]).exit_code == 0
    monkeypatch.chdir(project)
    monkeypatch.setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    result = CliRunner().invoke(main, ["submit", "--dry-run", "--runtime=pyxis", f"--image={image}",
                                       "recipes/demo-addition.yaml"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "note: image: ctrain 0.1.0, torch 2.9.1+cu130, CUDA 13.0 (NVIDIA driver 580.65.06 or newer on the nodes)" \
        in result.stderr  # fmt: skip


def test_ctrains_built_image_says_what_it_is(cpu_sif: Path, cpu_sqsh: Path) -> None:
    """The CPU image the suite builds (containers/install.sh writes its facts), as a SIF and a squashfs."""
    import torch

    from ctrain import __version__

    for image, runtime in ((cpu_sif, "apptainer"), (cpu_sqsh, "pyxis")):
        stated = image_facts(str(image), runtime, image.parent)
        assert stated is not None and stated["ctrain"] == __version__, (image, stated)
        assert stated["cuda"] is None and stated["min_driver"] is None
        assert str(stated["torch"]).split("+")[0] == torch.__version__.split("+")[0]
