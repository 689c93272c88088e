"""The golden helper itself: an update is explicit, refused under CI, and never compares a file with itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import golden_files


@pytest.fixture
def goldens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(golden_files, "GOLDEN", tmp_path)
    for name in ("CI", "CTRAIN_STRICT", golden_files.UPDATE):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "area").mkdir()
    (tmp_path / "area" / "kept").write_text("the golden\n")
    return tmp_path


def test_equal_text_passes_and_different_text_fails(goldens: Path) -> None:
    golden_files.assert_golden("area", "kept", "the golden\n")
    with pytest.raises(AssertionError, match="differs from the golden file"):
        golden_files.assert_golden("area", "kept", "something else\n")


def test_a_missing_golden_fails(goldens: Path) -> None:
    with pytest.raises(AssertionError, match="missing"):
        golden_files.assert_golden("area", "absent", "text\n")
    assert not (goldens / "area" / "absent").exists()


@pytest.mark.parametrize("variable", ["CI", "CTRAIN_STRICT"])
def test_an_update_under_ci_or_strict_mode_fails_and_writes_nothing(goldens: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    variable: str) -> None:  # fmt: skip
    monkeypatch.setenv(variable, "true")
    monkeypatch.setenv(golden_files.UPDATE, "1")
    with pytest.raises(pytest.fail.Exception, match="never rewritten"):
        golden_files.assert_golden("area", "kept", "something else\n")
    assert (goldens / "area" / "kept").read_text() == "the golden\n"


@pytest.mark.parametrize("value", ["0", "yes", "true"])
def test_only_the_value_1_updates(goldens: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(golden_files.UPDATE, value)
    with pytest.raises(pytest.fail.Exception, match="set it to 1"):
        golden_files.assert_golden("area", "kept", "something else\n")
    assert (goldens / "area" / "kept").read_text() == "the golden\n"


def test_an_update_rewrites_a_differing_golden_and_skips_instead_of_passing(goldens: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv(golden_files.UPDATE, "1")
    with pytest.raises(pytest.skip.Exception, match="rewrote golden area/kept"):
        golden_files.assert_golden("area", "kept", "something else\n")
    assert (goldens / "area" / "kept").read_text() == "something else\n"
    with pytest.raises(pytest.skip.Exception, match="rewrote golden area/new"):
        golden_files.assert_golden("area", "new", "new text\n")
    assert (goldens / "area" / "new").read_text() == "new text\n"
    golden_files.assert_golden("area", "new", "new text\n")  # equal: an ordinary pass, nothing written
