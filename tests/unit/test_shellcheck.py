"""shellcheck on the batch scripts, their library and the programs the nodes run: no warning or error
(sbatch/.shellcheckrc says which checks the library's layout turns off, and why)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import need

SBATCH = Path(__file__).resolve().parents[2] / "sbatch"


def shellcheck(shell: str, files: list[Path]) -> subprocess.CompletedProcess[str]:
    need(shutil.which("shellcheck") is not None, "shellcheck (scripts/setup.sh lint)")
    assert files
    return subprocess.run(["shellcheck", "--severity=warning", f"--shell={shell}", *map(str, files)], cwd=SBATCH,
                          capture_output=True, text=True, check=False)  # fmt: skip


def test_the_library_and_the_scripts_pass_shellcheck() -> None:
    out = shellcheck("bash", sorted(SBATCH.glob("*.sbatch")) + sorted((SBATCH / "lib").glob("*.sh")))
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_programs_the_nodes_run_are_posix_sh_and_pass_shellcheck() -> None:
    out = shellcheck("sh", sorted((SBATCH / "lib" / "programs").glob("*.sh")))
    assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck_finds_what_it_is_asked_to_find(tmp_path: Path) -> None:
    """The runs above can fail: a removal that an empty variable turns into `rm -rf /*`, added to a copy
    of the library, is reported."""
    bad = tmp_path / "bad.sh"
    bad.write_text((SBATCH / "lib" / "util.sh").read_text() + '\nctrain_bad() { rm -rf $1/*; }\n')
    out = shellcheck("bash", [bad])
    assert out.returncode != 0 and "SC2115" in out.stdout
