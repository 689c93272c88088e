"""Atomic small-file writes: the new content or the old, and no temporary file left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctrain import files


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
