"""A causal-LM training script of the kind teams bring to a cluster: argparse, a model, a data set,
transformers' Trainer. It runs as it is under ctrain's sbatch scripts:

    sbatch sbatch/apptainer_multinode.sbatch -- examples/train_clm.py --output_dir /outputs/clm
    ctrain submit --nodes 2 -- examples/train_clm.py --output_dir /outputs/clm

The two lines marked "ctrain" are the whole opt-in (docs/sbatch.md, "A training program of your
own"): with them a preemption or time-limit signal ends the run at a checkpoint that the requeued
job resumes from, the hang watchdog sees each step, and an error ends the job at once.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ctrain.train.hf import Callback  # ctrain


class Counting(torch.utils.data.Dataset):
    """Rows of tokens that count up from a row's own start (mod the vocabulary): learnable, no files."""

    def __init__(self, rows: int, length: int, vocab: int) -> None:
        self.rows, self.length, self.vocab = rows, length, vocab

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = (index * 7) % self.vocab
        ids = (torch.arange(self.length) + start) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--save_steps", type=int, default=1000)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    args = parser.parse_args()

    vocab = 96
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, save_steps=args.save_steps,
        per_device_train_batch_size=args.per_device_train_batch_size, learning_rate=args.learning_rate,
        logging_steps=10, report_to="none", seed=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=Counting(4096, 32, vocab),
                      callbacks=[Callback()])  # ctrain  # fmt: skip
    # Resume from the newest checkpoint, after a requeue (the directory is made by rank 0's Trainer).
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
        print("losses " + json.dumps(losses), flush=True)
        trainer.save_model(f"{args.output_dir}/final")


if __name__ == "__main__":
    main()
