"""The node's image-cache program (sbatch/lib/programs/image-prepare.sh) says why an image did not
unpack and what to do, by what Apptainer said: a table, run with an `apptainer` that fails as told."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

PROGRAM = Path(__file__).resolve().parents[2] / "sbatch" / "lib" / "programs" / "image-prepare.sh"


@pytest.mark.parametrize(("said", "fix"), [
    ("FATAL: write /cache/x/rootfs/usr/lib/libtorch.so: no space left on device",
     "give CTRAIN_IMAGE_CACHE ({cache}) node-local disk with room for the unpacked image"),
    ("FATAL: mkdir /cache/x: read-only file system", "point CTRAIN_IMAGE_CACHE ({cache}) at a writable node-local directory"),
    ("FATAL: while extracting: could not use fakeroot: no user namespace",
     "Apptainer may not unpack images on this node: run the image without unpacking (CTRAIN_APPTAINER_UNSQUASH=0)"),
    ("FATAL: unsquashfs: operation not permitted",
     "Apptainer may not unpack images on this node: run the image without unpacking (CTRAIN_APPTAINER_UNSQUASH=0)"),
    ("FATAL: image format not recognized", "check the image (apptainer inspect {image}), or run it without unpacking"),
])  # fmt: skip
def test_an_image_that_does_not_unpack_gets_the_fix_for_why(tmp_path: Path, said: str, fix: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(f"#!/bin/sh\necho '{said}' >&2\nexit 255\n")
    (bin_dir / "apptainer").chmod(0o755)
    cache, image = tmp_path / "cache", tmp_path / "image.sif"
    image.write_text("x")
    out = subprocess.run(["sh", str(PROGRAM), str(cache), str(image), "0123456789abcdef", "1"], capture_output=True,
                         text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, timeout=60)  # fmt: skip
    assert out.returncode == 1
    line = out.stderr.strip()
    assert line.startswith(f"ctrain: {subprocess.check_output(['uname', '-n'], text=True).strip()}: could not unpack "
                           f"{image} into {cache}/0123456789abcdef: {said}; ")  # fmt: skip
    assert line.endswith(fix.format(cache=cache, image=image)) or fix.format(cache=cache, image=image) in line, line
    assert sorted(p.name for p in cache.iterdir()) == ["lock"]
