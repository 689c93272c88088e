"""Atomic small-file writes: the new content or the old, and no temporary file left behind."""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
from pathlib import Path

import pytest

from ctrain import files
from ctrain.errors import ConfigError


def test_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old\n")
    files.atomic_write_json(path, {"a": 1}, indent=2)
    assert json.loads(path.read_text()) == {"a": 1}
    assert path.read_text().endswith("\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "marker.json"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        files.atomic_write_json(path, {"not json": object()})
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker.json"]


def test_bounded_reads_refuse_what_is_not_a_small_regular_file(tmp_path: Path) -> None:
    """A FIFO (would block), a device (never ends), a directory, a file over the limit, bytes that are not
    UTF-8, JSON nested past the limit (a RecursionError in json otherwise): each one ConfigError naming it."""
    from ctrain.files import MAX_JSON_DEPTH, load_json_bounded, read_bounded

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * 5000)
    (tmp_path / "binary.json").write_bytes(b'{"a":\n"\xff"}')
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    (tmp_path / "deeper.json").write_text("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    (tmp_path / "ok.json").write_text("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    cases = {
        tmp_path / "fifo": "is not a regular file", Path("/dev/zero"): "is not a regular file",
        tmp_path: "is a directory", tmp_path / "missing": "no such file",
        tmp_path / "big": "is larger than 4 KiB", tmp_path / "binary.json": "line 2: byte 0xff is not UTF-8",
        tmp_path / "deeper.json": f"nests deeper than {MAX_JSON_DEPTH} levels",
    }  # fmt: skip
    for path, says in cases.items():
        with pytest.raises(ConfigError, match=f"^the record {re.escape(str(path))}.*{says}|^cannot read the record"):
            load_json_bounded(path, 4096, "the record")
    with pytest.raises(ConfigError, match="nests deeper"):
        load_json_bounded(tmp_path / "deep.json", 1 << 20, "the record")
    assert files.json_depth_problem(load_json_bounded(tmp_path / "ok.json", 4096, "the record")) is None
    assert read_bounded(tmp_path / "big", 5000, "the file") == b"x" * 5000


def test_open_lock_opens_only_a_regular_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one opening of a lock file (the image cache's, a conversion's): made if missing with the mode
    asked, an existing one opened as it is; a link (even to a regular file), a FIFO (no reader: never
    waited on), a directory and a device are NotRegularFile and left as they were, also when the path
    turns into one between the check and the open (checked on the descriptor)."""
    umask = os.umask(0o022)
    os.umask(umask)
    fd = files.open_lock(tmp_path / "lock", 0o640)
    try:
        assert stat.S_ISREG(os.fstat(fd).st_mode) and stat.S_IMODE(os.fstat(fd).st_mode) == 0o640 & ~umask
        assert fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB) is None
    finally:
        os.close(fd)
    (tmp_path / "lock").write_text("held before")
    os.close(files.open_lock(tmp_path / "lock"))
    assert (tmp_path / "lock").read_text() == "held before"
    (tmp_path / "target").write_text("someone's")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for path, kind in ((tmp_path / "link", stat.S_ISLNK), (tmp_path / "fifo", stat.S_ISFIFO),
                       (tmp_path / "dir", stat.S_ISDIR), (Path("/dev/null"), stat.S_ISCHR)):  # fmt: skip
        with pytest.raises(files.NotRegularFile) as err:
            files.open_lock(path)
        assert kind(err.value.mode) and kind(path.lstat().st_mode), path
    assert (tmp_path / "target").read_text() == "someone's"
    monkeypatch.setattr(files, "_special_mode", lambda path: None)  # the check passed; then the path is a FIFO
    reader = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(files.NotRegularFile) as err:
            files.open_lock(tmp_path / "fifo")
        assert stat.S_ISFIFO(err.value.mode)
    finally:
        os.close(reader)
