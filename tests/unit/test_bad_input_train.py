"""Bad input to train, train --check, prepare, eval and submit's recipe checks: one ``error:`` line
that names the problem and the fix, a non-zero exit, no traceback, nothing written; before any work."""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ctrain.errors import ConfigError
from tests.badinput import Case, run_case
from tests.conftest import need


# Nine lists, each of nine aliases of the one before: 9**9 (387 million) values once expanded.
_ANCHORS = ["a", *(f"l{i}" for i in range(1, 9))]
ALIAS_BOMB = "[&a [x, x, x, x, x, x, x, x, x]" + "".join(
    f", &{name} [{', '.join(['*' + before] * 9)}]" for before, name in zip(_ANCHORS, _ANCHORS[1:])
) + "]\n"

RECIPE = """\
model:
  config: llama
  config_overrides: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
                     num_key_value_heads: 2, max_position_embeddings: 64}
tokenizer:
  train: {vocab_size: 300}
data:
  source: data.jsonl
  max_length: 64
  eval_size: 2
training:
  global_batch_size: 4
  max_steps: 2
logging:
  report_to: []
"""

CHAT = {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}
GOOD = [CHAT] * 8
SIF = b"#!/usr/bin/env run-singularity\nSIF_MAGIC0x00000001"


def lines(rows: list[object]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def project(
    tmp: Path,
    recipe: str | bytes = RECIPE,
    data: str | bytes | None = None,
    files: dict[str, str | bytes] | None = None,
    dirs: tuple[str, ...] = (),
) -> None:
    """A run directory: r.yaml, data.jsonl (good chats unless given), an image for submit, extra files."""
    everything: dict[str, str | bytes] = {
        "r.yaml": recipe,
        "data.jsonl": lines(GOOD) if data is None else data,
        "img.sif": SIF,
        **(files or {}),
    }
    for name in dirs:
        (tmp / name).mkdir(parents=True, exist_ok=True)
    for name, content in everything.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def setup(**kwargs: object) -> Callable[[Path], None]:
    return functools.partial(project, **kwargs)  # type: ignore[arg-type]


def special(kind: str) -> Callable[[Path], None]:
    """A project with a named pipe (pipe.jsonl) or a symbolic link to itself (loop.jsonl) in it."""

    def make(tmp: Path) -> None:
        project(tmp)
        if kind == "fifo":
            os.mkfifo(tmp / "pipe.jsonl")
        else:
            (tmp / "loop.jsonl").symlink_to("loop.jsonl")

    return make


def edit(old: str, new: str) -> str:
    assert old in RECIPE, old
    return RECIPE.replace(old, new)


def parquet(rows: list[dict[str, object]]) -> Callable[[Path], None]:
    """A project whose data is d.parquet holding ``rows``."""

    def make(tmp: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        project(tmp)
        pq.write_table(pa.Table.from_pylist(rows), tmp / "d.parquet")

    return make


def trained(tmp: Path) -> None:
    """A project whose run looks finished (for eval): outputs/r/final with a model config, marked complete."""
    from ctrain.train import checkpoint

    project(tmp, files={"outputs/r/final/config.json": "{}"})
    checkpoint.write_marker(tmp / "outputs/r/final", {"step": 1}, checkpoint.manifest(tmp / "outputs/r/final"))


SUBMIT = ("submit", "--image", "img.sif")
NOT_UTF8 = b"model:\n  path: caf\xe9\n"
LONG = "n" * 300

# One case a line or two, as a table reads best.
# fmt: off
CASES = [
    # 1. rows without the column, or of the wrong shape, named by file and row
    Case("train-row-without-messages", ["train", "r.yaml"], ["data.jsonl", "line 3", "row 3", "'messages'", "'text'"],
         setup(data=lines([CHAT, CHAT, {"text": "hello"}, CHAT])), exit_code=2),
    Case("check-row-without-messages", ["train", "--check", "r.yaml"], ["data.jsonl", "row 2", "'messages'"],
         setup(data=lines([CHAT, {"prompt": "a"}]))),
    Case("prepare-row-without-messages", ["prepare", "r.yaml"], ["data.jsonl", "row 4", "'messages'"],
         setup(data=lines([CHAT] * 3 + [{"chat": []}]))),
    Case("eval-row-without-messages", ["eval", "r.yaml"], ["data.jsonl", "row 2", "'messages'"],
         setup(data=lines([CHAT, {"text": "x"}]))),
    Case("train-messages-is-a-string", ["train", "r.yaml"], ["row 2", "a string", "not a chat"],
         setup(data=lines([CHAT, {"messages": "hi there"}]))),
    Case("train-message-without-content", ["train", "r.yaml"], ["row 2", "'content'", "message 1"],
         setup(data=lines([CHAT, {"messages": [{"role": "user"}, {"role": "assistant", "content": "2"}]}]))),
    Case("train-row-is-an-array", ["train", "r.yaml"], ["row 2", "a list", "not an object"],
         setup(data=lines([CHAT, [1, 2]]))),
    Case("train-null-messages", ["train", "r.yaml"], ["row 3", "null"],
         setup(data=lines([CHAT, CHAT, {"messages": None}]))),
    Case("train-chat-without-assistant", ["train", "r.yaml"], ["row 2", "assistant", "assistant_only_loss"],
         setup(data=lines([CHAT, {"messages": [{"role": "user", "content": "hi"}]}]))),
    Case("clm-row-without-text", ["train", "r.yaml", "task=clm"], ["data.jsonl", "row 2", "'text'"],
         setup(data=lines([{"text": "a b c"}, {"body": "d"}]))),
    Case("csv-row-with-missing-cell", ["prepare", "r.yaml", "task=clm", "data.source=d.csv"],
         ["d.csv", "row 2", "'text'"], setup(files={"d.csv": "text,id\nhello,1\n,2\n"})),
    # 5. broken files: which file, which line, what is wrong
    Case("jsonl-broken-line", ["train", "r.yaml"], ["data.jsonl", "line 3", "not valid JSON"],
         setup(data=lines([CHAT, CHAT]) + '{"messages": [\n')),
    Case("jsonl-broken-line-offline", ["prepare", "r.yaml"], ["data.jsonl", "line 2", "not valid JSON"],
         setup(data=lines([CHAT]) + "{oops}\n"), env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}),
    Case("json-array-broken", ["train", "--check", "r.yaml", "data.source=d.json"],
         ["d.json", "line 3", "not valid JSON"], setup(files={"d.json": "[\n" + json.dumps(CHAT) + ",\n  {,]\n"})),
    Case("jsonl-not-utf8", ["prepare", "r.yaml"], ["data.jsonl", "line 2", "UTF-8"],
         setup(data=lines([CHAT]).encode() + b'{"messages": "\xff"}\n')),
    Case("csv-row-with-extra-field", ["train", "r.yaml", "task=clm", "data.source=d.csv"],
         ["d.csv", "row 2", "3 fields", "header 2"], setup(files={"d.csv": "text,id\nhello,1\nx,y,z\n"})),
    Case("parquet-that-is-not", ["train", "--check", "r.yaml", "data.source=d.parquet"], ["d.parquet", "parquet"],
         setup(files={"d.parquet": b"this is not parquet at all"})),
    Case("empty-data-file", ["train", "r.yaml"], ["data.jsonl", "empty"], setup(data="")),
    Case("parquet-null-messages", ["train", "--check", "r.yaml", "data.source=d.parquet"],
         ["d.parquet", "row 3", "'messages'"], parquet([CHAT, CHAT, {"messages": None}])),
    Case("parquet-chat-without-assistant", ["prepare", "r.yaml", "data.source=d.parquet"],
         ["d.parquet", "row 2", "assistant"], parquet([CHAT, {"messages": [{"role": "user", "content": "hi"}]}])),
    Case("jsonl-content-is-a-number", ["train", "r.yaml"], ["data.jsonl", "row 2", "content", "a number"],
         setup(data=lines([CHAT, {"messages": [{"role": "user", "content": 5}, {"role": "assistant",
                                                                              "content": "5"}]}]))),
    Case("saved-data-set-damaged", ["train", "--check", "r.yaml", "data.source=saved"],
         ["saved/dataset_info.json", "not valid JSON"], setup(files={"saved/dataset_info.json": "{"})),
    Case("prepared-marker-damaged", ["train", "r.yaml"], ["ctrain-prepared.json", "damaged", "--force"],
         setup(files={"outputs/r/prepared/ctrain-prepared.json": "{half"})),
    Case("datasets-cache-read-only", ["prepare", "r.yaml"], ["HF_DATASETS_CACHE", "read-only"],
         setup(dirs=("hf",)), env={"HF_DATASETS_CACHE": "hf/datasets"}, read_only=["hf"]),
    # data that costs more than it says: a line of megabytes, a pipe, a device, a symbolic link loop
    Case("data-line-of-megabytes", ["train", "r.yaml"], ["data.jsonl line 2 (row 2)", "longer than 1 MiB",
                                                         "split it"],
         setup(data=lines([CHAT, {"text": "x" * 3 * 2**20}, CHAT]))),
    Case("data-source-fifo", ["train", "--check", "r.yaml", "data.source=pipe.jsonl"], ["pipe.jsonl",
                                                                                       "not a regular file"],
         special("fifo")),
    Case("data-source-device", ["train", "r.yaml", "data.source=/dev/zero"], ["/dev/zero", "not a regular file"],
         setup()),
    Case("data-source-link-loop", ["train", "--check", "r.yaml", "data.source=loop.jsonl"],
         ["loop.jsonl", "symbolic link that leads nowhere"], special("loop")),
    # sizes without a ceiling: caught by the recipe, or by the model's config before weights load
    Case("peft-rank-a-billion", ["train", "--check", "r.yaml", "peft.method=lora", "peft.r=1000000000"],
         ["peft.r is 1000000000", "between 1 and 65536"], setup()),
    Case("model-of-absurd-size", ["train", "r.yaml", "model.path=null", "model.config=llama",
                                  "model.config_overrides.hidden_size=100000000"],
         ["llama config", "parameters", "more than 1e+13", "model.config_overrides"], setup()),
    Case("data-source-missing", ["prepare", "r.yaml", "data.source=nope.jsonl"], ["nope.jsonl", "does not exist"],
         setup()),
    # 2. recipes that are not YAML mappings of known keys of the right types
    Case("recipe-not-utf8", ["train", "r.yaml"], ["r.yaml", "line 2", "UTF-8"], setup(recipe=NOT_UTF8)),
    Case("recipe-invalid-yaml", ["train", "--check", "r.yaml"], ["r.yaml", "line 3", "not valid YAML"],
         setup(recipe="model:\n  path: x\n bad: [\n")),
    Case("recipe-tabs", ["prepare", "r.yaml"], ["r.yaml", "line 2", "tabs"], setup(recipe="model:\n\tpath: x\n")),
    Case("recipe-is-a-list", ["train", "r.yaml"], ["r.yaml", "a list", "mapping of settings"],
         setup(recipe="- model\n- data\n")),
    Case("recipe-is-a-scalar", ["eval", "r.yaml"], ["r.yaml", "a single string"], setup(recipe="just words\n")),
    Case("recipe-wrong-type", ["train", "r.yaml"], ["r.yaml", "line 13", "training.max_steps", "integer"],
         setup(recipe=edit("max_steps: 2", "max_steps: two"))),
    Case("recipe-section-not-mapping", ["train", "--check", "r.yaml"], ["line 11", "'training'", "mapping"],
         setup(recipe=RECIPE.split("training:")[0] + "training: 5\n")),
    Case("recipe-unknown-key", ["prepare", "r.yaml"], ["r.yaml", "line 13", "unknown key 'training.max_step'",
                                                       "max_steps"], setup(recipe=edit("max_steps", "max_step"))),
    Case("recipe-key-twice", ["train", "r.yaml"], ["r.yaml", "line 14", "twice", "line 13"],
         setup(recipe=RECIPE.replace("logging:", "  max_steps: 3\nlogging:"))),
    # YAML that costs more than it says: aliases that expand a billion-fold, NUL bytes, deep nesting
    Case("recipe-alias-bomb", ["train", "--check", "r.yaml"], ["r.yaml", "more than 100,000 values", "aliases"],
         setup(recipe=RECIPE + "x: " + ALIAS_BOMB)),
    Case("override-alias-bomb", ["train", "--check", "r.yaml", f"model.x={ALIAS_BOMB}"],
         ["override 'model.x=", "characters)'", "more than 100,000 values"], setup()),
    Case("override-huge", ["train", "--check", "r.yaml", "model.x=" + "x" * 100_000],
         ["override 'model.x=", "(100,008 characters)'", "longer than 65,536 characters"], setup()),
    Case("recipe-nul-byte", ["train", "--check", "r.yaml"], ["r.yaml", "not valid YAML", "#x0000"],
         setup(recipe=RECIPE.replace("model:", "model:\0", 1))),
    Case("recipe-nested-too-deep", ["train", "--check", "r.yaml"], ["r.yaml", "line 16", "more than 64 levels"],
         setup(recipe=RECIPE + "x: " + "[" * 300 + "]" * 300 + "\n")),
    Case("ctrain-yaml-alias-bomb", [*SUBMIT, "--dry-run", "r.yaml"], ["ctrain.yaml", "more than 100,000 values"],
         setup(files={"ctrain.yaml": "slurm:\n  nodes: 1\nx: " + ALIAS_BOMB})),
    Case("recipe-is-a-directory", ["train", "recipes.d"], ["recipes.d", "directory"], setup(dirs=("recipes.d",))),
    Case("recipe-missing", ["prepare", "nope.yaml"], ["nope.yaml", "does not exist"], setup()),
    Case("recipe-is-data", ["train", "data.jsonl"], ["data.jsonl", "YAML"], setup()),
    Case("ctrain-yaml-not-utf8", [*SUBMIT, "--dry-run", "r.yaml"], ["ctrain.yaml", "line 1", "UTF-8"],
         setup(files={"ctrain.yaml": b"slurm:\xff\n"})),
    Case("ctrain-yaml-invalid", [*SUBMIT, "--dry-run", "r.yaml"], ["ctrain.yaml", "line 2", "not valid YAML"],
         setup(files={"ctrain.yaml": "slurm:\n  nodes: [1\n"})),
    Case("ctrain-yaml-is-a-list", [*SUBMIT, "--dry-run", "r.yaml"], ["ctrain.yaml", "a list"],
         setup(files={"ctrain.yaml": "- slurm\n"})),
    Case("ctrain-yaml-job-name", [*SUBMIT, "--dry-run", "r.yaml"], ["ctrain.yaml", "line 3", "job name", "'/'"],
         setup(files={"ctrain.yaml": "slurm:\n  nodes: 1\n  job_name: team/run\n"})),
    Case("ctrain-yaml-unknown-key", [*SUBMIT, "--dry-run", "r.yaml"], ["ctrain.yaml", "line 2", "slurm.nodez"],
         setup(files={"ctrain.yaml": "slurm:\n  nodez: 2\n"})),
    # 6. empty recipes say what the least recipe is
    Case("recipe-empty", ["train", "r.yaml"], ["r.yaml", "is empty", "model:", "path", "data:", "source"],
         setup(recipe="")),
    Case("recipe-only-comments", ["train", "--check", "r.yaml"], ["is empty", "model:", "data:"],
         setup(recipe="# nothing yet\n\n")),
    Case("recipe-without-model", ["prepare", "r.yaml"], ["no model", "model: {path:"],
         setup(recipe="data:\n  source: data.jsonl\n")),
    Case("recipe-without-data", ["train", "r.yaml"], ["no data", "data.source", "data: {source:"],
         setup(recipe="model:\n  path: gpt2\n")),
    # 3. names that cannot be a directory name
    Case("name-too-long", ["train", "r.yaml", f"name={LONG}"], ["name", "300 bytes", "at most 255"], setup()),
    Case("name-with-slash", ["train", "r.yaml", "name=a/b"], ["override 'name=a/b'", "'/'"], setup()),
    Case("name-dotdot", ["prepare", "r.yaml"], ["r.yaml", "line 1", "name '..'"], setup(recipe="name: ..\n" + RECIPE)),
    Case("name-nul", ["train", "r.yaml"], ["line 1", "NUL"], setup(recipe='name: "a\\0b"\n' + RECIPE)),
    Case("name-leading-dash", ["train", "--check", "r.yaml", "name=-rf"], ["name", "'-'"], setup()),
    Case("name-empty", ["train", "r.yaml"], ["name", "empty"], setup(recipe='name: ""\n' + RECIPE)),
    Case("submit-job-name-slash", [*SUBMIT, "--dry-run", "--job-name", "a/b", "r.yaml"], ["job name", "'/'"],
         setup()),
    # 4 and 7. places that cannot be written, found before the work starts
    Case("prepare-output-read-only", ["prepare", "r.yaml", "-o", "ro/prepared"], ["ro", "read-only"],
         setup(dirs=("ro",)), read_only=["ro"]),
    Case("prepare-output-is-the-project", ["prepare", "r.yaml", "-o", "."],
         ["holds other files", "ctrain-prepared.json", "new or empty directory"], setup()),
    Case("prepared-dir-holds-data", ["train", "r.yaml", "data.prepared_dir=mine"], ["mine", "holds other files"],
         setup(files={"mine/notes.txt": "mine"})),
    Case("prepare-output-is-a-file", ["prepare", "r.yaml", "-o", "data.jsonl"], ["data.jsonl", "is a file"],
         setup()),
    Case("prepare-output-under-a-file", ["prepare", "r.yaml", "-o", "data.jsonl/prepared"],
         ["data.jsonl", "is a file", "not a directory"], setup()),
    Case("prepared-dir-read-only", ["prepare", "r.yaml", "data.prepared_dir=ro/p"], ["ro/p", "read-only"],
         setup(dirs=("ro",)), read_only=["ro"]),
    Case("write-script-read-only", [*SUBMIT, "--write-script", "ro/x.sbatch", "r.yaml"], ["ro", "read-only"],
         setup(dirs=("ro",)), read_only=["ro"]),
    Case("write-script-no-directory", [*SUBMIT, "--write-script", "nodir/x.sbatch", "r.yaml"],
         ["nodir", "does not exist"], setup()),
    Case("write-script-is-a-directory", [*SUBMIT, "--write-script", "ro", "r.yaml"], ["ro", "directory"],
         setup(dirs=("ro",))),
    Case("write-script-logs-is-a-file", [*SUBMIT, "--write-script", "x.sbatch", "r.yaml"],
         ["log", "logs", "not a directory"], setup(files={"logs": "not a directory"})),
    Case("train-output-read-only", ["train", "r.yaml"], ["training.output_dir", "outputs/r", "read-only"],
         setup(dirs=("outputs/r",)), read_only=["outputs/r"]),
    Case("train-outputs-parent-read-only", ["train", "r.yaml"], ["training.output_dir", "outputs", "read-only"],
         setup(dirs=("outputs",)), read_only=["outputs"]),
    Case("train-checkpoint-read-only", ["train", "r.yaml"], ["outputs/r/checkpoint-1", "read-only", "output_dir"],
         setup(dirs=("outputs/r/checkpoint-1",)), read_only=["outputs/r/checkpoint-1"]),
    Case("train-output-is-a-file", ["train", "r.yaml", "training.output_dir=data.jsonl"],
         ["data.jsonl", "is a file"], setup()),
    Case("train-output-name-too-long", ["train", "r.yaml", f"training.output_dir=out/{LONG}"],
         ["training.output_dir", "300 bytes"], setup()),
    Case("prepare-into-a-full-disk", ["prepare", "r.yaml"],
         ["the file system of outputs/r is full", "nothing of it is kept", "data.prepared_dir"],
         setup(dirs=("outputs/r",)), full_disk=["outputs/r"], full_size="12k", exit_code=1),
    Case("train-final-is-a-file", ["train", "r.yaml"], ["final", "is a file"],
         setup(files={"outputs/r/final": "x"})),
    Case("train-output-of-another-program", ["train", "r.yaml", "training.output_dir=hf"],
         ["training.output_dir hf", "checkpoint-500, final", "no recipe.yaml", "new or empty directory"],
         setup(files={"hf/final/model.safetensors": "weights", "hf/checkpoint-500/optimizer.pt": "state"})),
    Case("eval-output-read-only", ["eval", "r.yaml"], ["outputs/r", "read-only"], trained,
         read_only=["outputs/r"]),
    Case("eval-max-examples-zero", ["eval", "r.yaml", "--max-examples", "0"], ["--max-examples"], trained),
    Case("eval-no-model", ["eval", "r.yaml"], ["no trained model", "ctrain train"], setup()),
    # numbers out of range, paths of the wrong kind, overrides with unknown keys or bad values
    Case("max-length-over-positions", ["train", "r.yaml", "data.max_length=4096"],
         ["override 'data.max_length=4096'", "max_position_embeddings"], setup()),
    Case("max-length-huge", ["train", "--check", "r.yaml", "data.max_length=99999999999"], ["data.max_length"],
         setup()),
    Case("integer-beyond-64-bits", ["train", "r.yaml", "training.max_steps=99999999999999999999999"],
         ["training.max_steps", "too large"], setup()),
    Case("global-batch-huge", ["train", "--check", "r.yaml", "training.global_batch_size=1000000000000",
                               "--world-size", "3"], ["global_batch_size", "at most"], setup()),
    Case("learning-rate-nan", ["train", "r.yaml", "training.learning_rate=.nan"], ["learning_rate", "finite"],
         setup()),
    Case("negative-seed", ["prepare", "r.yaml", "seed=-1"], ["seed", "-1"], setup()),
    Case("eval-split-of-a-file", ["train", "r.yaml", "data.eval_size=null", "data.eval_split=test"],
         ["data.eval_split", "single split", "data.eval_size"], setup()),
    Case("zero-eval-batch", ["eval", "r.yaml", "eval.batch_size=0"], ["eval.batch_size", "at least 1"], setup()),
    Case("negative-weight-decay", ["train", "r.yaml", "training.weight_decay=-0.1"], ["weight_decay"], setup()),
    Case("zero-world-size", ["train", "--check", "r.yaml", "--world-size", "0"], ["world size 0"], setup()),
    Case("world-size-not-a-number", ["train", "--check", "r.yaml", "--world-size", "many"], ["--world-size"],
         setup(), exit_code=2),
    Case("model-path-is-a-file", ["train", "r.yaml", "model.config=null", "model.path=data.jsonl"],
         ["model.path", "is a file", "directory"], setup()),
    Case("chat-template-is-a-directory", ["prepare", "r.yaml", "tokenizer.chat_template=tpl"],
         ["tokenizer.chat_template", "directory"], setup(dirs=("tpl",))),
    Case("deepspeed-config-is-a-directory", ["train", "r.yaml", "training.deepspeed=ds"],
         ["training.deepspeed", "directory"], setup(dirs=("ds",))),
    Case("deepspeed-config-not-json", ["train", "r.yaml", "training.deepspeed=ds.json"],
         ["ds.json", "not valid JSON"], setup(files={"ds.json": "{zero: 3}"})),
    Case("deepspeed-config-nested-too-deep", ["train", "r.yaml", "training.deepspeed=ds.json"],
         ["training.deepspeed", "ds.json", "nests deeper than 64 levels"],
         setup(files={"ds.json": '{"a":' * 50_000 + "1" + "}" * 50_000})),
    Case("model-config-nested-too-deep", ["train", "r.yaml", "model.config=cfg.json", "model.config_overrides={}"],
         ["model: the config", "cfg.json", "nests deeper than 64 levels"],
         setup(files={"cfg.json": "[" * 50_000 + "]" * 50_000})),
    Case("model-config-is-a-device", ["train", "--check", "r.yaml", "model.config=/dev/zero"],
         ["model.config", "/dev/zero", "not a regular file"], setup()),
    Case("chat-template-is-a-device", ["prepare", "r.yaml", "tokenizer.chat_template=/dev/zero"],
         ["tokenizer.chat_template", "/dev/zero", "not a regular file"], setup()),
    Case("json-rows-nested-too-deep", ["train", "r.yaml", "data.source=d.json"],
         ["data.source", "d.json", "thousands of levels deep"], setup(files={"d.json": "[" * 50_000 + "]" * 50_000})),
    Case("override-unknown-key", ["train", "r.yaml", "training.max_stepz=5"],
         ["override 'training.max_stepz=5'", "did you mean 'max_steps'"], setup()),
    Case("override-bad-value", ["prepare", "r.yaml", "training.max_steps=lots"],
         ["override 'training.max_steps=lots'", "integer"], setup()),
    Case("override-without-key", ["train", "r.yaml", "=5"], ["key=value"], setup()),
    Case("optimizer-unknown", ["train", "r.yaml", "training.optim=adamw_fast"], ["training.optim", "adamw_torch"],
         setup()),
    Case("override-without-equals", ["train", "r.yaml", "training.max_steps"], ["key=value"], setup()),
    Case("override-section-value", ["train", "--check", "r.yaml", "training=5"], ["override 'training=5'", "mapping"],
         setup()),
    Case("override-bad-choice", ["eval", "r.yaml", "task=dpo"], ["override 'task=dpo'", "sft, clm"], setup()),
    Case("submit-recipe-override", [*SUBMIT, "--dry-run", "r.yaml", "training.max_stepz=1"],
         ["override 'training.max_stepz=1'"], setup()),
    Case("submit-recipe-bad-rows", [*SUBMIT, "--dry-run", "r.yaml"], ["data.jsonl", "row 2", "'messages'"],
         setup(data=lines([CHAT, {"text": "x"}]))),
    Case("submit-recipe-empty", [*SUBMIT, "--write-script", "x.sbatch", "r.yaml"], ["is empty", "model:"],
         setup(recipe="")),
]
# fmt: on


def test_the_table_is_large_and_unique() -> None:
    assert len(CASES) >= 35
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input(case: Case, tmp_path: Path) -> None:
    if case.read_only:
        need(os.geteuid() == 0 and shutil.which("unshare") is not None, "root and unshare (read-only mounts)")
    run_case(case, tmp_path, python=sys.executable)


# --- the safety net and the messages a non-root user gets -----------------------------------------


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (OSError(30, "Read-only file system", "/data/out"), "/data/out: read-only file system (EROFS): choose a"),
        (PermissionError(13, "Permission denied", "/data/out"), "(EACCES): choose a directory you can write"),
        (OSError(28, "No space left on device", "/data/out"), "(ENOSPC): free some space"),
        (OSError(36, "File name too long", "/data/" + LONG), "(ENAMETOOLONG): choose a shorter name"),
    ],
)
def test_file_system_refusals_that_escape_are_one_error_line(error: OSError, says: str) -> None:
    from click.testing import CliRunner

    from ctrain.cli import main

    @main.command("_raise", hidden=True)
    def _raise() -> None:
        raise error

    try:
        result = CliRunner().invoke(main, ["_raise"])
    finally:
        main.commands.pop("_raise")
    assert result.exit_code == 1
    assert [line for line in result.output.splitlines() if line.startswith("error:")] == [
        line for line in result.output.splitlines() if line.strip()
    ]
    assert says in result.output


def test_other_os_errors_stay_tracebacks() -> None:
    """A missing file the code itself should have checked is a bug: it must not hide behind error:."""
    from click.testing import CliRunner

    from ctrain.cli import main

    @main.command("_raise", hidden=True)
    def _raise() -> None:
        raise FileNotFoundError(2, "No such file or directory", "/x")

    try:
        result = CliRunner().invoke(main, ["_raise"])
    finally:
        main.commands.pop("_raise")
    assert isinstance(result.exception, FileNotFoundError)


def test_a_directory_left_by_root_says_to_chown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a user sees after a run as root left outputs/NAME behind (root cannot be refused, so pretend)."""
    from ctrain import files
    from ctrain.errors import ConfigError

    out = tmp_path / "outputs" / "run"
    (out / "checkpoint-10").mkdir(parents=True)
    me = os.geteuid() + 1000
    monkeypatch.setattr(files.os, "geteuid", lambda: me)
    monkeypatch.setattr(files, "_can_write", lambda path: path.name != "checkpoint-10")
    monkeypatch.setattr(files, "_user", lambda uid: "alice" if uid == me else "root")
    with pytest.raises(ConfigError) as err:
        files.check_tree(out, "training.output_dir", "set training.output_dir to a directory you can write")
    text = str(err.value)
    assert "checkpoint-10 belongs to root and alice cannot write to it" in text
    assert f"sudo chown -R alice {out}" in text and "or set training.output_dir" in text


def test_a_file_another_rank_removes_while_the_tree_is_checked_is_no_problem(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank checks the shared output directory at once, and each one's writability probe is a file
    at its top that the others may list and then find gone (a 2-node run failed so)."""
    from ctrain import files

    out = tmp_path / "outputs" / "run"
    out.mkdir(parents=True)
    probe = out / ".ctrain-probe-other"
    probe.write_bytes(b"")
    can_write = files._can_write

    def removed_by_the_other_rank(path: Path) -> bool:
        if path == probe:
            probe.unlink()
        return can_write(path)

    monkeypatch.setattr(files, "_can_write", removed_by_the_other_rank)
    files.check_tree(out, "training.output_dir", "set training.output_dir to a directory you can write")
    assert not probe.exists()


def test_the_error_line_starts_the_line_under_the_rank_prefix() -> None:
    import io

    from ctrain.train.logs import PrefixedWriter

    sink = io.StringIO()
    writer = PrefixedWriter(sink, "[rank 0 host h] ")
    writer.write("half a line")
    writer.write_marked("error: ", "it broke")
    assert sink.getvalue().splitlines() == ["[rank 0 host h] half a line", "error: [rank 0 host h] it broke"]


def test_a_data_directory_too_large_to_search_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.source: ~ or / would be searched for minutes; past a bound it is a mistake, said at once."""
    from ctrain.errors import ConfigError
    from ctrain.train import sources
    from ctrain.train.recipe import DataSettings

    for number in range(12):
        (tmp_path / f"notes-{number}.txt").write_text("x")
    (tmp_path / "train.jsonl").write_text(lines(GOOD))
    monkeypatch.setattr(sources, "MAX_SOURCE_ENTRIES", 10)
    with pytest.raises(ConfigError, match="holds more than 10 files and directories: point it at the data"):
        sources.resolve_source(DataSettings(source=str(tmp_path)))
    monkeypatch.setattr(sources, "MAX_SOURCE_ENTRIES", 100)
    assert sources.resolve_source(DataSettings(source=str(tmp_path))).files == (tmp_path / "train.jsonl",)


def test_config_overrides_that_make_no_valid_config(tmp_path: Path) -> None:
    from ctrain.errors import ConfigError
    from ctrain.train.model import load_config
    from ctrain.train.recipe import load_recipe

    project(tmp_path)
    recipe = load_recipe(tmp_path / "r.yaml", ["model.config_overrides.num_attention_heads=3"])
    with pytest.raises(ConfigError, match=r"do not make a valid llama config: .*not a multiple of .* heads \(3\)"):
        load_config(recipe)


def test_a_glob_through_a_link_loop_reads_each_file_once(tmp_path: Path) -> None:
    """`data/**/*.jsonl` with data/sub -> data: glob names the file 41 times; it is read once."""
    from ctrain.train.recipe import DataSettings
    from ctrain.train.sources import resolve_source

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(lines([CHAT]))
    (tmp_path / "data" / "sub").symlink_to("../data")
    (tmp_path / "data" / "also.jsonl").symlink_to("a.jsonl")
    source = resolve_source(DataSettings(source=str(tmp_path / "data" / "**" / "*.jsonl")))
    assert source.files == (tmp_path / "data" / "a.jsonl",)


def test_adapter_rank_above_the_models_width_is_refused_before_weights_load() -> None:
    from transformers import LlamaConfig

    from ctrain.settings import from_mapping
    from ctrain.train.model import check_sizes
    from ctrain.train.recipe import Recipe

    def recipe(rank: int) -> Recipe:
        return from_mapping(Recipe, {"model": {"path": "m"}, "data": {"source": "d.jsonl", "max_length": 64},
                                     "peft": {"method": "lora", "r": rank}})  # fmt: skip

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         max_position_embeddings=128, vocab_size=300)  # fmt: skip
    with pytest.raises(ConfigError, match=r"peft.r \(256\) is larger than the model's hidden size \(128, the llama"):
        check_sizes(recipe(256), config)
    check_sizes(recipe(128), config)
