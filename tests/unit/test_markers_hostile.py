"""Hostile or damaged markers (ctrain-complete.json, ctrain-prepared.json) and the files they describe: each is
one damage or one error line, within bounded memory, never a traceback or gigabytes read."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from ctrain.errors import ConfigError
from ctrain.train import checkpoint, data
from ctrain.train.artifacts import COMPLETE_MARKER, PREPARED_MARKER
from ctrain.train.fingerprint import prepared_settings, settings_differences
from ctrain.train.recipe import Recipe, load_recipe
from tests.conftest import require
from tests.plugins.train import TINY_RECIPE


def _checkpoint(root: Path, files: dict[str, bytes]) -> Path:
    """A complete checkpoint-1 holding ``files``, marked by ctrain."""
    directory = root / "checkpoint-1"
    directory.mkdir(parents=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)
    checkpoint.write_marker(directory, {"step": 1})
    return directory


def _edit_marker(directory: Path, **changes: object) -> None:
    marker = json.loads((directory / COMPLETE_MARKER).read_text())
    manifest = changes.pop("manifest", {})
    marker["manifest"].update(manifest)  # type: ignore[call-overload]
    marker.update(changes)
    (directory / COMPLETE_MARKER).write_text(json.dumps(marker))


def _recipe(tmp_path: Path) -> Recipe:
    path = tmp_path / "r.yaml"
    path.write_text(TINY_RECIPE)
    return load_recipe(path)


# --- 1. a huge recorded size plans no pieces ------------------------------------------------------


def test_a_single_checksum_for_a_file_over_one_segment_is_refused() -> None:
    """``[2**50, "crc"]`` would plan a million pieces: a single checksum is only for a file of one segment."""
    assert checkpoint.marker_problem({"a": [2**50, "deadbeef"]}, "crc32") == (
        "the marker's entry for 'a' is not [size, checksum]"
    )
    assert checkpoint.marker_problem({"a": [checkpoint.SEGMENT, "deadbeef"]}, "crc32") is None


def test_the_pieces_a_marker_plans_are_capped(monkeypatch) -> None:
    monkeypatch.setattr(checkpoint, "MAX_PIECES", 10)
    assert checkpoint.marker_problem({f"f{i}": [1, "0"] for i in range(10)}, "crc32") is None
    problem = checkpoint.marker_problem({f"f{i}": [1, "0"] for i in range(11)}, "crc32")
    assert problem == "the marker lists more than 10 files and segments, more than ctrain writes"
    segmented = [3 * checkpoint.SEGMENT, ["0"] * 3]
    assert checkpoint.marker_problem({"a": segmented, "b": segmented, "c": segmented, "d": segmented}, "crc32")


def test_sizes_are_compared_before_segments_are_planned(tmp_path: Path, monkeypatch) -> None:
    """A recorded size that the file on disk does not have is one cheap size damage, not a piece a segment."""
    directory = _checkpoint(tmp_path, {"config.json": b"{}"})
    _edit_marker(directory, manifest={"config.json": [1000 * checkpoint.SEGMENT, ["00000000"] * 1000]})
    checked = []
    real = checkpoint.check_piece
    monkeypatch.setattr(checkpoint, "check_piece", lambda *args: checked.append(args[1]) or real(*args))
    verdict = checkpoint.verify(directory)
    assert verdict.damage is not None and verdict.damage.reason == "size", verdict
    assert checked == [("config.json", 0)]


def test_a_prepared_marker_recording_a_huge_size_is_set_aside(tmp_path: Path) -> None:
    directory = tmp_path / "prepared"
    (directory / "train").mkdir(parents=True)
    (directory / "train" / "state.json").write_text("{}")
    info = {"digest": "crc32", "manifest": {"train/state.json": [2**50, "deadbeef"]}}
    assert data._set_aside_if_damaged(directory, info) is True
    assert (tmp_path / "prepared.damaged-unreadable" / "train" / "state.json").is_file()


# --- 2. container headers are read within bounds --------------------------------------------------


def test_a_safetensors_header_longer_than_safetensors_reads_is_refused_unread(tmp_path: Path) -> None:
    """A sparse file whose 8-byte header length is its size - 8: read, it would be ~100 MB of zeros in memory."""
    path = tmp_path / "model.safetensors"
    size = checkpoint.MAX_SAFETENSORS_HEADER + 16
    with path.open("wb") as handle:
        handle.write((size - 8).to_bytes(8, "little"))
        handle.truncate(size)
    assert checkpoint.container_problem(path) == (
        "header of 100,000,008 bytes, more than safetensors reads (100,000,000)"
    )


def test_a_json_member_is_read_within_a_bound(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "trainer_state.json"
    with path.open("wb") as handle:  # sparse: refused from its size, never read
        handle.truncate(checkpoint.MAX_JSON_MEMBER_BYTES + 1)
    assert checkpoint.container_problem(path) == (
        "a JSON file of 268,435,457 bytes, more than such a file can be (268,435,456)"
    )
    path.write_text("[" * 10000 + "]" * 10000)
    assert "nests deeper than 64 levels" in (checkpoint.container_problem(path) or "")
    monkeypatch.setattr(checkpoint, "MAX_JSON_MEMBER_BYTES", 1000)
    path.write_text(json.dumps(["x" * 2000]))
    assert "more than such a file can be" in (checkpoint.container_problem(path) or "")


# --- 3. hostile values are a damage, not a traceback ---------------------------------------------


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"manifest": {"\x00x": [5, "00000000"]}}, "the marker names a file with a control character ('\\x00x')"),
        ({"manifest": {"a\x1b[2Jb": [5, "00000000"]}}, "the marker names a file with a control character"),
        ({"digest": "shake_128"}, "the marker names no known checksum of fixed length ('shake_128')"),
        ({"digest": ["crc32"]}, "the marker names no known checksum of fixed length"),
    ],
    ids=["nul-name", "escape-name", "shake-digest", "list-digest"],
)
def test_a_hostile_checkpoint_marker_is_a_damage(tmp_path: Path, change: dict, expected: str) -> None:
    directory = _checkpoint(tmp_path, {"config.json": b"{}"})
    _edit_marker(directory, **change)
    verdict = checkpoint.verify(directory)
    assert verdict.damage is not None and verdict.damage.file == COMPLETE_MARKER, verdict
    assert verdict.damage.reason == "unreadable" and verdict.damage.detail.startswith(expected)


def test_fixed_length_digests_are_still_accepted(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, {"config.json": b"{}"})
    digest = checkpoint.file_digest(directory / "config.json", "sha256")
    _edit_marker(directory, digest="sha256", manifest={"config.json": [2, digest]})
    assert checkpoint.verify(directory).damage is None
    assert f"{zlib.crc32(b'{}'):08x}" == checkpoint.file_digest(directory / "config.json")


def test_prepared_settings_that_are_no_object_are_a_damaged_marker(tmp_path: Path) -> None:
    directory = tmp_path / "prepared"
    directory.mkdir()
    (directory / PREPARED_MARKER).write_text(json.dumps({"settings": "x", "manifest": {}}))
    with pytest.raises(ConfigError, match=r"is damaged \(its settings are not a JSON object\): run `ctrain prepare"):
        data.prepared_info(_recipe(tmp_path), directory)


# --- 4. prepared data without a manifest, damaged ------------------------------------------------


def _unchecked_prepared(tmp_path: Path, recipe: Recipe) -> Path:
    """Prepared data as an older ctrain left it (a marker without a manifest): a data set and a tokenizer."""
    import datasets
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    directory = tmp_path / "prepared"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 50, "labels": [[1, 2, 3]] * 50}).save_to_disk(
        str(directory / "train")
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]")))
    tokenizer.save_pretrained(str(directory / "tokenizer"))
    (directory / PREPARED_MARKER).write_text(json.dumps({"settings": prepared_settings(recipe)}))
    return directory


def _truncate_arrow(directory: Path) -> None:
    arrow = next((directory / "train").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:600])


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (d / "train" / "state.json").unlink(),
        _truncate_arrow,
        lambda d: (d / "tokenizer" / "tokenizer.json").write_text('{"x": 1}'),
    ],
    ids=["missing-state", "truncated-arrow", "garbage-tokenizer"],
)
def test_damaged_prepared_data_without_a_manifest_is_one_error(tmp_path: Path, damage) -> None:
    require("transformers")
    recipe = _recipe(tmp_path)
    directory = _unchecked_prepared(tmp_path, recipe)
    assert data.load_prepared(recipe, directory).tokenizer is not None
    damage(directory)
    says = r"the prepared data in .* is damaged or incomplete \(.*\): run `ctrain prepare --force .*r\.yaml` \(with"
    with pytest.raises(ConfigError, match=says):
        data.load_prepared(recipe, directory)


def test_an_empty_prepared_manifest_is_set_aside(tmp_path: Path) -> None:
    """prepare never writes one; taken as it is, it would check nothing."""
    directory = tmp_path / "prepared"
    directory.mkdir()
    assert data._set_aside_if_damaged(directory, {"digest": "crc32", "manifest": {}}) is True
    assert (tmp_path / "prepared.damaged-unreadable").is_dir()


# --- 5. a changed file list names the files -------------------------------------------------------


def test_a_changed_tokenizer_file_list_names_the_files() -> None:
    def entry(name: str, size: int, mtime: int) -> dict:
        return {"path": f"/models/llama-with-a-long-directory-name/{name}", "size": size, "mtime_ns": mtime}

    prepared = {"tokenizer": {"files": [entry("tokenizer.json", 1000, 1), entry("special_tokens_map.json", 9, 1),
                                        entry("vocab.txt", 50, 1), entry("tokenizer_config.json", 70, 1)]}}  # fmt: skip
    recipe = {"tokenizer": {"files": [entry("tokenizer.json", 1200, 2), entry("special_tokens_map.json", 9, 1),
                                      entry("merges.txt", 5, 1), entry("tokenizer_config.json", 70, 3)]}}  # fmt: skip
    assert settings_differences(prepared, recipe) == [
        "tokenizer.files: merges.txt added; tokenizer.json is 1,200 bytes, was 1,000 bytes; tokenizer_config.json "
        "was modified (same size, another mtime); vocab.txt removed"
    ]
    assert settings_differences({"a": [1]}, {"a": [2]}) == ["a: prepared [1], recipe [2]"]
