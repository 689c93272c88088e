"""``ctrain init``: a new project directory with the files ctrain runs from, and the check of a
project's copies against the installed ctrain (``--upgrade``).

A project holds two kinds of files. ctrain's own (``sbatch/``, ``containers/``) are copies
of the installed version: ``--force`` refreshes them (an edited one is kept beside it as
``NAME.edited``) and ``--upgrade`` reports the ones that differ. The user's (``ctrain.yaml``,
``recipes/``, ``configs/``, ``.gitignore``) start as ctrain's starters and are theirs to edit:
``--force`` replaces one only while it is still the copy ``init`` wrote. What ``init`` wrote is
recorded, with hashes, in :data:`MANIFEST`, which is how "still the copy" and "edited" are told apart.

A repository adopting ctrain keeps its own ``.gitignore``: ``init`` appends ctrain's lines to it in
one marked block (:func:`ignore_block`), once, so that images, outputs and job state stay out of git.
ctrain's documentation is not copied: ``ctrain docs`` shows the installed pages.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ctrain import __version__, files, resources
from ctrain.errors import ConfigError, CtrainError

MANIFEST = Path(".ctrain-init.json")
# Beside a file of ctrain's that `init --force` replaces although it was edited: the edited copy.
EDITED_SUFFIX = ".edited"
# Directories copied whole from ctrain's files; ctrain owns them.
OWNED_DIRS = ("sbatch", "containers")
# The user's starters: project path -> where ctrain keeps it.
_TEMPLATES = Path(__file__).resolve().parent / "templates"
GITIGNORE = Path(".gitignore")
USER_FILES = {Path("ctrain.yaml"): _TEMPLATES / "ctrain.yaml", GITIGNORE: _TEMPLATES / "gitignore"}
USER_DIRS = ("recipes", "configs")
# The marks around ctrain's lines in a .gitignore that was there before ctrain init.
BLOCK_START = "# >>> ctrain: what ctrain writes and nobody should commit (ctrain init keeps this block)"
BLOCK_END = "# <<< ctrain"

Status = Literal["same", "missing", "outdated", "edited"]


@dataclass(frozen=True)
class Entry:
    """One file ``init`` writes: its path in the project, the installed copy, and whose it is."""

    path: Path
    source: Path
    owned: bool

    def text(self) -> str:
        return self.source.read_text()


@dataclass(frozen=True)
class Difference:
    """A project file measured against the installed copy: same, missing, outdated (unchanged since
    ``init`` wrote it, so ``--force`` may replace it) or edited (changed in the project)."""

    path: Path
    owned: bool
    status: Status


def entries() -> list[Entry]:
    """Every file of a new project, in the order they are written."""
    found = [Entry(path, source, owned=False) for path, source in USER_FILES.items()]
    root = resources.root()
    for name in USER_DIRS:
        found += [Entry(rel, root / rel, owned=False) for rel in resources.files(name)]
    for name in OWNED_DIRS:
        found += [Entry(rel, root / rel, owned=True) for rel in resources.files(name)]
    return found


#: A project file ctrain writes is a few KiB; one larger than this is not one of them.
MAX_PROJECT_FILE_BYTES = 4 * 2**20


def _project_text(path: Path) -> str:
    """A project file's text for comparing it with ctrain's copy (bytes that are not UTF-8 compare as different)."""
    return files.read_bounded(path, MAX_PROJECT_FILE_BYTES, "the project file").decode(errors="replace")


def _keep_edited(directory: Path, path: Path) -> Path:
    """Copy the edited file at PATH, byte for byte, to ``NAME.edited`` or, when an earlier
    ``--force`` left one with other content, the first free ``NAME.edited.N``: no edit is lost."""
    content = files.read_bounded(directory / path, MAX_PROJECT_FILE_BYTES, "the project file")
    for number in range(1000):
        backup = path.with_name(path.name + EDITED_SUFFIX + (f".{number}" if number else ""))
        target = directory / backup
        if os.path.lexists(target):
            if target.is_file() and not target.is_symlink() and target.stat().st_size == len(content):
                if files.read_bounded(target, MAX_PROJECT_FILE_BYTES, "the edited copy") == content:
                    return backup
            continue
        files.atomic_write_bytes(target, content)
        return backup
    raise ConfigError(f"{directory / path} has 1000 edited copies beside it: remove the old ones and run init again")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(directory: Path) -> dict[str, str]:
    """Project path -> hash of the copy ``init`` last wrote there; empty when there is no manifest."""
    path = directory / MANIFEST
    if not path.is_file():
        return {}
    try:
        data = files.load_json_bounded(path, MAX_PROJECT_FILE_BYTES, "the manifest")
        return {str(k): str(v) for k, v in data["files"].items()}
    except (ConfigError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path} is not a ctrain init manifest ({exc}): remove it and run ctrain init --force") from exc


def written_by(directory: Path) -> str | None:
    """The ctrain version that last wrote the project's files (``init`` or ``--force``), if recorded."""
    path = directory / MANIFEST
    try:
        version = files.load_json_bounded(path, MAX_PROJECT_FILE_BYTES, "the manifest").get("ctrain")
    except (ConfigError, AttributeError):
        return None
    return str(version) if version else None


def _status(directory: Path, entry: Entry, manifest: dict[str, str]) -> Status:
    target = directory / entry.path
    if not target.is_file():
        return "missing"
    current = _sha256(_project_text(target))
    if current == _sha256(entry.text()):
        return "same"
    return "outdated" if manifest.get(str(entry.path)) == current else "edited"


def compare(directory: Path) -> list[Difference]:
    """Each file a project gets from ``init``, measured against the installed ctrain."""
    if not (directory / MANIFEST).is_file() and not (directory / "sbatch").is_dir():
        raise ConfigError(f"{directory} is not a ctrain project (no {MANIFEST} or sbatch/): run ctrain init {directory}")
    manifest = read_manifest(directory)
    return [Difference(e.path, e.owned, _status(directory, e, manifest)) for e in entries()]


def ignore_lines() -> list[str]:
    """The patterns of ctrain's .gitignore (its comments left out)."""
    return [line for line in USER_FILES[GITIGNORE].read_text().splitlines() if line and not line.startswith("#")]


def ignore_block(text: str) -> str | None:
    """TEXT (a .gitignore that is not ctrain's) with ctrain's marked block in it: appended once, an
    older block replaced in place; None when the block is there as it should be."""
    block = [BLOCK_START, *ignore_lines(), BLOCK_END]
    lines = text.splitlines()
    if BLOCK_START in lines and BLOCK_END in lines[lines.index(BLOCK_START):]:
        start = lines.index(BLOCK_START)
        end = start + lines[start:].index(BLOCK_END)
        if lines[start:end + 1] == block:
            return None
        lines[start:end + 1] = block
    else:
        lines += ([""] if lines and lines[-1] else []) + block
    return "\n".join(lines) + "\n"


def _adopt_gitignore(directory: Path, emit: Callable[[str], None]) -> None:
    """A .gitignore that ctrain did not write gets ctrain's block (and says so), or is left as it is."""
    target = directory / GITIGNORE
    merged = ignore_block(_project_text(target))
    if merged is None:
        return
    files.atomic_write_text(target, merged)
    emit(f"added ctrain's lines to {GITIGNORE} in a block marked '{BLOCK_END[2:]}': "
         f"{', '.join(ignore_lines())} stay out of git")  # fmt: skip


def init(directory: Path, *, force: bool = False, emit: Callable[[str], None] = lambda _: None) -> list[Path]:
    """Write a new project into ``directory`` (made if missing); returns the files written.

    Without ``force`` any file already there stops it before anything is written. With ``force``
    ctrain's own files are refreshed, and the user's only where they are missing or unchanged copies.
    """
    files.check_directory(directory, "the project directory", "choose another directory")
    separators = sorted(set(":,") & set(os.path.abspath(directory)))
    if separators:
        raise ConfigError(
            f"the project directory {os.path.abspath(directory)} holds {' and '.join(repr(c) for c in separators)}: "
            "jobs mount it into the container, and Apptainer's --bind and pyxis's --container-mounts read those as "
            "separators; choose a path without them"
        )
    plan = entries()
    recorded = read_manifest(directory)
    manifest = recorded if force else {}
    # A .gitignore that init did not write is the repository's: it gets ctrain's block instead.
    gitignore = directory / GITIGNORE
    theirs = gitignore.is_file() and not gitignore.is_symlink() and str(GITIGNORE) not in recorded and (
        _project_text(gitignore) != USER_FILES[GITIGNORE].read_text())
    if theirs:
        plan = [e for e in plan if e.path != GITIGNORE]
    if not force:
        present = [e.path for e in plan if os.path.lexists(directory / e.path)]
        present += [MANIFEST] if (directory / MANIFEST).exists() else []
        if present:
            shown = ", ".join(str(p) for p in present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
            raise ConfigError(
                f"{directory} already has {shown}: ctrain init writes only new projects; "
                "`ctrain init --force` refreshes ctrain's own files, `ctrain init --upgrade` shows what differs"
            )
    todo: list[Entry] = []
    for entry in plan:
        target = directory / entry.path
        if target.is_dir() or (target.is_symlink() and not target.is_file()):
            raise ConfigError(f"{target} is in the way (not a file): move it away and run ctrain init again")
        status = _status(directory, entry, manifest)
        if status == "same":
            continue
        if status == "edited" and not entry.owned:
            written = str(entry.path) in manifest
            emit(f"kept {entry.path} (yours, " + ("edited since ctrain init)" if written else "not written by ctrain init)"))
            continue
        if status == "edited":
            backup = _keep_edited(directory, entry.path)
            emit(f"replaced {entry.path}: it differed from ctrain {__version__}'s; your edited copy is in {backup}")
        todo.append(entry)
    written = _write(directory, todo, manifest)
    if theirs:
        _adopt_gitignore(directory, emit)
    return written


def _write(directory: Path, todo: list[Entry], manifest: dict[str, str]) -> list[Path]:
    """Write ``todo`` and the manifest; on a failure, take back the files this call created."""
    created: list[Path] = []
    made_dirs: list[Path] = []
    hashes = dict(manifest)
    try:
        for entry in todo:
            target = directory / entry.path
            made_dirs += files.make_dirs(target.parent, "choose a directory you can write")
            existed = target.exists()
            text = entry.text()
            files.atomic_write_text(target, text)
            if not existed:
                created.append(target)
            os.chmod(target, entry.source.stat().st_mode & 0o777 | 0o644)
            hashes[str(entry.path)] = _sha256(text)
        for entry in entries():
            target = directory / entry.path
            if target.is_file() and _sha256(_project_text(target)) == _sha256(entry.text()):
                hashes[str(entry.path)] = _sha256(entry.text())
        files.atomic_write_json(directory / MANIFEST, {"ctrain": __version__, "files": dict(sorted(hashes.items()))})
    except (OSError, CtrainError):
        for path in created:
            path.unlink(missing_ok=True)
        files.remove_dirs(sorted(made_dirs, key=lambda p: len(p.parts), reverse=True))
        raise
    return [directory / e.path for e in todo]
