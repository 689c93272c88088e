"""Hostile data sources and chat templates: each is one ConfigError that says what to fix, found before
tokenizing, never a hang, a traceback or gigabytes of memory (each input is a few kilobytes on disk)."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest

from ctrain.errors import ConfigError
from ctrain.train import preflight as preflight_module
from ctrain.train.preflight import preflight
from ctrain.train.recipe import Recipe, load_recipe
from tests.conftest import require

RECIPE = """\
task: {task}
model:
  config: llama
  config_overrides: {{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
                     num_key_value_heads: 2, max_position_embeddings: 64}}
tokenizer:
  {tokenizer}
data:
  source: {source}
  max_length: 64
training:
  global_batch_size: 4
  max_steps: 2
logging:
  report_to: []
"""

CHAT = {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}
NESTED = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def recipe(tmp: Path, source: str, task: str = "sft", extra: tuple[str, ...] = (),
           tokenizer: str = "train: {vocab_size: 300}") -> Recipe:  # fmt: skip
    """A tiny recipe in ``tmp`` whose data.source is ``source``."""
    path = tmp / "recipe.yaml"
    path.write_text(RECIPE.format(task=task, source=json.dumps(source), tokenizer=tokenizer))
    return load_recipe(path, extra)


def lines(rows: list[Any]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


# --- 1: chat templates ----------------------------------------------------------------------------


def test_a_template_that_loops_for_hours_is_stopped_and_named(tmp_path: Path, monkeypatch) -> None:
    """Nested loops of 10^10 steps hung tokenizing; rendering once under a time limit names the template."""
    monkeypatch.setattr(preflight_module, "TEMPLATE_SECONDS", 1)
    (tmp_path / "data.jsonl").write_text(lines([CHAT] * 4))
    (tmp_path / "loop.jinja").write_text(NESTED)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"loop\.jinja\) did not finish rendering the first example within 1 s"):
        preflight(recipe(tmp_path, "data.jsonl", extra=("tokenizer.chat_template=loop.jinja",)))
    assert time.monotonic() - started < 60  # a hang guard: the loop runs for hours


@pytest.mark.parametrize(
    "template, says",
    [
        ("{{ 'x' * 3000000000 }}", "needs more than 2 GiB of memory"),
        ("{% for i in range(10**9) %}x{% endfor %}", r"fails on the first example \(OverflowError: Range too big"),
        ("{{ messages[0]['content'] * 100000000 }}", "more than 64 times its input"),
        ("{% for m in messages %}", r"fails on the first example \(TemplateSyntaxError"),
    ],
    ids=["memory", "overflow", "growth", "syntax"],
)
def test_a_template_that_blows_up_is_refused_by_check(tmp_path: Path, template: str, says: str) -> None:
    """Gigabyte strings, sandbox overflows and broken syntax were tracebacks or OOM kills after `--check` passed."""
    (tmp_path / "data.jsonl").write_text(lines([CHAT] * 4))
    (tmp_path / "bad.jinja").write_text(template)
    with pytest.raises(ConfigError, match=says):
        preflight(recipe(tmp_path, "data.jsonl", extra=("tokenizer.chat_template=bad.jinja",)))


def test_a_model_directory_template_is_checked_too(tmp_path: Path) -> None:
    """A tokenizer directory's chat_template.jinja is rendered as the recipe's would be."""
    model = tmp_path / "tok"
    model.mkdir()
    (model / "chat_template.jinja").write_text("{% for i in range(10**9) %}x{% endfor %}")
    (model / "tokenizer_config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text(lines([CHAT] * 4))
    with pytest.raises(ConfigError, match=r"the chat template of the tokenizer tok fails on the first example"):
        preflight(recipe(tmp_path, "data.jsonl", tokenizer="path: tok"))


def test_tokenize_renders_the_first_example_in_a_bounded_child(tmp_path: Path, monkeypatch) -> None:
    """prepare's tokenize() checks the loaded tokenizer's template before the map, which would hang on every row."""
    datasets = require("datasets")
    from transformers.utils.chat_template_utils import render_jinja_template

    from ctrain.train import data

    class Tokenizer:
        chat_template = NESTED

        def apply_chat_template(self, chat: list[Any], tokenize: bool = False, **_: Any) -> str:
            return render_jinja_template([chat], chat_template=self.chat_template)[0][0]

    monkeypatch.setattr(preflight_module, "TEMPLATE_SECONDS", 1)
    rec = recipe(tmp_path, "builtin:addition")
    with pytest.raises(ConfigError, match="ctrain's chat template did not finish rendering"):
        data.check_chat_template(datasets.Dataset.from_list([CHAT]), Tokenizer(), rec, "messages")
    Tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    data.check_chat_template(datasets.Dataset.from_list([CHAT]), Tokenizer(), rec, "messages")


def test_a_template_that_renders_in_bounds_passes_the_check() -> None:
    """The forked render of a good template says nothing; its output at the growth bound still passes,
    one character past it does not."""
    from ctrain.train.preflight import TEMPLATE_GROWTH, TEMPLATE_SLACK, check_render

    check_render(lambda: "<|user|>1 + 1?<|end|>", 30, "a template")
    check_render(lambda: "x" * (TEMPLATE_GROWTH * 30 + TEMPLATE_SLACK), 30, "a template")
    with pytest.raises(ConfigError, match="more than"):
        check_render(lambda: "x" * (TEMPLATE_GROWTH * 30 + TEMPLATE_SLACK + 1), 30, "a template")


# --- 2: globs -------------------------------------------------------------------------------------


def test_a_glob_through_link_loops_ends(tmp_path: Path) -> None:
    """Two links back to their own directory made `**` walk 2^40 paths."""
    (tmp_path / "gl/d").mkdir(parents=True)
    (tmp_path / "gl/d/a.jsonl").write_text(lines([{"text": "hello"}]))
    os.symlink(".", tmp_path / "gl/d/l1")
    os.symlink(".", tmp_path / "gl/d/l2")
    started = time.monotonic()
    assert preflight(recipe(tmp_path, "gl/d/**/*.jsonl", task="clm")) == []
    assert time.monotonic() - started < 60  # a hang guard: 2^40 paths


def test_a_glob_over_too_many_entries_is_refused(tmp_path: Path, monkeypatch) -> None:
    """`/**/*.jsonl` searched the whole machine: the walk stops at MAX_SOURCE_ENTRIES, naming the glob."""
    from ctrain.train import sources

    monkeypatch.setattr(sources, "MAX_SOURCE_ENTRIES", 20)
    for i in range(30):
        (tmp_path / f"d{i}").mkdir()
    with pytest.raises(ConfigError, match=r"\*\*/\*\.jsonl looks through more than 20 files"):
        preflight(recipe(tmp_path, str(tmp_path / "**/*.jsonl"), task="clm"))


# --- 3: parquet -----------------------------------------------------------------------------------


def test_a_compressed_parquet_bomb_is_refused_from_its_footer(tmp_path: Path) -> None:
    """8 rows of 64 MiB compress to kilobytes; read whole they took gigabytes. The footer says so first."""
    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a" * 2**26] * 8}), tmp_path / "bomb.parquet", compression="zstd")
    assert (tmp_path / "bomb.parquet").stat().st_size < 2**20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError, match=r"bomb\.parquet rows 1 to 8 take \d+ MiB uncompressed, more than 1 MiB"):
        preflight(recipe(tmp_path, "bomb.parquet", task="clm"))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


def test_a_parquet_row_over_the_row_limit_is_refused(tmp_path: Path) -> None:
    """The limit JSON lines have applies to parquet rows too, found without decoding the dictionary."""
    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    rows = ["short"] * 3000 + ["a" * (2**20 + 10)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "long.parquet", compression="zstd")
    with pytest.raises(ConfigError, match=r"long\.parquet row 3001 is longer than 1 MiB"):
        preflight(recipe(tmp_path, "long.parquet", task="clm"))


# --- 4: CSV ---------------------------------------------------------------------------------------


def test_a_long_csv_line_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    """csv.reader read a 1 GiB line whole before its field limit; lines are now read bounded."""
    with (tmp_path / "long.csv").open("w") as handle:
        handle.write("text\n")
        handle.write("a" * (8 * 2**20) + "\n")
    with pytest.raises(ConfigError, match=r"long\.csv line 2 is longer than 1 MiB"):
        preflight(recipe(tmp_path, "long.csv", task="clm"))


def test_a_csv_field_under_the_row_limit_is_read(tmp_path: Path) -> None:
    """A 200 KB field (datasets loads it) was refused by csv's own 128 KiB field limit."""
    (tmp_path / "big.csv").write_text("text\n" + "b" * 200_000 + "\nhello\n")
    assert preflight(recipe(tmp_path, "big.csv", task="clm")) == []


# --- 5: save_to_disk folders ----------------------------------------------------------------------


def test_a_dataset_dict_with_splits_not_a_list_is_named(tmp_path: Path) -> None:
    """{"splits": 5} was a TypeError."""
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd/dataset_dict.json").write_text('{"splits": 5}')
    with pytest.raises(ConfigError, match=r"dataset_dict\.json has 'splits' 5, not a list of split names"):
        preflight(recipe(tmp_path, "sd"))


def test_a_listed_split_without_its_folder_is_named(tmp_path: Path) -> None:
    """A split listed without its folder was a note to install pyarrow, which was installed."""
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd/dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(ConfigError, match=r"sd lists split 'train' but has no folder sd/train"):
        preflight(recipe(tmp_path, "sd"))


def test_a_split_without_features_is_not_blamed_on_pyarrow(tmp_path: Path) -> None:
    (tmp_path / "sd/train").mkdir(parents=True)
    (tmp_path / "sd/dataset_dict.json").write_text('{"splits": ["train"]}')
    notes = preflight(recipe(tmp_path, "sd"))
    assert notes and "pyarrow" not in notes[0] and "dataset_info.json lists no features" in notes[0]


# --- 6: leading blank lines -----------------------------------------------------------------------


def test_json_lines_after_many_blank_lines_are_read(tmp_path: Path) -> None:
    """5,000 blank lines before the rows made the file 'empty' (only its first 4 KiB were looked at)."""
    (tmp_path / "data.jsonl").write_text("\n" * 5000 + lines([CHAT] * 20))
    assert preflight(recipe(tmp_path, "data.jsonl")) == []
    (tmp_path / "blank.jsonl").write_text("\n" * 5000)
    with pytest.raises(ConfigError, match=r"blank\.jsonl is empty"):
        preflight(recipe(tmp_path, "blank.jsonl"))


# --- 7: mixed message contents --------------------------------------------------------------------


PARTS = {"messages": [{"role": "user", "content": [{"type": "text", "text": "1 + 1?"}]},
                      {"role": "assistant", "content": "2"}]}  # fmt: skip


def test_mixed_contents_are_refused_by_check_at_their_row(tmp_path: Path) -> None:
    """100 string chats and one of parts passed --check, then failed prepare at 'row 1'."""
    (tmp_path / "data.jsonl").write_text(lines([CHAT] * 100 + [PARTS]))
    with pytest.raises(ConfigError, match=r"line 101 \(row 101\) has a list of parts as a message content .* mixes "
                                          "strings and lists"):  # fmt: skip
        preflight(recipe(tmp_path, "data.jsonl"))


def test_mixed_contents_in_a_loaded_data_set_name_their_row(tmp_path: Path) -> None:
    """datasets loads mixed contents as JSON text; the loaded check names the odd row, not row 1."""
    datasets = require("datasets")
    from ctrain.train.rows import check_loaded

    (tmp_path / "data.jsonl").write_text(lines([CHAT] * 100 + [PARTS]))
    loaded = datasets.load_dataset("json", data_files=[str(tmp_path / "data.jsonl")], split="train",
                                   cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"row 101 has a list of parts as a message content"):
        check_loaded(loaded, "messages", recipe(tmp_path, "data.jsonl"), lambda i: f"row {i + 1}")
