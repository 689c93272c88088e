"""``ctrain eval``: ask the trained model the held-out examples and count exact answers.

The prompt is each held-out chat without its last assistant turn (or the ``prompt`` column); the
answer is the model's greedy continuation up to its end-of-turn token, compared with the held-out
assistant turn (or ``completion``) after stripping surrounding whitespace.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

from ctrain.errors import ConfigError
from ctrain.files import check_directory, check_file
from ctrain.train import checkpoint
from ctrain.train.artifacts import COMPLETE_MARKER, EVAL_FILE, FINAL_DIR, RECIPE_COPY
from ctrain.train.preflight import preflight
from ctrain.train.recipe import Recipe
from ctrain.train.sources import example_kind

log = logging.getLogger("ctrain.train")



def _pairs(rows: Any, recipe: Recipe) -> list[tuple[Any, str]]:
    """(prompt, expected answer) for each held-out example."""
    data = recipe.data
    kind = example_kind(list(rows.column_names), recipe)
    pairs = []
    for row in rows:
        if kind == "messages":
            messages = row[data.messages_column]
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None:
                continue
            pairs.append((messages[:last], str(messages[last]["content"])))
        elif kind == "prompt_completion":
            completion = row[data.completion_column]
            expected = completion[-1]["content"] if isinstance(completion, list) else completion
            pairs.append((row[data.prompt_column], str(expected)))
        else:
            raise ConfigError("ctrain eval needs chats or prompt/completion examples to ask; this data is plain text")
    return pairs


def written_by_ctrain(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a final model or checkpoint that ``ctrain train`` writes (and marks):
    one in a ctrain run directory (its ``recipe.yaml`` beside), or a final model with its own copy.
    A Trainer's ``checkpoint-N`` elsewhere is another program's model, evaluated as it is."""
    if (model_dir / RECIPE_COPY).is_file():
        return True
    in_a_run = (model_dir.parent / RECIPE_COPY).is_file()
    return in_a_run and (model_dir.name == FINAL_DIR or checkpoint.step_of(model_dir) is not None)


def check_model_dir(model_dir: Path) -> None:
    """Refuse a model ctrain did not finish saving, or whose files changed since (ConfigError).

    A final model without its marker is what a job killed while saving it leaves: its weights
    may be missing, short or from the wrong step, and it may even load and give wrong answers.
    """
    if checkpoint.read_marker(model_dir) is None:
        if written_by_ctrain(model_dir) and model_dir.is_dir():
            raise ConfigError(
                f"{model_dir} has no {COMPLETE_MARKER}: the run stopped while saving it, so it may be unfinished; "
                "run the same `ctrain train` command again (it saves the final model from the last checkpoint "
                "without training further), or pass --model with a complete model directory"
            )
        if not any((model_dir / name).is_file() for name in ("config.json", "adapter_config.json")):
            raise ConfigError(f"no trained model in {model_dir}: run `ctrain train` first (or pass --model DIR)")
        return
    verdict = checkpoint.verify(model_dir)
    if verdict.damage is not None:
        raise ConfigError(
            f"{model_dir} is damaged ({verdict.damage}): its files changed after ctrain saved it; save it again "
            "(delete it and run the same `ctrain train` command: it saves the final model from the last checkpoint) "
            "or pass --model with another model directory"
        )
    log.info("%s: %s", model_dir, verdict.summary())


def check(recipe: Recipe, model_dir: Path | None = None) -> None:
    """What can fail before the model loads, without torch: the recipe and its data, the model's
    directory, held-out examples to ask, and a place for eval.json."""
    preflight(recipe)
    model_dir = model_dir or recipe.output_dir / FINAL_DIR
    if model_dir.exists() and not model_dir.is_dir():
        raise ConfigError(f"--model {model_dir} is a file; name the directory of a trained model")
    check_model_dir(model_dir)
    if not (recipe.data.eval_split or recipe.data.eval_size):
        raise ConfigError("ctrain eval asks held-out examples: set data.eval_size or data.eval_split in the recipe")
    other = "set training.output_dir to a directory you can write"
    check_directory(recipe.output_dir, "the output directory", other)
    if recipe.output_dir.is_dir():
        check_file(recipe.output_dir / EVAL_FILE, "the result", other)
    from ctrain.train.data import check_cache

    check_cache(recipe)


def evaluate(recipe: Recipe, model_dir: Path | None = None, max_examples: int | None = None,
             on_batch: Callable[[], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Exact-match accuracy of the model in ``model_dir`` (default: the recipe's final model) on held-out examples.
    ``on_batch`` is called after each generated batch (a training job's heartbeat, for its watchdog)."""
    model_dir = model_dir or recipe.output_dir / FINAL_DIR
    check(recipe, model_dir)  # before torch is imported: a refusal takes no time
    import torch

    from ctrain.train.data import load_raw
    from ctrain.train.model import load_trained
    from ctrain.train.tokenizer import read_tokenizer

    _, held_out = load_raw(recipe, streaming=False)
    if held_out is None:
        raise ConfigError("ctrain eval asks held-out examples: set data.eval_size or data.eval_split in the recipe")
    limit = max_examples or recipe.eval.max_examples
    pairs = _pairs(held_out, recipe)[:limit]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = read_tokenizer(str(model_dir))
    tokenizer.padding_side = "left"
    model = load_trained(model_dir, recipe).to(device).eval()
    started = time.perf_counter()
    answers: list[str] = []
    size = recipe.eval.batch_size
    for start in range(0, len(pairs), size):
        prompts = [
            tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if isinstance(p, list) else p
            for p, _ in pairs[start : start + size]
        ]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            output = model.generate(
                **batch,
                max_new_tokens=recipe.eval.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        new = output[:, batch["input_ids"].shape[1] :]
        answers.extend(text.strip() for text in tokenizer.batch_decode(new, skip_special_tokens=True))
        if on_batch is not None:
            on_batch()
    correct = [a == expected.strip() for a, (_, expected) in zip(answers, pairs)]
    result = {
        "accuracy": sum(correct) / len(correct) if correct else 0.0,
        "correct": sum(correct),
        "total": len(correct),
        "model": str(model_dir),
        "seconds": round(time.perf_counter() - started, 1),
        "examples": [
            {"prompt": p if isinstance(p, str) else p[-1]["content"], "expected": e, "answer": a}
            for (p, e), a in list(zip(pairs, answers))[:5]
        ],
    }
    recipe.output_dir.mkdir(parents=True, exist_ok=True)
    (recipe.output_dir / EVAL_FILE).write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary(result: dict[str, Any]) -> str:
    """The result's one line, as ``ctrain eval`` prints it and a training job logs it."""
    return f"accuracy: {result['accuracy']:.3f} ({result['correct']}/{result['total']} exact) {result['model']}"
