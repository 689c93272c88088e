"""Training pieces that need no training: log prefixes, checkpoint markers, tokenizer and tokenization."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import json
from pathlib import Path

import pytest

from ctrain.errors import ConfigError
from ctrain.train import checkpoint
from ctrain.train.demo import addition_chat, builtin_rows
from ctrain.train.logs import PrefixedWriter
from ctrain.train.artifacts import COMPLETE_MARKER
from tests.conftest import require


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
    (directory / "weights.bin").write_bytes(b"x" * 10)
    if complete:
        checkpoint.write_marker(directory, {"step": step})
    return directory


def test_resume_takes_the_newest_complete_checkpoint(tmp_path: Path, caplog) -> None:
    import zlib

    _checkpoint(tmp_path, 10, True)
    twenty = _checkpoint(tmp_path, 20, True)
    torn = _checkpoint(tmp_path, 30, False)
    wrong = _checkpoint(tmp_path, 40, False)
    (wrong / COMPLETE_MARKER).write_text(json.dumps({"step": 39}))  # copied from elsewhere: not this one's
    found = checkpoint.scan(tmp_path)
    assert found.latest == twenty
    assert found.torn == [wrong, torn]
    lines = checkpoint.explain(found)
    assert any(str(torn) in line and "not finished" in line for line in lines)
    marker = json.loads((twenty / COMPLETE_MARKER).read_text())
    assert marker["step"] == 20 and marker["files"] == 1 and marker["bytes"] == 10
    assert marker["digest"] == "crc32"
    assert marker["manifest"] == {"weights.bin": [10, f"{zlib.crc32(b'x' * 10):08x}"]}
    assert not list(twenty.glob(".*tmp*"))
    with caplog.at_level("INFO", logger="ctrain.train"):
        assert checkpoint.choose(found) == twenty
    assert f"resuming from {twenty} (newest checkpoint with {COMPLETE_MARKER}; 1 files" in caplog.text


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        _checkpoint(tmp_path, step, True)
    torn = _checkpoint(tmp_path, 20, False)
    removed = checkpoint.rotate(tmp_path, 2, tmp_path / "checkpoint-15")
    assert [p.name for p in removed] == ["checkpoint-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-15", torn.name]
    assert checkpoint.rotate(tmp_path, None, tmp_path / "checkpoint-15") == []


def test_rotation_waits_for_the_new_checkpoint_and_spares_newer_ones(tmp_path: Path) -> None:
    """Nothing is deleted for a checkpoint that is not sealed, and never one newer than the one just sealed."""
    for step in (10, 20, 300):  # 300: from an earlier run in the same output directory
        _checkpoint(tmp_path, step, True)
    unsealed = _checkpoint(tmp_path, 30, False)
    assert checkpoint.rotate(tmp_path, 1, unsealed) == []
    checkpoint.write_marker(unsealed, {"step": 30})
    assert [p.name for p in checkpoint.rotate(tmp_path, 1, unsealed)] == ["checkpoint-20", "checkpoint-10"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-30", "checkpoint-300"]


# --- verification ---------------------------------------------------------------------------------


def _real_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint with the files the Trainer writes: safetensors weights, torch.save archives, JSON."""
    import torch
    from safetensors.torch import save_file

    directory = root / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(step)
    save_file({"w": torch.randn(64, 64, generator=generator), "b": torch.zeros(64)}, directory / "model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.randn(64, 64, generator=generator)}}}, directory / "optimizer.pt")
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    checkpoint.write_marker(directory, {"step": step})
    return directory


def _scramble(path: Path, offset: int | None = None) -> None:
    """Flip one byte (default: in the middle, in the tensors' data), keeping the size."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: _truncate(d / "model.safetensors"), "size"),
        (lambda d: _scramble(d / "model.safetensors"), "checksum"),
        (lambda d: _truncate(d / "optimizer.pt"), "size"),
        (lambda d: _scramble(d / "optimizer.pt"), "checksum"),
        (lambda d: (d / "trainer_state.json").unlink(), "missing"),
    ],
    ids=["truncated-weights", "scrambled-weights", "truncated-optimizer", "scrambled-optimizer", "missing-state"],
)
def test_verify_finds_damage_the_marker_did_not_record(tmp_path: Path, damage, reason: str) -> None:
    directory = _real_checkpoint(tmp_path, 10)
    intact = checkpoint.verify(directory)
    assert intact.damage is None and intact.checksummed and intact.files == 3
    damage(directory)
    verdict = checkpoint.verify(directory)
    assert verdict.damage is not None and verdict.damage.reason == reason, verdict


def test_checkpoints_marked_without_checksums_are_still_opened(tmp_path: Path) -> None:
    """Markers written before checksums were recorded: a short file still fails to open."""
    for step, name in ((10, "model.safetensors"), (20, "optimizer.pt")):
        directory = _real_checkpoint(tmp_path, step)
        legacy = json.loads((directory / COMPLETE_MARKER).read_text())
        del legacy["manifest"], legacy["digest"]
        (directory / COMPLETE_MARKER).write_text(json.dumps(legacy))
        verdict = checkpoint.verify(directory)
        assert verdict.damage is None and not verdict.checksummed
        assert "opened (no checksums in its marker)" in verdict.summary()
        _truncate(directory / name, 0.9)
        verdict = checkpoint.verify(directory)
        assert verdict.damage is not None and verdict.damage.reason == "unreadable" and verdict.damage.file == name


def test_a_damaged_checkpoint_is_moved_aside_and_the_older_one_resumes(tmp_path: Path, caplog) -> None:
    ten, twenty, thirty = (_real_checkpoint(tmp_path, step) for step in (10, 20, 30))
    _scramble(thirty / "model.safetensors")
    _truncate(twenty / "optimizer.pt")
    with caplog.at_level("INFO", logger="ctrain.train"):
        assert checkpoint.choose(checkpoint.scan(tmp_path)) == ten
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"{thirty} is damaged (model.safetensors: crc32 ")
    assert lines[0].endswith("moved it to checkpoint-30.damaged-checksum and falling back to checkpoint-20")
    assert lines[1].startswith(f"{twenty} is damaged (optimizer.pt: ")
    assert lines[1].endswith("moved it to checkpoint-20.damaged-size and falling back to checkpoint-10")
    assert lines[2].startswith(f"resuming from {ten} ")
    assert len(lines) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-10", "checkpoint-20.damaged-size", "checkpoint-30.damaged-checksum"
    ]  # fmt: skip
    assert (tmp_path / "checkpoint-30.damaged-checksum" / "model.safetensors").is_file(), "kept for inspection"
    # Damaged again later: the first one kept is not overwritten; nothing left to resume from: step 0.
    _scramble(ten / "trainer_state.json", 0)
    (tmp_path / "checkpoint-10.damaged-checksum").mkdir()
    caplog.clear()
    with caplog.at_level("INFO", logger="ctrain.train"):
        assert checkpoint.choose(checkpoint.scan(tmp_path)) is None
    assert (tmp_path / "checkpoint-10.damaged-unreadable").is_dir()
    assert caplog.records[-1].getMessage().endswith("falling back to step 0 (no older complete checkpoint)")


def test_ranks_share_the_files_once_each_and_evenly() -> None:
    sizes = {f"f{i}": size for i, size in enumerate([900, 500, 400, 300, 300, 100, 0, 0])}
    parts = [checkpoint.share(sizes, rank, 3) for rank in range(3)]
    assert sorted(n for part in parts for n in part) == sorted(sizes)
    loads = [sum(sizes[n] for n in part) for part in parts]
    assert max(loads) - min(loads) <= 200
    assert checkpoint.share(sizes, 0, 1) == sorted(sizes, key=lambda n: (-sizes[n], n))


def test_big_files_are_checksummed_in_segments_that_ranks_share(tmp_path: Path, monkeypatch) -> None:
    """One checksum per SEGMENT bytes, so one big file is read by several ranks and threads at once."""
    import zlib

    monkeypatch.setattr(checkpoint, "SEGMENT", 1000)
    directory = tmp_path / "checkpoint-1"
    directory.mkdir()
    data = bytes(range(256)) * 14  # 3584 bytes: 4 segments
    (directory / "optimizer.bin").write_bytes(data)
    (directory / "small.bin").write_bytes(b"abc")
    checkpoint.write_marker(directory, {"step": 1})
    entry = checkpoint.read_marker(directory)["manifest"]["optimizer.bin"]
    assert entry == [3584, [f"{zlib.crc32(data[i : i + 1000]):08x}" for i in range(0, 3584, 1000)]]
    sizes = {"optimizer.bin": 3584, "small.bin": 3}
    parts = [checkpoint.share(checkpoint.pieces(sizes), rank, 2) for rank in range(2)]
    assert {name for name, _ in parts[0]} & {name for name, _ in parts[1]} == {"optimizer.bin"}
    assert checkpoint.verify(directory).damage is None
    _scramble(directory / "optimizer.bin", 2500)
    damage = checkpoint.verify(directory).damage
    assert damage.reason == "checksum" and "of bytes 2,000-3,000" in damage.detail


def test_seal_marks_what_opens_and_leaves_a_broken_file_unmarked(tmp_path: Path) -> None:
    good = tmp_path / "checkpoint-5"
    good.mkdir()
    (good / "config.json").write_text("{}")
    assert checkpoint.seal(good, {"step": 5}) is None
    assert checkpoint.read_marker(good)["manifest"]["config.json"][0] == 2
    bad = tmp_path / "checkpoint-6"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    damage = checkpoint.seal(bad, {"step": 6})
    assert damage is not None and damage.reason == "unreadable"
    assert checkpoint.read_marker(bad) is None
    (bad / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")  # a header, not an object
    assert checkpoint.seal(bad, {"step": 6}).reason == "unreadable"
    fifo = tmp_path / "checkpoint-7"
    fifo.mkdir()
    (fifo / "config.json").write_text("{}")
    os.mkfifo(fifo / "optimizer.pt")  # a writer that never finished, or a trap: reading it would block
    damage = checkpoint.seal(fifo, {"step": 7})
    assert damage is not None and (damage.file, damage.detail) == ("optimizer.pt", "not a regular file")
    assert checkpoint.read_marker(fifo) is None


def test_checksums_match_the_standard_tools(tmp_path: Path) -> None:
    import hashlib
    import zlib

    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 70000)  # more than one chunk
    assert checkpoint.file_digest(path) == f"{zlib.crc32(path.read_bytes()):08x}"
    assert checkpoint.file_digest(path, "sha256") == hashlib.sha256(path.read_bytes()).hexdigest()


# --- non-finite losses, restarts at the end, eval of unfinished models ------------------------------


class _State:
    global_step = 12
    max_steps = 12


class _Control:
    should_save = should_log = should_training_stop = False


def test_a_nan_loss_or_gradient_norm_stops_the_run_naming_the_step() -> None:
    require("transformers")
    from ctrain.errors import NonFiniteTraining
    from ctrain.train.callbacks import FiniteGuard
    from ctrain.train.artifacts import NONFINITE_EXIT_CODE, PREEMPTED_EXIT_CODE

    assert NONFINITE_EXIT_CODE == NonFiniteTraining.exit_code == 65 != PREEMPTED_EXIT_CODE
    guard = FiniteGuard(check_grad_norm=True)
    guard.on_log(None, _State(), _Control(), logs={"loss": 1.5, "grad_norm": 3.0})
    guard.on_log(None, _State(), _Control(), logs={"eval_loss": float("nan")})  # not a training log
    with pytest.raises(NonFiniteTraining, match=r"^step 12: loss nan and grad_norm inf; training stopped before"):
        guard.on_log(None, _State(), _Control(), logs={"loss": float("nan"), "grad_norm": float("inf")})
    with pytest.raises(NonFiniteTraining, match=r"^step 12: grad_norm nan;"):
        guard.on_log(None, _State(), _Control(), logs={"loss": 0.0, "grad_norm": float("nan")})
    fp16 = FiniteGuard(check_grad_norm=False)  # the loss scaler skips steps with an infinite gradient norm
    fp16.on_log(None, _State(), _Control(), logs={"loss": 1.0, "grad_norm": float("inf")})
    with pytest.raises(NonFiniteTraining):
        fp16.on_log(None, _State(), _Control(), logs={"loss": float("inf")})
    control = _Control()
    guard.on_step_end(None, _State(), control)
    assert not control.should_log
    control.should_save = True
    guard.on_step_end(None, _State(), control)
    assert control.should_log, "a step that saves must be logged (and so checked) first"


def test_a_checkpoint_at_max_steps_trains_no_step() -> None:
    require("transformers")
    from ctrain.train.callbacks import AlreadyTrained, StopAtMaxSteps

    with pytest.raises(AlreadyTrained):
        StopAtMaxSteps().on_train_begin(None, _State(), _Control())
    state = _State()
    state.global_step = 11
    StopAtMaxSteps().on_train_begin(None, state, _Control())


FULL_DISK_BEATS = """
import errno, os, sys
from pathlib import Path
from ctrain.train.script import HeartbeatFile
where = Path(sys.argv[1])
beats = HeartbeatFile(where / "heartbeat", rank=1)
beats.beat(7)
filler = os.open(where / "filler", os.O_WRONLY | os.O_CREAT)  # the file system full: 30 bytes of a new file fail
try:
    while True:
        os.write(filler, bytes(4096))
except OSError as exc:
    assert exc.errno == errno.ENOSPC, exc
os.utime(beats.path, ns=(0, 0))
beats.beat(8)  # no exception: the time stamp moved on instead
print(beats.path.stat().st_mtime > 0, repr(beats.path.read_text().split()[0]))
try:
    HeartbeatFile(where / "heartbeat", rank=2).beat(8)  # no file yet: nothing to renew
except OSError as exc:
    print("first beat:", errno.errorcode[exc.errno])
"""


def test_a_heartbeat_on_a_full_file_system_renews_its_time_stamp(tmp_path: Path) -> None:
    """The project's file system full (the outputs may be elsewhere, with room): a beat cannot make a
    new file, so the heartbeat's time stamp, which the watchdog reads, is renewed instead, with one
    warning. Before, the beat's OSError ended a run that could go on."""
    import shutil

    from tests.conftest import need

    need(os.geteuid() == 0 and shutil.which("unshare") is not None, "root and unshare (a tmpfs)")
    script = 'mount -t tmpfs -o size=256k tmpfs "$1" || exit 99; exec "$2" -c "$3" "$1"'
    result = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(tmp_path), sys.executable, FULL_DISK_BEATS],
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True '7'", "first beat: ENOSPC"], result.stdout + result.stderr
    assert result.stderr.count("cannot write the heartbeat") == 1, result.stderr
    assert "its time stamp is renewed instead" in result.stderr


def test_heartbeat_names_step_host_and_pid_and_changes_at_each_beat(tmp_path: Path) -> None:
    """What the job's hang watchdog reads: one line per rank, rewritten whole, its mtime moving on."""
    require("transformers")
    import os
    import socket

    from ctrain.train.callbacks import Heartbeat

    beat = Heartbeat(tmp_path / "heartbeat", rank=3)
    state = _State()
    state.global_step = 4
    beat.on_step_end(None, state, _Control())
    path = tmp_path / "heartbeat" / "rank-3"
    assert path.read_text() == f"4 {socket.gethostname()} {os.getpid()}\n"
    os.utime(path, ns=(0, 0))
    state.global_step = 5
    beat.on_save(None, state, _Control())
    assert path.read_text().split()[0] == "5" and path.stat().st_mtime_ns > 0
    # Renamed into place: nothing half-written is left beside it.
    assert [p.name for p in (tmp_path / "heartbeat").iterdir()] == ["rank-3"]
    # Steps closer together than Heartbeat.EVERY write once (a shared filesystem takes the renames).
    state.global_step = 6
    beat.on_step_end(None, state, _Control())
    assert path.read_text().split()[0] == "5"
    beat.file.last -= beat.file.EVERY
    beat.on_step_end(None, state, _Control())
    assert path.read_text().split()[0] == "6"


def test_eval_refuses_models_ctrain_did_not_finish_saving(tmp_path: Path) -> None:
    from ctrain.train.evaluate import check_model_dir

    (tmp_path / "recipe.yaml").write_text("task: sft\n")  # a ctrain run directory
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ConfigError, match=f"{final} has no {COMPLETE_MARKER}: the run stopped while saving it"):
        check_model_dir(final)
    torn = tmp_path / "checkpoint-7"
    torn.mkdir()
    (torn / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="run the same `ctrain train` command again"):
        check_model_dir(torn)
    checkpoint.write_marker(final, {"step": 3})
    check_model_dir(final)
    _scramble(final / "config.json", 0)
    with pytest.raises(ConfigError, match=r"final is damaged \(config.json: "):
        check_model_dir(final)
    mine = tmp_path / "my-model"  # not ctrain's: no marker to ask for
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    check_model_dir(mine)
    trainers = tmp_path / "hf" / "checkpoint-500"  # a Trainer's output elsewhere: evaluated as it is
    trainers.mkdir(parents=True)
    (trainers / "config.json").write_text("{}")
    (trainers / "trainer_state.json").write_text("{}")
    check_model_dir(trainers)
    with pytest.raises(ConfigError, match="no trained model in"):
        check_model_dir(tmp_path / "nothing")


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

    require("transformers")
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

    require("transformers")
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


def python_program(program: str) -> subprocess.CompletedProcess[str]:
    """PROGRAM run by this Python with this checkout's ctrain, as its own process."""
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
    )  # fmt: skip


def test_exit_process_runs_exit_handlers_flushes_and_keeps_the_code(tmp_path: Path) -> None:
    """``ctrain train`` ends through exit_process: nothing Python would do at exit may be lost."""
    marker = tmp_path / "atexit-ran"
    program = (
        "import atexit, logging, sys\n"
        "from pathlib import Path\n"
        "from ctrain.train.logs import exit_process\n"
        f"atexit.register(lambda: Path({str(marker)!r}).write_text('yes'))\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "logging.getLogger('t').warning('logged line')\n"
        "sys.stdout.write('buffered, no newline')\n"
        "exit_process(75)\n"
        "print('never reached')\n"
    )
    result = python_program(program)
    assert result.returncode == 75, result.stderr
    assert result.stdout == "buffered, no newline"
    assert "logged line" in result.stderr
    assert marker.read_text() == "yes"


def test_shutdown_work_that_hangs_ends_the_process_with_the_outcome_and_says_where_it_hung() -> None:
    """A rank stuck closing its process group exits with its result, instead of holding the job for
    the launcher's 300 s exit barrier; a block that finishes in time changes nothing."""
    program = (
        "import threading, time\n"
        "from ctrain.train.logs import deadline\n"
        "with deadline('quick work', 3, seconds=30):\n"
        "    pass\n"
        "print('past the quick block', flush=True)\n"
        "with deadline('closing the process group', 75, seconds=1):\n"
        "    threading.Event().wait()\n"
        "print('never reached')\n"
    )
    started = time.monotonic()
    result = python_program(program)
    assert result.returncode == 75, result.stderr
    assert time.monotonic() - started < 120  # a hang guard: the wait never ends by itself
    assert result.stdout == "past the quick block\n"
    assert "ctrain: closing the process group has not finished after 1 s; " in result.stderr
    assert "(most recent call first)" in result.stderr and "line 7" in result.stderr, result.stderr


def test_after_an_error_the_process_ends_without_freeing_what_it_kept() -> None:
    """The error is reported as Python reports it, then the process ends with the cause's code and
    never frees the kept objects (a DDP model's destructor can deadlock with gloo's threads)."""
    program = (
        "from ctrain.train.logs import exit_at_shutdown, keep_until_exit\n"
        "class Model:\n"
        "    def __del__(self):\n"
        "        print('freed', flush=True)\n"
        "keep_until_exit(Model())\n"
        "exit_at_shutdown(3)\n"
        "raise ValueError('shapes differ')\n"
    )
    result = python_program(program)
    assert result.returncode == 3
    assert "Traceback" in result.stderr and "ValueError: shapes differ" in result.stderr
    assert "freed" not in result.stdout


def test_the_final_model_dtype_is_the_pretrained_ones_unless_set() -> None:
    import torch
    from transformers import AutoConfig

    from ctrain.train.model import final_dtype
    from ctrain.train.recipe import Recipe

    config = AutoConfig.for_model("llama")
    pretrained = Recipe()
    pretrained.model.path = "base"
    for stated, expected in [("bfloat16", torch.bfloat16), (torch.float16, torch.float16), (None, torch.float32),
                             ("int8", torch.float32)]:  # fmt: skip
        config.dtype = stated
        assert final_dtype(pretrained, config, "bf16") == expected, stated
    config.dtype = torch.bfloat16
    pretrained.model.save_dtype = "float32"
    assert final_dtype(pretrained, config, "bf16") == torch.float32
    new = Recipe()
    new.model.config = "llama"
    assert final_dtype(new, config, "bf16") == torch.float32  # the masters it trained
    new.training.deepspeed = "ds.json"
    assert final_dtype(new, config, "bf16") == torch.bfloat16  # DeepSpeed trains the model in bf16
    new.model.dtype = "float16"
    assert final_dtype(new, config, "fp16") == torch.float16


LLAMA_8B = 8_030_261_248  # parameters of the Llama-3.1-8B shape (the bench's model)
# GPU memory: an 80 GB card's 79.2 GiB, and what torch reports for an H200 (measured: total_memory, 139.8 GiB).
H100, H200 = 85_045_510_144, 150_109_880_320


def test_the_llama_8b_shape_is_counted_exactly_without_memory() -> None:
    from transformers import AutoConfig

    from ctrain.train.model import count_parameters
    from ctrain.train.recipe import Recipe

    config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)  # fmt: skip
    pretrained = Recipe()
    pretrained.model.path = "base"
    assert count_parameters(pretrained, config) == LLAMA_8B
    new = Recipe()
    new.model.config = "llama"  # its vocabulary comes from the tokenizer: embeddings of one token each
    assert count_parameters(new, config) == LLAMA_8B - 2 * (128256 - 1) * 4096
    new.model.config_overrides = {"vocab_size": 128256}
    assert count_parameters(new, config) == LLAMA_8B


def test_a_full_fine_tune_that_cannot_fit_its_gpus_is_refused_with_the_fix() -> None:
    from ctrain.train.model import check_fits
    from ctrain.train.recipe import Recipe

    recipe = Recipe()
    recipe.training.fsdp = True
    line = check_fits(recipe, LLAMA_8B, "bf16", 4, H100, "NVIDIA H100 80GB HBM3")
    assert line == (
        "memory per GPU: the weights, their gradients and AdamW state 29.9 GiB (16 bytes x 8.03e+09 parameters / 4 "
        "ranks) of one GPU's 79.2 GiB (NVIDIA H100 80GB HBM3); the rest is for activations"
    )
    with pytest.raises(ConfigError) as err:
        check_fits(recipe, LLAMA_8B, "bf16", 1, H100, "NVIDIA H100 80GB HBM3")
    assert str(err.value) == (
        "the weights, their gradients and AdamW state (16 bytes per parameter in float32) are 119.7 GiB per GPU for "
        "8.03e+09 parameters sharded over 1 rank(s), more than one GPU's 79.2 GiB (NVIDIA H100 80GB HBM3): run on "
        "at least 2 GPUs of this size (more for the activations), or train adapters (peft.method: lora)"
    )
    check_fits(recipe, LLAMA_8B, "bf16", 1, H200, "H200")  # 119.7 of 139.8 GiB: the floor fits
    recipe.training.fsdp = False
    with pytest.raises(ConfigError, match=r"119.7 GiB per GPU for 8.03e\+09 parameters whole on every GPU \(no "
                                          r"training.fsdp\), more than .*: set training.fsdp: true to shard it over "
                                          r"the GPUs \(at least 2 of this size\)"):  # fmt: skip
        check_fits(recipe, LLAMA_8B, "bf16", 8, H100, "H100")
    recipe.training.optim = "sgd"  # no state: weights and gradients only
    assert "8 bytes x 8.03e+09 parameters" in check_fits(recipe, LLAMA_8B, "bf16", 8, H100, "H100")
    recipe.training.optim = "auto"
    recipe.training.fsdp, recipe.training.fsdp_config = True, {"cpu_offload": True}  # the state in host memory
    assert check_fits(recipe, LLAMA_8B, "bf16", 1, H100, "H100") == (
        "memory per GPU: the weights, their gradients and AdamW state (119.7 GiB per rank) live in host memory "
        "(training.fsdp_config.cpu_offload), after each rank reads 29.9 GiB onto one GPU's 79.2 GiB (H100)"
    )
    recipe.training.fsdp, recipe.training.fsdp_config = False, {}
    recipe.model.dtype = "bfloat16"  # everything in bf16: half of it
    assert "8 bytes x 8.03e+09 parameters" in check_fits(recipe, LLAMA_8B, "bf16", 8, H100, "H100")


def test_under_fsdp_the_whole_model_must_fit_one_gpu_for_the_load() -> None:
    from ctrain.train.model import check_fits
    from ctrain.train.recipe import Recipe

    recipe = Recipe()
    recipe.training.fsdp = True
    seventy = 70_553_706_496
    with pytest.raises(ConfigError) as err:
        check_fits(recipe, seventy, "bf16", 64, H200, "H200")  # 16 GiB of state per GPU, but 263 GiB to read
    assert str(err.value) == (
        "under training.fsdp every rank reads the whole model onto its GPU before sharding it: 7.06e+10 parameters "
        "in float32 are 262.8 GiB, more than one GPU's 139.8 GiB (H200); use GPUs with more memory, or train "
        "adapters (peft.method: lora or qlora)"
    )


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_a_checkpoint_read_straight_to_a_device_equals_the_one_read_in_float32(
    model_type: str, trained_tokenizer, tmp_path: Path
) -> None:
    """Under FSDP the weights go straight to the rank's device (here the CPU stands in for it): read
    in their stored bf16 and widened there when the model makes its buffers in float32 (Llama), read
    in float32 as before when it does not (Gemma's embedding scale); either way the model read on the
    host in float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ctrain.train.model import _read_dtype, build_model, load_config
    from ctrain.train.recipe import Recipe

    shape = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 vocab_size=len(trained_tokenizer))  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(shape, dtype=torch.bfloat16).save_pretrained(tmp_path / "base")
    recipe = Recipe()
    recipe.model.path = str(tmp_path / "base")
    config = load_config(recipe)
    expected = torch.bfloat16 if model_type == "llama" else torch.float32
    assert _read_dtype(recipe, config, torch.float32) == expected
    assert config.dtype == torch.bfloat16, "the check changed the config"
    on_device = build_model(recipe, config, trained_tokenizer, "fp32", "cpu", torch.device("cpu"))
    on_host = build_model(recipe, load_config(recipe), trained_tokenizer, "fp32", "cpu")
    assert on_device.dtype == on_host.dtype == torch.float32 and on_device.config.dtype == torch.float32
    mine = {**dict(on_device.named_parameters()), **dict(on_device.named_buffers())}
    theirs = {**dict(on_host.named_parameters()), **dict(on_host.named_buffers())}
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    batch = torch.tensor([[1, 5, 9, 12, 7]])
    assert torch.equal(on_device(batch).logits, on_host(batch).logits)


def test_a_full_file_system_is_told_from_other_save_errors(tmp_path: Path, monkeypatch) -> None:
    """ENOSPC or EDQUOT anywhere in the chain, or their words, say the disk is full; an error with no
    such sign is one only where almost nothing is free (torch's ``unexpected pos`` for the same write)."""
    import errno

    unexpected = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 193280 vs 193172")
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as quota:
            raise RuntimeError("saving the optimizer failed") from quota
    except RuntimeError as chained:
        assert checkpoint.out_of_space(chained, tmp_path)
    assert checkpoint.out_of_space(RuntimeError("write failed: No space left on device"), tmp_path)
    assert not checkpoint.out_of_space(unexpected, tmp_path)  # this file system has room
    monkeypatch.setattr(checkpoint, "free_bytes", lambda directory: checkpoint.FULL_BELOW - 1)
    assert checkpoint.out_of_space(unexpected, tmp_path)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda directory: None)
    assert not checkpoint.out_of_space(unexpected, tmp_path)


def test_a_full_disk_removes_only_what_was_not_finished(tmp_path: Path) -> None:
    """The unmarked checkpoint and final model go (nothing could resume from them); complete ones stay."""
    for step in (10, 20):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"\0" * 64)
    checkpoint.write_marker(tmp_path / "checkpoint-10", {"step": 10, "world_size": 1})
    (tmp_path / "final").mkdir()
    gone = checkpoint.discard_unfinished(tmp_path, tmp_path / "final")
    assert sorted(p.name for p in gone) == ["checkpoint-20", "final"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10"]
    assert checkpoint.size_of(tmp_path / "checkpoint-10") == 64


@pytest.mark.parametrize(
    ("manifest", "digest", "file", "says"),
    [
        ({"config.json": None}, "crc32", "fifo", "not a regular file"),
        ({"config.json": [0, "00000000"]}, "crc32", "device", "not a regular file"),
        ({"config.json": [10**18, "0"]}, "crc32", "file", "is not [size, checksum]"),
        ({"config.json": "x"}, "crc32", "file", "is not [size, checksum]"),
        ({"config.json": [2, "0"]}, "nope", "file", "names no known checksum"),
        ({"../../etc/passwd": [5, "0"]}, "crc32", "file", "outside the checkpoint"),
    ],
)
def test_a_hostile_marker_is_damage_never_a_hang_or_a_crash(tmp_path: Path, manifest, digest, file, says) -> None:
    """verify reads what the marker names: only regular files inside the checkpoint, with sizes a file can have."""
    directory = tmp_path / "final"
    directory.mkdir()
    target = directory / "config.json"
    if file == "fifo":
        os.mkfifo(target)
    elif file == "device":
        target.symlink_to("/dev/zero")
    else:
        target.write_text("{}")
    (directory / COMPLETE_MARKER).write_text(json.dumps({"step": 1, "world_size": 1, "digest": digest,
                                                         "manifest": manifest}))  # fmt: skip
    verdict = checkpoint.verify(directory)
    assert verdict.damage is not None and says in str(verdict.damage)


def test_an_output_directory_holding_only_its_prepared_data_is_owned_however_the_path_is_spelled(
    tmp_path: Path, monkeypatch
) -> None:
    from ctrain.train import rundir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "prepared").mkdir(parents=True)
    rundir.check_owned(Path("out"), tmp_path / "out" / "prepared")  # absolute against relative: the same directory
    rundir.check_owned(tmp_path / "out", Path("./out/prepared"))
    (tmp_path / "out" / "checkpoint-5").mkdir()
    with pytest.raises(ConfigError, match=r"holds files no ctrain run wrote \(checkpoint-5; no recipe.yaml\)"):
        rundir.check_owned(Path("out"), tmp_path / "out" / "prepared")


def test_variables_a_path_names_and_the_environment_lacks(monkeypatch) -> None:
    from ctrain.train.recipe import unset_variables

    monkeypatch.setenv("CTRAIN_TEST_SET", "x")
    monkeypatch.delenv("CTRAIN_TEST_UNSET", raising=False)
    assert unset_variables("$CTRAIN_TEST_SET/a/${CTRAIN_TEST_UNSET}/$CTRAIN_TEST_UNSET") == ["CTRAIN_TEST_UNSET"]
    assert unset_variables("outputs/plain") == [] and unset_variables(None) == []


def test_a_base_models_eval_result_before_training_is_ctrains_own(tmp_path: Path) -> None:
    """The LoRA demo evaluates the base model into the output directory, then trains there."""
    from ctrain.train import rundir

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "eval.json").write_text("{}")
    rundir.check_owned(tmp_path / "out", tmp_path / "out" / "prepared")
