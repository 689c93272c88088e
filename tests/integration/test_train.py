"""`ctrain train / prepare / eval` for real: one process and torchrun (gloo, CPU), killed, preempted, resumed.

Everything but the demo test uses the tiny recipe (tests/plugins/train.py): the demo's data and
trainer at a size that trains in seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctrain.train import checkpoint
from ctrain.train.artifacts import COMPLETE_MARKER, NONFINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, PREEMPTED_FILE
from tests.plugins.train import (
    REPO,
    TINY_RECIPE,
    TORCHRUN,
    assert_same_state,
    losses,
    run_ctrain,
    start,
    train_env,
    wait_for,
)

pytestmark = pytest.mark.integration


def complete(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file()


# --- errors before any work -----------------------------------------------------------------------


BAD = [
    ("unknown key", ["training.max_step=5"], {}, "unknown key 'training.max_step' (did you mean 'max_steps'?)"),
    ("missing path", ["data.source=./missing.jsonl"], {}, "data.source: ./missing.jsonl does not exist"),
    ("missing column", ["data.source=qa.jsonl"], {}, "has columns question, answer; an sft recipe needs"),
    ("too long", ["data.max_length=128"], {}, "data.max_length (128) is larger than the model's"),
    ("batch 0", ["training.global_batch_size=0"], {}, "training.global_batch_size is 0"),
    ("world size", [], {"WORLD_SIZE": "3"}, "global_batch_size (16) does not divide among 3 processes"),
    ("model field", ["model.config_overrides.hiden_size=8"], {}, "llama configs have no field 'hiden_size'"),
    ("unreadable", ["training.deepspeed=broken.json"], {}, "broken.json is not valid JSON"),
    ("hub offline", ["hub.repo_id=me/adder"], {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    # wandb is installed here (for test_one_wandb_run_across_a_requeue): a package of that name that is
    # not there, ahead of it on the path, stands for a machine without it.
    ("wandb missing", ["logging.wandb_project=adder"], {"PYTHONPATH": "{work}/no-wandb"},
     "includes wandb, which is not installed"),
]


@pytest.mark.parametrize(("overrides", "env", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_recipe_is_one_error_and_no_training(tiny_recipe: Path, overrides: list[str], env: dict[str, str],
                                                 message: str) -> None:  # fmt: skip
    work = tiny_recipe.parent
    (work / "qa.jsonl").write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    (work / "broken.json").write_text('{"zero_optimization": ')
    (work / "no-wandb" / "wandb").mkdir(parents=True)
    (work / "no-wandb" / "wandb" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    env = {key: value.format(work=work) for key, value in env.items()}
    result = subprocess.run(
        [sys.executable, "-m", "ctrain", "train", tiny_recipe.name, *overrides],
        cwd=work, env={**os.environ, **env}, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "error: " in output and message in output, output
    assert "Traceback" not in output
    assert "step " not in output
    assert not (work / "outputs").exists(), "an output directory was written for a recipe that cannot train"


# --- data -----------------------------------------------------------------------------------------


def test_prepare_then_train_uses_the_same_data(tiny_recipe: Path, ctrain) -> None:
    import datasets

    work = tiny_recipe.parent
    prepared = ctrain("prepare", tiny_recipe.name)
    assert prepared.returncode == 0, prepared.stderr
    assert "train: 1024 rows" in prepared.stdout and "eval: 64 rows" in prepared.stdout
    on_the_fly = ctrain("train", tiny_recipe.name, "training.output_dir=outputs/fly", "training.max_steps=2")
    assert on_the_fly.returncode == 0, on_the_fly.stderr
    assert "no prepared data in outputs/fly/prepared: preparing it now" in on_the_fly.stderr
    for split in ("train", "eval"):
        a = datasets.load_from_disk(str(work / "outputs/tiny/prepared" / split))
        b = datasets.load_from_disk(str(work / "outputs/fly/prepared" / split))
        assert a.column_names == b.column_names == ["input_ids", "labels"]
        assert a[:] == b[:], f"{split}: prepared and on-the-fly rows differ"
    vocab = [json.loads((work / d / "tokenizer/tokenizer.json").read_text())["model"]["vocab"]
             for d in ("outputs/tiny/prepared", "outputs/fly/prepared")]  # fmt: skip
    assert vocab[0] == vocab[1]

    trained = ctrain("train", tiny_recipe.name, "training.max_steps=2")
    assert trained.returncode == 0, trained.stderr
    assert "using prepared data in outputs/tiny/prepared" in trained.stderr
    assert "tokenizing" not in trained.stderr.lower()

    stale = ctrain("train", tiny_recipe.name, "training.output_dir=outputs/stale",
                   "data.prepared_dir=outputs/tiny/prepared", "data.max_length=48")  # fmt: skip
    assert stale.returncode == 2, stale.stderr
    assert not (work / "outputs/stale").exists()
    assert "does not match the recipe (max_length: prepared 64, recipe 48)" in stale.stderr
    assert "ctrain prepare --force" in stale.stderr


def test_damaged_prepared_data_is_set_aside_and_prepared_again(tiny_recipe: Path, ctrain) -> None:
    """A prepared Arrow file scrambled in place (its size unchanged) loaded without a word, and the run
    failed at its first step inside torch. The marker records each file's size and checksum: `ctrain train` finds either, moves the data set aside (kept) and prepares it again, and
    `ctrain prepare` does the same; the rebuilt rows equal the first ones."""
    import datasets

    work = tiny_recipe.parent
    prepared = work / "outputs/tiny/prepared"
    assert ctrain("prepare", tiny_recipe.name).returncode == 0
    marker = json.loads((prepared / "ctrain-prepared.json").read_text())
    assert marker["digest"] == "crc32" and "train/data-00000-of-00001.arrow" in marker["manifest"], marker
    rows = datasets.load_from_disk(str(prepared / "train"))[:]
    arrow = prepared / "train/data-00000-of-00001.arrow"
    with arrow.open("r+b") as f:
        f.seek(arrow.stat().st_size // 2)
        f.write(bytes(64))
    trained = ctrain("train", tiny_recipe.name, "training.max_steps=2")
    assert trained.returncode == 0, trained.stderr
    assert re.search(r"the prepared data in outputs/tiny/prepared is damaged \(train/data-00000-of-00001\.arrow: crc32 "
                     r"\w+, the marker recorded \w+\): moved it to prepared\.damaged-checksum and preparing it again",
                     trained.stderr), trained.stderr  # fmt: skip
    assert (work / "outputs/tiny/prepared.damaged-checksum/train/data-00000-of-00001.arrow").is_file()
    assert datasets.load_from_disk(str(prepared / "train"))[:] == rows
    again = ctrain("train", tiny_recipe.name, "training.max_steps=2", "training.output_dir=outputs/again",
                   "data.prepared_dir=outputs/tiny/prepared")
    assert again.returncode == 0, again.stderr
    assert re.search(r"prepared data in outputs/tiny/prepared: \d+ files, [\d.]+ MB verified in", again.stderr)
    with arrow.open("r+b") as f:
        f.truncate(arrow.stat().st_size - 100)
    rebuilt = ctrain("prepare", tiny_recipe.name)
    assert rebuilt.returncode == 0, rebuilt.stderr
    output = rebuilt.stdout + rebuilt.stderr
    assert "is damaged (train/data-00000-of-00001.arrow: " in output and "moved it to prepared.damaged-size" in output
    assert datasets.load_from_disk(str(prepared / "train"))[:] == rows


def test_causal_lm_from_files_and_streamed(tmp_path: Path, ctrain) -> None:
    words = ["the", "cluster", "trains", "a", "model", "on", "every", "node", "and", "saves", "it"]
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 9)) for i in range(400)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    recipe = tmp_path / "clm.yaml"
    recipe.write_text(
        TINY_RECIPE.replace("task: sft", "task: clm")
        .replace("source: builtin:addition", "source: corpus.jsonl")
        .replace("  max_length: 64\n", "  max_length: 32\n")
        .replace("  max_examples: 1024\n", "")
        .replace("  eval_size: 64\n", "  eval_size: 40\n")
    )
    trained = ctrain("train", "clm.yaml", "training.max_steps=12", "training.eval_steps=6")
    assert trained.returncode == 0, trained.stderr
    assert "(clm, engine hf" in trained.stderr
    evals = [line for line in trained.stderr.splitlines() if "eval: " in line and "eval_loss" in line]
    assert len(evals) == 2, trained.stderr
    import datasets

    blocks = datasets.load_from_disk(str(tmp_path / "outputs/clm/prepared/train"))
    assert {len(row) for row in blocks["input_ids"]} == {32} and blocks[0]["labels"] == blocks[0]["input_ids"]

    streamed = ctrain("train", "clm.yaml", "data.streaming=true", "data.eval_size=null", "training.max_steps=5",
                      "training.output_dir=outputs/streamed", "tokenizer.train=null",
                      "tokenizer.path=outputs/clm/final")  # fmt: skip
    assert streamed.returncode == 0, streamed.stderr
    assert "step 5/5" in streamed.stderr
    assert not (tmp_path / "outputs/streamed/prepared").exists()


# --- checkpoints, kills, preemption ---------------------------------------------------------------


def test_killed_run_resumes_from_the_last_complete_checkpoint(tiny_recipe: Path, ctrain) -> None:
    work = tiny_recipe.parent
    common = [tiny_recipe.name, "training.max_steps=150", "data.prepared_dir=prepared"]
    reference = ctrain("train", *common, "training.output_dir=outputs/whole")
    assert reference.returncode == 0, reference.stderr
    (whole,) = losses(work / "outputs/whole").values()

    killed_dir = work / "outputs/killed"
    process = start(["train", *common, f"training.output_dir={killed_dir}"], work, work / "killed.log")
    wait_for(lambda: complete(killed_dir / "checkpoint-10"), process, "the first checkpoint")
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not complete(killed_dir / "final"), "the run finished before it could be killed"
    resumed_from = max(int(p.name.split("-")[1]) for p in killed_dir.glob("checkpoint-*") if complete(p))
    torn = killed_dir / "checkpoint-140"  # as a kill during its save leaves it
    torn.mkdir(exist_ok=True)
    (torn / "model.safetensors").write_bytes(b"\0" * 100)

    again = ctrain("train", *common, f"training.output_dir={killed_dir}")
    assert again.returncode == 0, again.stderr
    assert f"resuming from {killed_dir}/checkpoint-{resumed_from} " in again.stderr
    assert f"ignoring {torn}: no {COMPLETE_MARKER}" in again.stderr
    runs = losses(killed_dir)
    second = runs[max(runs)]
    assert min(second) == resumed_from + 1, "the resumed run did not continue at the checkpoint's step"
    assert sorted(second) == list(range(resumed_from + 1, 151))
    for step, loss in second.items():
        assert loss == pytest.approx(whole[step], rel=1e-4, abs=1e-5), f"step {step}"
    assert complete(killed_dir / "final")


def test_a_save_that_fills_the_disk_ends_the_run_in_one_error_and_it_resumes_once_there_is_room(
    tiny_recipe: Path, ctrain
) -> None:
    """The output directory on a file system of 700 KiB (a tmpfs, in a mount namespace of the runs.
    own): checkpoint-10 fits, checkpoint-20 does not. torch reports that save
    as ``unexpected pos``; ctrain says the disk is full, removes the unfinished checkpoint, keeps
    checkpoint-10 and records the cause as not worth a requeue. With the file system grown, the same
    command resumes from checkpoint-10 to the uninterrupted run's losses."""
    work = tiny_recipe.parent
    common = [tiny_recipe.name, "training.max_steps=30", "data.prepared_dir=prepared"]
    reference = ctrain("train", *common, "training.output_dir=outputs/whole")
    assert reference.returncode == 0, reference.stderr
    (whole,) = losses(work / "outputs/whole").values()

    output, exits_dir = work / "outputs/full", work / "exits"
    output.mkdir(parents=True)
    train = " ".join([sys.executable, "-m", "ctrain", "train", *common, f"training.output_dir={output}"])
    script = (f"mount -t tmpfs -o size=700k tmpfs {output} || exit 99; "
              f"CTRAIN_EXITS={exits_dir} {train} >full.out 2>full.err; echo $? >full.rc; "
              f"ls -A {output} >full.ls; mount -o remount,size=8m {output} && "
              f"{train} >again.out 2>again.err; echo $? >again.rc; cp -r {output} {work}/kept")  # fmt: skip
    started = time.monotonic()
    subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=work, env=train_env(work), check=True, timeout=600)
    took = time.monotonic() - started
    err = (work / "full.err").read_text()

    assert (work / "full.rc").read_text().split() == ["1"], err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert re.search(rf"the file system of {output} is full \(\d+\.\d MiB free\) and a save failed", errors[0])
    assert "removed the unfinished checkpoint-20; checkpoint-10 is the newest complete checkpoint" in errors[0]
    assert errors[0].endswith("then run the same command again: it resumes from checkpoint-10")
    assert "checkpoint-10 took 0.4 MiB" in err and "the next checkpoint will not fit" in err  # warned a save earlier
    assert "checkpoint-20" not in (work / "full.ls").read_text().split()
    assert (exits_dir / "rank-0").read_text().split()[:3] == ["1", "disk-full", "end"]

    again = (work / "again.err").read_text()
    assert (work / "again.rc").read_text().split() == ["0"], again
    assert f"resuming from {output}/checkpoint-10 " in again
    runs = losses(work / "kept")
    second = runs[max(runs)]
    assert sorted(second) == list(range(11, 31))
    for step, loss in second.items():
        assert loss == pytest.approx(whole[step], rel=1e-4, abs=1e-5), f"step {step}"
    assert complete(work / "kept/final")
    assert took < 120, f"the two runs took {took:.0f} s"


@pytest.mark.full
def test_preempted_run_checkpoints_exits_75_and_resumes(tiny_recipe: Path, ctrain) -> None:
    """Full tier alone; CI tier: test_faults_in_turn_each_checkpoint_resume_or_end_the_run (TERM and USR1: a
    complete checkpoint, exit 75, resumed) and
    test_a_signalled_script_checkpoints_exits_75_and_resumes_to_the_same_losses."""
    work = tiny_recipe.parent
    output = work / "outputs/tiny"
    args = ["train", tiny_recipe.name, "training.max_steps=300", "training.save_steps=5000"]
    process = start(args, work, work / "preempt.log")
    log = work / "preempt.log"
    wait_for(lambda: "step 5/300" in log.read_text(), process, "step 5")
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=300) == PREEMPTED_EXIT_CODE, log.read_text()
    info = json.loads((output / PREEMPTED_FILE).read_text())
    assert info["signal"] == "SIGUSR1" and info["exit_code"] == PREEMPTED_EXIT_CODE
    step = info["step"]
    assert 5 <= step < 300
    assert complete(output / f"checkpoint-{step}")
    assert "preemption (SIGUSR1): saving a complete checkpoint" in log.read_text()

    again = ctrain(*args)
    assert again.returncode == 0, again.stderr
    assert f"resuming from outputs/tiny/checkpoint-{step} " in again.stderr
    assert not (output / PREEMPTED_FILE).exists()
    assert json.loads((output / "final" / COMPLETE_MARKER).read_text())["step"] == 300


def test_one_wandb_run_and_one_tensorboard_run_across_a_requeue(tiny_recipe: Path, ctrain,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """W&B in offline mode (the real package, no account): a training stopped by TERM (exit 75, as Slurm's
    requeue or a preemption stops it) and resumed logs to one W&B run, the id kept in the output directory;
    a training started afresh in the same directory gets a new one. TensorBoard's events of both starts are
    in one directory (OUTPUT_DIR/runs), not one a start."""
    from ctrain.train.artifacts import TENSORBOARD_DIR, WANDB_RUN_FILE

    work = tiny_recipe.parent
    output = work / "outputs/tiny"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(work))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_RUN_ID", "WANDB_RESUME", "TENSORBOARD_LOGGING_DIR", "CTRAIN_SWEEP"):
        monkeypatch.delenv(name, raising=False)
    args = ["train", tiny_recipe.name, "training.max_steps=300", "training.save_steps=5000",
            "logging.report_to=[tensorboard,wandb]", "logging.wandb_project=adder"]  # fmt: skip
    log = work / "first.log"
    process = start(args, work, log)
    wait_for(lambda: "step 5/300" in log.read_text(), process, "step 5")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == PREEMPTED_EXIT_CODE, log.read_text()[-3000:]
    run_id = (output / WANDB_RUN_FILE).read_text().strip()
    again = ctrain(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from outputs/tiny/checkpoint-" in again.stderr
    runs = sorted(p.name for p in (work / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs
    assert (output / WANDB_RUN_FILE).read_text().strip() == run_id
    events = list((output / TENSORBOARD_DIR).iterdir())
    assert len([e for e in events if e.name.startswith("events.out.tfevents")]) == 2 and all(e.is_file() for e in events)

    shutil.rmtree(output)  # afresh: a new training, a new W&B run
    fresh = ctrain("train", tiny_recipe.name, "training.max_steps=5", *args[4:])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    new_id = (output / WANDB_RUN_FILE).read_text().strip()
    assert new_id != run_id and any(p.name.endswith(f"-{new_id}") for p in (work / "wandb").glob("offline-run-*"))


def _worker(launcher: subprocess.Popen[bytes], rank: int) -> int:
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "ctrain" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker with RANK={rank} under torchrun")


@pytest.mark.full
def test_torchrun_two_processes_agree_on_preemption_and_save_once(tiny_recipe: Path, ctrain) -> None:
    """Full tier alone; CI tier: test_faults_in_turn_each_checkpoint_resume_or_end_the_run (two ranks on two
    nodes told to stop, one checkpoint of the step they agreed on)."""
    work = tiny_recipe.parent
    output = work / "outputs/tiny"
    args = ["train", tiny_recipe.name, "training.max_steps=150", "training.save_steps=5000"]
    log = work / "ddp.log"
    launcher = start(args, work, log, launcher=TORCHRUN)
    wait_for(lambda: "step 5/150" in log.read_text(), launcher, "step 5")
    os.kill(_worker(launcher, 1), signal.SIGUSR1)  # one rank only: the ranks must agree among themselves
    launcher.wait(timeout=300)
    text = log.read_text()
    assert "[rank 1 host" in text and "exitcode  : 75" in text, text[-4000:]
    assert "preemption (SIGUSR1 on another rank)" in text and "preemption (SIGUSR1)" in text
    assert "terminate called" not in text, text[-4000:]  # the process group is closed before exit
    info = json.loads((output / PREEMPTED_FILE).read_text())
    assert info["signal"] == "SIGUSR1", info  # rank 0 writes it, though only rank 1 was signalled
    step = info["step"]
    assert complete(output / f"checkpoint-{step}")
    assert sorted(p.name for p in (output / f"checkpoint-{step}").glob("rng_state_*")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]

    again = ctrain(*args, launcher=TORCHRUN)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "terminate called" not in again.stderr, again.stderr[-4000:]
    saves = [line for line in again.stderr.splitlines() if "saved the final model" in line]
    assert len(saves) == 1 and saves[0].startswith("[rank 0 host "), saves
    assert f"resuming from outputs/tiny/checkpoint-{step} " in again.stderr
    assert "on 2 process(es)" in again.stderr and "8 per device" in again.stderr
    marker = json.loads((output / "final" / COMPLETE_MARKER).read_text())
    assert marker["step"] == 150 and marker["world_size"] == 2
    second = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    last_run = [r["step"] for r in second if r["run"] == second[-1]["run"] and "loss" in r]
    assert len(last_run) == len(set(last_run)), "metrics were written by more than one rank"


def test_fast_engine_on_two_processes_matches_trls_own_metrics(tiny_recipe: Path, ctrain) -> None:
    """The fast engine's sync-free trainer logs what TRL's SFTTrainer logs, reduced over both ranks.

    Same recipe under torchrun (gloo, CPU): ``fast.sync_metrics=true`` computes the metrics as
    TRL's SFTTrainer does, the default sums them on the device and reduces them once per logging
    step. Logging every step, both must agree on every number. ``fast.balance_ranks=false``
    shows that the rank-balanced sampler is what chose the rows.
    """
    work = tiny_recipe.parent
    common = ["train", tiny_recipe.name, "training.engine=fast", "data.packing=true", "training.max_steps=6",
              "training.save_steps=3", "training.global_batch_size=4"]  # fmt: skip
    runs = {}
    variants = (("deferred", []), ("trl", ["fast.sync_metrics=true", "fast.gc_every=0"]),
                ("unbalanced", ["fast.balance_ranks=false"]))  # fmt: skip
    for name, extra in variants:
        result = ctrain(*common, f"training.output_dir=outputs/{name}", *extra, launcher=TORCHRUN)
        assert result.returncode == 0, result.stderr
        assert "engine fast" in result.stderr and "on 2 process(es)" in result.stderr
        records = [json.loads(line) for line in (work / f"outputs/{name}/metrics.jsonl").read_text().splitlines()]
        runs[name] = {r["step"]: r for r in records if "loss" in r}
    assert sorted(runs["deferred"]) == sorted(runs["trl"]) == [1, 2, 3, 4, 5, 6]
    for step, trl in runs["trl"].items():
        ours = runs["deferred"][step]
        assert ours["loss"] == pytest.approx(trl["loss"], rel=1e-5), step
        for key in ("entropy", "mean_token_accuracy", "num_input_tokens_seen"):
            assert key in ours and ours[key] == pytest.approx(trl[key], rel=1e-5), (step, key, ours, trl)
    assert runs["trl"][6]["num_input_tokens_seen"] > runs["trl"][3]["num_input_tokens_seen"] > 0
    # The rank-balanced sampler is in effect: plain random order gives the ranks other rows.
    assert runs["unbalanced"][1]["loss"] != pytest.approx(runs["deferred"][1]["loss"], rel=1e-5)
    for name in ("deferred", "trl"):  # the saved trainer state carries the exact count too
        state = json.loads((work / f"outputs/{name}/checkpoint-3/trainer_state.json").read_text())
        assert state["num_input_tokens_seen"] == runs["trl"][3]["num_input_tokens_seen"], name


# --- checkpoints written in the background (ctrain.train.asyncsave) --------------------------------


def test_a_background_save_writes_what_a_blocking_save_writes(tiny_recipe: Path, ctrain) -> None:
    """The same run with training.save_async on (the default) and off: at every checkpoint the
    weights and the optimizer state are the same bytes, every file the blocking save writes is
    there, and both are marked complete; only the background one says training went on."""
    import torch

    work = tiny_recipe.parent
    common = [tiny_recipe.name, "training.max_steps=20", "data.prepared_dir=prepared"]
    background = ctrain("train", *common, "training.output_dir=outputs/background")
    blocking = ctrain("train", *common, "training.output_dir=outputs/blocking", "training.save_async=false")
    assert background.returncode == 0, background.stderr
    assert blocking.returncode == 0, blocking.stderr
    assert re.search(r"checkpoint-10: training stopped [0-9.]+ s to copy its 0\.4 MiB of tensors into host "
                     r"memory \(buffers kept for the next save\); written in the background", background.stderr)
    assert "checkpoint-10 complete (written and checksummed in the background in " in background.stderr
    assert re.search(r"checkpoint-10 complete \(checksummed in [0-9.]+ s; training stopped [0-9.]+ s to write "
                     r"and check it\)", blocking.stderr), blocking.stderr  # fmt: skip
    assert "checkpoints are written with training stopped: training.save_async is false" in blocking.stderr
    for step in (10, 20):
        ours, theirs = work / f"outputs/background/checkpoint-{step}", work / f"outputs/blocking/checkpoint-{step}"
        assert complete(ours) and complete(theirs)
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
        for name in ("model.safetensors", "scheduler.pt", "rng_state.pth"):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), f"checkpoint-{step}/{name}"
        # The same state, in a zip archive of another inner name (torch.save of a file, not a path).
        assert_same_state(torch.load(ours / "optimizer.pt"), torch.load(theirs / "optimizer.pt"), f"checkpoint-{step}")
    (ours,), (theirs,) = losses(work / "outputs/background").values(), losses(work / "outputs/blocking").values()
    assert ours == theirs, "a background save changed the training"


def _block_optimizer_write(output: Path, step: int) -> Path:
    """A FIFO where checkpoint-STEP's optimizer state goes: its writer blocks in ``open`` until a
    reader comes, as a write to a hung file system would, while training goes on."""
    directory = output / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    os.mkfifo(directory / "optimizer.pt")
    return directory / "optimizer.pt"


def _kill_all(launcher: subprocess.Popen[bytes]) -> None:
    import psutil

    workers = psutil.Process(launcher.pid).children(recursive=True)
    for process in [*workers, psutil.Process(launcher.pid)]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    launcher.wait(timeout=60)


def test_a_kill_during_a_background_save_resumes_from_the_checkpoint_before(tiny_recipe: Path, ctrain) -> None:
    """Two processes (torchrun, gloo): checkpoint-20's write hangs in the background while both ranks
    train on past step 25; killed then (SIGKILL, every process), checkpoint-20 has no marker, and
    the same command removes it and resumes from checkpoint-10 to the end."""
    work = tiny_recipe.parent
    output = work / "outputs/tiny"
    args = ["train", tiny_recipe.name, "training.max_steps=60"]
    log = work / "killed.log"
    launcher = start(args, work, log, launcher=TORCHRUN)
    wait_for(lambda: "on 2 process(es)" in log.read_text(), launcher, "the training line")  # after the start's cleanup
    _block_optimizer_write(output, 20)
    wait_for(lambda: "step 25/60" in log.read_text(), launcher, "step 25")
    text = log.read_text()
    assert "checkpoint-20: training stopped" in text and "written in the background" in text, text[-3000:]
    assert complete(output / "checkpoint-10") and not complete(output / "checkpoint-20")
    _kill_all(launcher)

    again = ctrain(*args, launcher=TORCHRUN)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"ignoring {output.relative_to(work)}/checkpoint-20: no {COMPLETE_MARKER}" in again.stderr
    assert "resuming from outputs/tiny/checkpoint-10 " in again.stderr, again.stderr[-4000:]
    runs = losses(output)
    assert sorted(runs[max(runs)]) == list(range(11, 61))
    assert complete(output / "checkpoint-60") and complete(output / "final")
    assert not (output / "checkpoint-20").exists() or complete(output / "checkpoint-20")


def test_a_preemption_waits_for_the_background_save_in_flight(tiny_recipe: Path) -> None:
    """SIGUSR1 while checkpoint-20's write hangs: the run does not exit (nor start its own save)
    until that write is done; let go, checkpoint-20 is sealed (the FIFO in it found not to be a
    file: never marked), the preemption's checkpoint is written and marked, the run exits 75 and
    its checkpoint verifies (the preemption tests resume from one)."""
    import threading

    work = tiny_recipe.parent
    output = work / "outputs/tiny"
    args = ["train", tiny_recipe.name, "training.max_steps=400", "training.save_steps=20"]
    log = work / "preempted.log"
    process = start(args, work, log)
    wait_for(lambda: "on 1 process(es)" in log.read_text(), process, "the training line")
    fifo = _block_optimizer_write(output, 20)
    wait_for(lambda: "step 25/400" in log.read_text(), process, "step 25")
    process.send_signal(signal.SIGUSR1)
    time.sleep(3)
    assert process.poll() is None, "the run exited with a save in flight"
    assert not list(output.glob(f"checkpoint-*/{PREEMPTED_FILE}")) and not (output / PREEMPTED_FILE).exists()
    drained = threading.Thread(target=lambda: fifo.open("rb").read(), daemon=True)
    drained.start()
    assert process.wait(timeout=120) == PREEMPTED_EXIT_CODE, log.read_text()[-3000:]
    text = log.read_text()
    assert "checkpoint-20 was written but cannot be read back (optimizer.pt: not a regular file)" in text
    step = json.loads((output / PREEMPTED_FILE).read_text())["step"]
    assert step > 25 and complete(output / f"checkpoint-{step}") and not complete(output / "checkpoint-20")
    assert text.index("checkpoint-20 was written") < text.index(f"checkpoint-{step}: training stopped")
    assert checkpoint.verify(output / f"checkpoint-{step}").damage is None


# --- damaged checkpoints, NaN, restarts at the end -------------------------------------------------


def _figure(what: str, seconds: float, detail: str = "") -> None:
    """Print a measured figure for docs/reliability.md (shown with pytest -s)."""
    print(f"\nreliability | {what} | {seconds:.1f} s | {detail}")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run of 20 steps (checkpoints 10 and 20, final model), trained once; tests damage copies of it."""
    work = tmp_path_factory.mktemp("finished")
    (work / "tiny.yaml").write_text(TINY_RECIPE)
    result = run_ctrain(work, "train", "tiny.yaml", "training.max_steps=20")
    assert result.returncode == 0, result.stderr
    return work


def _copy_of(finished_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished_run, tmp_path, dirs_exist_ok=True)
    return tmp_path / "outputs/tiny"


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _scramble(path: Path) -> None:
    """Overwrite 4 KiB in the middle (the tensors' data) with other bytes: same size, same header."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(255 - b for b in data[middle : middle + 4096])
    path.write_bytes(bytes(data))


def _verified_seconds(stderr: str) -> float:
    return float(re.search(r"resuming from .* verified in ([0-9.]+) s\)", stderr).group(1))


DAMAGES = [
    ("truncated weights", "model.safetensors", _truncate, "size", ()),
    ("scrambled weights, same size", "model.safetensors", _scramble, "checksum", ()),
    ("truncated optimizer state, 2 processes", "optimizer.pt", _truncate, "size", TORCHRUN),
]


def test_a_trial_run_does_not_swallow_the_real_one(tiny_recipe: Path, ctrain) -> None:
    """A 3-step trial, then the recipe's own 6 steps into the same output directory: refused with
    what differs (exit 2, the directory as it was), never "already finished"; with
    training.resume=continue it trains on from the trial's checkpoint and keeps the trial's model."""
    out = tiny_recipe.parent / "outputs" / "trial"
    common = [tiny_recipe.name, "training.output_dir=outputs/trial", "training.save_steps=3"]
    assert ctrain("train", *common, "training.max_steps=3").returncode == 0
    before = sorted(p.name for p in out.iterdir())
    real = ctrain("train", *common, "training.max_steps=6")
    assert real.returncode == 2, real.stderr[-2000:]
    assert "holds a run with other settings (training.max_steps: 3 -> 6)" in real.stderr
    assert "already finished" not in real.stderr and sorted(p.name for p in out.iterdir()) == before
    going_on = ctrain("train", *common, "training.max_steps=6", "training.resume=continue")
    assert going_on.returncode == 0, going_on.stderr[-2000:]
    assert "resuming from outputs/trial/checkpoint-3" in going_on.stderr
    assert sorted(losses(out)[max(losses(out))]) == [4, 5, 6]  # the new start's steps only
    assert complete(out / "final") and complete(out / "final.previous")
    again = ctrain("train", *common, "training.max_steps=6", "training.logging_steps=5")  # run-independent
    assert again.returncode == 0 and "this run already finished" in again.stderr


@pytest.mark.full
def test_a_second_run_loads_the_compiled_layers_from_the_compile_cache(tiny_recipe: Path) -> None:
    """torch.compile's caches in one directory (what the sbatch library points TORCHINDUCTOR_CACHE_DIR
    at: the project's .cache, on storage every node mounts) serve the next run's compiled layers,
    and the first step's log line says how many came from it.

    A second output directory stands for a requeue on another node or the next job of the recipe:
    a new process with nothing of the first in memory. On CPU, inductor compiles C++ (g++).
    Only the full tier loads compiled layers from the cache; CI tier:
    test_compiled_layers_share_one_graph_and_do_not_recompile (one graph, compiled once)."""
    work = tiny_recipe.parent
    env = {**train_env(work), "TORCHINDUCTOR_CACHE_DIR": str(work / "compile-cache")}
    lines = []
    for run in ("first", "second"):
        command = [sys.executable, "-m", "ctrain", "train", tiny_recipe.name, "training.engine=fast",
                   "fast.compile=layers", "data.packing=true", "training.max_steps=1",
                   f"training.output_dir=outputs/{run}"]  # fmt: skip
        result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        line = re.search(r"(\d+) compiled graphs, (\d+) of them from torch's compile cache in (\S+)", result.stderr)
        assert line, result.stderr[-3000:]
        lines.append((int(line[1]), int(line[2]), line[3]))
    (graphs, loaded, where), (graphs_again, loaded_again, _) = lines
    assert where == str(work / "compile-cache")
    assert graphs > 0 and loaded == 0
    assert graphs_again == loaded_again == graphs


def test_a_recipe_without_adapters_or_deepspeed_never_imports_peft_or_deepspeed(tiny_recipe: Path) -> None:
    """transformers, TRL and accelerate import PEFT and DeepSpeed whenever they are installed;
    `ctrain train` keeps them out of a run that uses neither (ctrain.train.stack). Python's own
    import log (-X importtime) is the witness; the LoRA tests (test_lora.py) train with PEFT."""
    command = [sys.executable, "-X", "importtime", "-m", "ctrain", "train", tiny_recipe.name, "training.max_steps=1"]
    result = subprocess.run(command, cwd=tiny_recipe.parent, env=train_env(tiny_recipe.parent), capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "transformers" in imported and "trl" in imported
    assert not {"peft", "deepspeed"} & imported


@pytest.mark.parametrize(("name", "damage", "reason", "launcher"), [d[1:] for d in DAMAGES],
                         ids=[d[0] for d in DAMAGES])  # fmt: skip
def test_damaged_newest_checkpoint_is_moved_aside_and_the_run_finishes_from_the_older_one(
    finished_run: Path, tmp_path: Path, ctrain, name: str, damage, reason: str, launcher: tuple[str, ...]
) -> None:
    output = _copy_of(finished_run, tmp_path)
    shutil.rmtree(output / "final")  # the run had not finished when the damage happened
    damage(output / "checkpoint-20" / name)
    started = time.monotonic()
    again = ctrain("train", "tiny.yaml", "training.max_steps=20", launcher=launcher)
    seconds = time.monotonic() - started
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr
    damaged = [line for line in again.stderr.splitlines() if " is damaged (" in line]
    assert len(damaged) == 1, damaged  # one line, from rank 0 only
    assert damaged[0].startswith("[rank 0 host ")
    assert f"outputs/tiny/checkpoint-20 is damaged ({name}: " in damaged[0]
    assert damaged[0].endswith(f"moved it to checkpoint-20.damaged-{reason} and falling back to checkpoint-10")
    assert "resuming from outputs/tiny/checkpoint-10 " in again.stderr
    kept = output / f"checkpoint-20.damaged-{reason}"
    assert (kept / name).is_file() and complete(kept), "the damaged checkpoint is kept as it was, for inspection"
    runs = losses(output)
    first, second = (runs[run] for run in sorted(runs))
    assert sorted(second) == list(range(11, 21)), "the run did not continue from checkpoint-10"
    if not launcher:
        for step, loss in second.items():
            assert loss == pytest.approx(first[step], rel=1e-4, abs=1e-5), f"step {step}"
    assert json.loads((output / "final" / COMPLETE_MARKER).read_text())["step"] == 20
    assert checkpoint.verify(output / "checkpoint-20").damage is None
    assert seconds < 240
    _figure(f"restart, newest checkpoint with {name} {reason} damage", seconds,
            f"verify {_verified_seconds(again.stderr):.2f} s")  # fmt: skip


def test_nan_loss_stops_before_any_checkpoint_or_final_model(tiny_recipe: Path, ctrain) -> None:
    """A learning rate of 1e30 makes the weights overflow after the first step; the save at step 5 must not happen."""
    work = tiny_recipe.parent
    started = time.monotonic()
    result = ctrain("train", tiny_recipe.name, "training.max_steps=20", "training.save_steps=5",
                    "training.logging_steps=100", "training.learning_rate=1e30")  # fmt: skip
    seconds = time.monotonic() - started
    assert result.returncode == NONFINITE_EXIT_CODE, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and re.match(r"error: (\[rank 0 host \S+\] )?step 5: loss nan", errors[0]), errors
    assert "Traceback" not in result.stderr
    output = work / "outputs/tiny"
    assert not list(output.glob("checkpoint-*")), "a checkpoint of the diverged state was written"
    assert not (output / "final").exists()
    assert seconds < 120
    _figure("NaN loss (learning rate 1e30), caught at the save of step 5", seconds, f"exit {result.returncode}")


def test_restart_after_a_kill_during_the_final_save_trains_no_step(finished_run: Path, tmp_path: Path, ctrain) -> None:
    output = _copy_of(finished_run, tmp_path)
    (output / "final" / COMPLETE_MARKER).unlink()  # as a kill while saving the final model leaves it
    _truncate(output / "final" / "model.safetensors")
    started = time.monotonic()
    again = ctrain("train", "tiny.yaml", "training.max_steps=20")
    seconds = time.monotonic() - started
    assert again.returncode == 0, again.stderr
    assert "checkpoint-20 is at step 20 of 20: nothing left to train; saving the final model from it" in again.stderr
    assert "removing outputs/tiny/final: it has no ctrain-complete.json" in again.stderr
    runs = losses(output)
    assert len(runs) == 1, "the restart trained a step"
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]
    final = json.loads((output / "final" / COMPLETE_MARKER).read_text())
    saved = json.loads((output / "checkpoint-20" / COMPLETE_MARKER).read_text())
    assert final["step"] == 20
    assert final["manifest"]["model.safetensors"] == saved["manifest"]["model.safetensors"], "not step 20's weights"
    _figure("restart after a kill during the final save", seconds, "0 steps trained, final written")

    started = time.monotonic()
    done = ctrain("train", "tiny.yaml", "training.max_steps=20")
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "outputs/tiny/final is complete: this run already finished; nothing to do" in done.stderr
    assert len(losses(output)) == 1
    assert seconds < 60
    _figure("restart after a complete final model", seconds, "no-op, exit 0")


FINE_TUNE = TINY_RECIPE.replace(
    TINY_RECIPE[TINY_RECIPE.index("model:") : TINY_RECIPE.index("data:")], "model:\n  path: base\n"
)


def test_a_bf16_model_fine_tuned_in_full_is_saved_in_bf16(finished_run: Path, tmp_path: Path, ctrain) -> None:
    """Training keeps float32 masters; the final model comes back in the pretrained checkpoint's dtype
    (model.save_dtype: auto), tied weights still tied: the last checkpoint's weights, each rounded once."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pretrained = finished_run / "outputs/tiny/final"
    AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).to(torch.bfloat16).save_pretrained(
        tmp_path / "base"
    )
    AutoTokenizer.from_pretrained(pretrained).save_pretrained(tmp_path / "base")
    (tmp_path / "ft.yaml").write_text(FINE_TUNE)
    result = ctrain("train", "ft.yaml", "training.max_steps=4", "training.save_steps=4")
    assert result.returncode == 0, result.stderr[-4000:]
    final, last = tmp_path / "outputs/ft/final", tmp_path / "outputs/ft/checkpoint-4"
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    saved, masters = load_file(final / "model.safetensors"), load_file(last / "model.safetensors")
    base = load_file(tmp_path / "base/model.safetensors")
    assert sorted(saved) == sorted(base) == sorted(masters), "a tensor is added or lost (lm_head is tied)"
    assert {t.dtype for t in masters.values()} == {torch.float32}
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, masters[name].to(torch.bfloat16)), f"{name} is not the checkpoint's weights"
    assert not all(torch.equal(saved[n], base[n]) for n in saved), "training changed nothing"
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert checkpoint.verify(final).damage is None, "the marker does not match the rewritten config"


def test_eval_refuses_a_final_model_without_its_marker(finished_run: Path, tmp_path: Path, ctrain) -> None:
    output = _copy_of(finished_run, tmp_path)
    (output / "final" / COMPLETE_MARKER).unlink()
    started = time.monotonic()
    refused = ctrain("eval", "tiny.yaml")
    seconds = time.monotonic() - started
    text = refused.stdout + refused.stderr
    assert refused.returncode == 2, text
    errors = [line for line in text.splitlines() if "error:" in line]
    assert errors == [
        f"error: {output.relative_to(tmp_path)}/final has no {COMPLETE_MARKER}: the run stopped while saving it, so "
        "it may be unfinished; run the same `ctrain train` command again (it saves the final model from the last "
        "checkpoint without training further), or pass --model with a complete model directory"
    ], text
    assert "Traceback" not in text and "accuracy" not in text
    assert not (output / "eval.json").exists()
    _figure("ctrain eval of a final model without its marker", seconds, "error, exit 2")


# --- the demo -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_learns_addition_and_the_saved_model_answers(demo_run: Path, tmp_path: Path, ctrain) -> None:
    recipe = str(REPO / "recipes/demo-addition.yaml")
    trained = demo_run / "outputs/demo-addition"
    assert list((trained / "runs").rglob("events.out.tfevents.*")), "no TensorBoard logs"
    output = tmp_path / "outputs/demo"  # eval writes eval.json beside the model: a copy keeps demo_run as it is
    shutil.copytree(trained / "final", output / "final")
    evaluated = ctrain("eval", recipe, f"training.output_dir={output}", "--min-accuracy", "0.9")
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    result = json.loads((output / "eval.json").read_text())
    assert result["accuracy"] >= 0.9 and result["total"] == 500

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output / "final")
    model = AutoModelForCausalLM.from_pretrained(output / "final").eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 58 + 27?"}], tokenize=False, add_generation_prompt=True
    )
    batch = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    answer = model.generate(**batch, max_new_tokens=5, do_sample=False)[0, batch["input_ids"].shape[1] :]
    assert tokenizer.decode(answer, skip_special_tokens=True).strip() == "85"
