"""Training pieces that need no training: log prefixes, checkpoint markers, tokenizer and tokenization."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ctrain.errors import ConfigError
from ctrain.train import checkpoint
from ctrain.train.demo import addition_chat, builtin_rows
from ctrain.train.logs import PrefixedWriter
from ctrain.train.recipe import COMPLETE_MARKER


def test_every_line_gets_the_rank_prefix() -> None:
    out = io.StringIO()
    writer = PrefixedWriter(out, "[rank 1 host n2] ")
    writer.write("first\nsecond ")
    writer.write("half\n\nprogress 10%\rprogress 20%\r")
    assert out.getvalue() == (
        "[rank 1 host n2] first\n[rank 1 host n2] second half\n\n"
        "[rank 1 host n2] progress 10%\r[rank 1 host n2] progress 20%\r"
    )


def _checkpoint(root: Path, step: int, complete: bool) -> Path:
    directory = root / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"x" * 10)
    if complete:
        checkpoint.write_marker(directory, {"step": step})
    return directory


def test_resume_takes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 10, True)
    twenty = _checkpoint(tmp_path, 20, True)
    torn = _checkpoint(tmp_path, 30, False)
    wrong = _checkpoint(tmp_path, 40, False)
    (wrong / COMPLETE_MARKER).write_text(json.dumps({"step": 39}))  # copied from elsewhere: not this one's
    found = checkpoint.scan(tmp_path)
    assert found.latest == twenty
    assert found.torn == [wrong, torn]
    lines = checkpoint.explain(found)
    assert lines[0].startswith(f"resuming from {twenty}")
    assert any(str(torn) in line and "not finished" in line for line in lines)
    marker = json.loads((twenty / COMPLETE_MARKER).read_text())
    assert marker["step"] == 20 and marker["files"] == 1 and marker["bytes"] == 10
    assert not list(twenty.glob(".*tmp"))


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        _checkpoint(tmp_path, step, True)
    torn = _checkpoint(tmp_path, 20, False)
    removed = checkpoint.rotate(tmp_path, 2)
    assert [p.name for p in removed] == ["checkpoint-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-15", torn.name]
    assert checkpoint.rotate(tmp_path, None) == []


def test_addition_data_is_every_problem_once_in_a_seeded_order() -> None:
    rows = builtin_rows("addition", 1)
    assert len(rows) == 90 * 90
    assert rows == builtin_rows("addition", 1) and rows != builtin_rows("addition", 2)
    assert addition_chat(47, 38)[1] == {"role": "assistant", "content": "85"}


@pytest.fixture(scope="module")
def trained_tokenizer():
    from ctrain.train.recipe import TokenizerTraining
    from ctrain.train.tokenizer import train_tokenizer

    texts = [m["content"] for row in builtin_rows("addition", 0)[:2000] for m in row["messages"]]
    return train_tokenizer(texts, TokenizerTraining(vocab_size=300))


def test_trained_tokenizer_reads_digits_one_by_one(trained_tokenizer) -> None:
    tokens = trained_tokenizer.tokenize("What is 47 + 38?")
    assert [t for t in tokens if t.strip("Ġ").isdigit()] == ["4", "7", "3", "8"]
    assert trained_tokenizer.decode(trained_tokenizer("What is 47 + 38?")["input_ids"]) == "What is 47 + 38?"


def test_loss_only_on_what_the_assistant_says(trained_tokenizer) -> None:
    from ctrain.train.data import tokenize_sft_example

    columns = {"messages": "messages", "prompt": "prompt", "completion": "completion", "text": "text"}
    row = tokenize_sft_example({"messages": addition_chat(47, 38)}, trained_tokenizer, "messages", columns, True, None)
    learned = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert trained_tokenizer.decode(learned) == "85<|end|>"
    assert row["input_ids"][0] == trained_tokenizer.bos_token_id
    text = tokenize_sft_example({"prompt": "2+2=", "completion": "4"}, trained_tokenizer, "prompt_completion",
                                columns, True, None)  # fmt: skip
    learned = [t for t, label in zip(text["input_ids"], text["labels"]) if label != -100]
    assert trained_tokenizer.decode(learned) == "4<|end|>"


def test_causal_lm_blocks_like_run_clm() -> None:
    from ctrain.train.data import _group_blocks

    out = _group_blocks({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}, 4)
    assert out["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert out["labels"] == out["input_ids"]


def test_every_local_format_loads_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from ctrain.train.data import load_raw
    from ctrain.train.recipe import Recipe

    rows = [{"text": f"document {i}"} for i in range(6)]
    table = datasets.Dataset.from_list(rows)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "shards").mkdir()
    table.select(range(3)).to_parquet(str(tmp_path / "shards/a.parquet"))
    table.select(range(3, 6)).to_parquet(str(tmp_path / "shards/b.parquet"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    for source in ("d.jsonl", "d.json", "d.csv", "d.parquet", "saved", "splits", "shards", "shards/*.parquet"):
        recipe = Recipe(task="clm")
        recipe.data.source = source
        train, held_out = load_raw(recipe)
        assert sorted(train["text"]) == [r["text"] for r in rows], source
        assert held_out is None
    recipe = Recipe(task="clm")
    recipe.data.source, recipe.data.eval_split = "splits", "test"
    assert load_raw(recipe)[1]["text"] == ["document 0"]
    recipe.data.eval_split = "validation"
    with pytest.raises(ConfigError, match="has no split 'validation'; splits: train, test"):
        load_raw(recipe)


def test_preemption_handler_survives_a_library_replacing_or_blocking_it(caplog) -> None:
    """A signal must reach ctrain's handler even if something installed its own or blocked it after start."""
    import os
    import signal

    pytest.importorskip("transformers")
    from ctrain.train.callbacks import Preemption

    class State:
        global_step = 3

    class Control:
        should_save = should_training_stop = False

    preemption = Preemption([signal.SIGUSR1], "cpu")
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
        control = Control()
        preemption.on_step_end(None, State(), control)
        assert not control.should_save
        assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert "SIGUSR1 blocked" in caplog.text and "handler was replaced" in caplog.text
        os.kill(os.getpid(), signal.SIGUSR1)
        preemption.on_step_end(None, State(), control)
        assert preemption.received == signal.SIGUSR1 and preemption.stopped_at == 3
        assert control.should_save and control.should_training_stop
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])
        preemption.restore()


def test_preemption_handler_survives_a_native_library_taking_the_signal() -> None:
    """sigaction() from C replaces Python's handler without Python knowing; the next step takes it back."""
    import ctypes
    import os
    import signal
    import time

    pytest.importorskip("transformers")
    from ctrain.train.callbacks import Preemption

    class State:
        global_step = 7

    class Control:
        should_save = should_training_stop = False

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    preemption = Preemption([signal.SIGUSR1], "cpu")
    try:
        libc.signal(signal.SIGUSR1, 1)  # SIG_IGN, set in C: Python's table still names ctrain's handler
        assert signal.getsignal(signal.SIGUSR1) == preemption._handle
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert preemption.received is None, "the signal should have been lost to the native handler"
        control = Control()
        preemption.on_step_end(None, State(), control)
        os.kill(os.getpid(), signal.SIGUSR1)
        preemption.on_step_end(None, State(), control)
        assert preemption.received == signal.SIGUSR1 and preemption.stopped_at == 7 and control.should_save
    finally:
        preemption.restore()
