"""What a run writes and how it ends: file and directory names in the output directory, and exit codes.

One place, because several parties must agree on them: the trainer writes them, ``ctrain eval``
and ``ctrain prepare`` read them, and the sbatch library and ``ctrain submit`` act on them.
"""

from __future__ import annotations

from ctrain import protocol

# Exit code of a run that stopped on a preemption signal after saving a complete checkpoint:
# "checkpointed, requeue me" (EX_TEMPFAIL from sysexits.h). The sbatch scripts requeue on it
# (CTRAIN_REQUEUE_EXIT; ctrain.protocol.EXIT_CODES lists every code).
PREEMPTED_EXIT_CODE = protocol.EXIT_REQUEUE  # 75
# Exit code of a run stopped because its loss or gradient norm was NaN or infinite, before that
# state was saved: do not requeue (it would diverge again); lower the learning rate or fix the data.
NONFINITE_EXIT_CODE = protocol.EXIT_NONFINITE  # 65, EX_DATAERR (errors.NonFiniteTraining's)

# Files ctrain writes into the output directory (documented in docs/training.md).
COMPLETE_MARKER = "ctrain-complete.json"  # last file of a checkpoint or final model: it is whole
PREPARED_MARKER = "ctrain-prepared.json"  # last file of a prepared data set, with what it was made from
PREEMPTED_FILE = "ctrain-preempted.json"  # written when a run stops on a preemption signal
FINAL_DIR = "final"  # the trained model and tokenizer, Hugging Face format
PREVIOUS_FINAL_DIR = "final.previous"  # FINAL_DIR of a finished run that training.resume=continue went on with
MERGED_DIR = "merged"  # in FINAL_DIR with peft.merge: the base model with the adapter folded in
PREPARED_DIR = "prepared"  # default place of `ctrain prepare`'s output
METRICS_FILE = "metrics.jsonl"  # every logged step, one JSON object a line
RECIPE_COPY = "recipe.yaml"  # the recipe as run, overrides applied
WANDB_RUN_FILE = "wandb-run-id"  # the W&B run a training logs to, kept for its resumes (one run across requeues)
TENSORBOARD_DIR = "runs"  # TensorBoard's event files, every resume's in one run
EVAL_FILE = "eval.json"  # `ctrain eval`'s result (also of a base model, before any training)
