"""The benchmark's problem as files ``ctrain train`` reads: its chats as JSON lines, its tokenizer
with the chats' template, and a random model of its shape, so the product path trains exactly what
the bench measured (the same tokens, loss mask and weights' shape)."""

from __future__ import annotations

import json
from pathlib import Path

from ctrain.bench import data
from ctrain.bench.spec import BenchSpec
from ctrain.errors import ConfigError

CHATS, TOKENIZER, MODEL = "chats.jsonl", "tokenizer", "model"


def export(spec: BenchSpec, directory: Path, device: str) -> list[str]:
    """Write ``spec``'s chats, tokenizer and a random bf16 model (made on ``device``) under
    ``directory``; returns the recipe overrides that point ``ctrain train`` at them."""
    import torch
    from transformers.utils import logging as hf_logging

    from ctrain.bench.run import base_model

    if directory.exists() and any(directory.iterdir()):
        raise ConfigError(f"--export {directory} is not empty: name a new or empty directory")
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / CHATS).open("w") as handle:
        for chat in data.chats(spec):
            handle.write(json.dumps(chat) + "\n")
    data.tokenizer(spec).save_pretrained(directory / TOKENIZER)
    model = base_model(spec, device, torch.bfloat16, "sdpa")
    hf_logging.disable_progress_bar()  # the overrides are the command's only output
    model.save_pretrained(directory / MODEL)
    del model
    return [
        f"model.path={directory / MODEL}",
        f"tokenizer.path={directory / TOKENIZER}",
        f"data.source={directory / CHATS}",
        "data.split=train",
        "data.eval_split=null",
    ]
