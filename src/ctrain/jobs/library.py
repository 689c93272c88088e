"""The sbatch library (``sbatch/lib/``) as a job gets it: its files assembled into the one text that
``ctrain submit`` inlines in place of the scripts' ``source`` line, and its version against a
project's copy.

``sbatch/lib/ctrain.sh`` is what a script sources; it sources the library's parts and loads the
programs that run on the nodes (``sbatch/lib/programs/``) from beside it. The assembled text is the
same library with each of those lines replaced by the file it names, so a submitted job depends on
no file of the checkout after submission (a requeued job runs the same text).
"""

from __future__ import annotations

import re
from pathlib import Path

from ctrain import install_hint, resources
from ctrain.errors import ConfigError
from ctrain.files import read_text_bounded

LIB = Path("sbatch/lib/ctrain.sh")
# How every script in sbatch/ loads the library (the line `ctrain submit` replaces by the library).
SOURCE_LINE = 'source "${CTRAIN_SBATCH_LIB:-$SLURM_SUBMIT_DIR/sbatch/lib/ctrain.sh}" || exit 2'
# The most a script or one of the library's files may hold: ctrain's own are a few dozen KiB.
MAX_SCRIPT_BYTES = 4 * 2**20


def read_script(path: Path, what: str) -> str:
    """A script's text, bounded and UTF-8 (``--script`` may name any file, a copy may have been damaged)."""
    return read_text_bounded(path, MAX_SCRIPT_BYTES, what)


# The lines of the library's entry point that load its other files (sbatch/lib/ctrain.sh), and the
# here-document an inlined program becomes.
_PART = re.compile(r'^source "\$CTRAIN_LIB_DIR/([\w.-]+\.sh)" \|\| exit 2$', re.MULTILINE)
_PROGRAM = re.compile(r"^ctrain_program (\w+) ([\w.-]+)$", re.MULTILINE)
PROGRAM_END = "CTRAIN_PROGRAM"


def _program(directory: Path, name: str, file: str) -> str:
    path = directory / "programs" / file
    text = read_script(path, "a program of the sbatch library")
    lines = text.rstrip("\n").splitlines()
    while lines and lines[0].startswith("#"):  # what it is, for its readers (ctrain_program drops it too)
        lines.pop(0)
    if PROGRAM_END in lines:
        raise ConfigError(f"{path} has a line {PROGRAM_END}, which would end its here-document: rename it")
    return "\n".join([f"ctrain_program {name} - <<'{PROGRAM_END}'", *lines, PROGRAM_END])


def _inline(directory: Path, text: str) -> str:
    text = _PROGRAM.sub(lambda m: _program(directory, m[1], m[2]), text)
    return _PART.sub(lambda m: _inline(directory, read_script(directory / m[1], "a part of the sbatch library"))
                     .rstrip("\n"), text)  # fmt: skip


def assemble(lib: Path) -> str:
    """The library whose entry point is ``lib``, as one self-contained text: each part it sources and
    each program it loads written in place of its line. A copy of one file (a project's version 5 or
    older) is its own assembly."""
    return _inline(lib.parent, read_script(lib, "the sbatch library"))


_LIB_VERSION = re.compile(r"^CTRAIN_LIB_VERSION=(\d+)$", re.MULTILINE)
_LIB_HISTORY = re.compile(r"^#\s+version (\d+): (.*(?:\n#\s{6,}\S.*)*)", re.MULTILINE)


def library_version(text: str) -> int:
    """A library's CTRAIN_LIB_VERSION; 1 for a copy from before the library said it."""
    found = _LIB_VERSION.search(text)
    return int(found[1]) if found else 1


def library_notes(lib: Path) -> list[str]:
    """What a project's copy of the library (``ctrain init`` copied it) misses against the installed
    one, with the fix; a ConfigError for a copy from a newer ctrain, which this one cannot drive."""
    installed = resources.path(*LIB.parts)
    if lib.resolve() == installed.resolve():
        return []
    ours = read_script(installed, "the sbatch library")
    theirs, current = library_version(read_script(lib, "the sbatch library")), library_version(ours)
    if theirs > current:
        raise ConfigError(
            f"{lib} is version {theirs} of the sbatch library, from a newer ctrain than this one (which knows "
            f"up to {current}): upgrade ctrain ({install_hint()} --upgrade), or run `ctrain init --force` to "
            "go back to this ctrain's scripts"
        )
    if theirs == current:
        return []
    missed = [" ".join(" ".join(m[2].split()).split("# ")) for m in _LIB_HISTORY.finditer(ours) if int(m[1]) > theirs]
    return [
        f"warning: the project's sbatch/ is version {theirs} of ctrain's sbatch library and this ctrain has "
        f"version {current}; it misses: {'; '.join(missed)}. `ctrain init --upgrade` lists what differs, "
        "`ctrain init --force` refreshes the copies (an edited one is kept as NAME.edited)"
    ]


