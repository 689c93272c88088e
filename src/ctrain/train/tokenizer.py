"""Tokenizers: loaded from a path or hub name, or trained on the recipe's data for from-scratch models.

A trained tokenizer is byte-level BPE (any text encodes, nothing is unknown) with each digit its
own token, so numbers are read digit by digit. It gets ctrain's chat template, whose assistant
turns carry ``{% generation %}`` markers so the loss can be limited to what the assistant says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from ctrain.errors import ConfigError
from ctrain.files import read_text_bounded
from ctrain.settings import MAX_SETTINGS_BYTES
from ctrain.train.recipe import Recipe, TokenizerTraining, expand_path

log = logging.getLogger("ctrain.train")

BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = [PAD, BOS, EOS, *(f"<|{role}|>" for role in ROLES)]

# Every turn ends with EOS; only the assistant's words and its EOS fall inside the generation
# markers, so with assistant-only loss the model learns to answer and to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def texts_for_training(rows: Iterable[dict[str, Any]], recipe: Recipe) -> Iterator[str]:
    """The text of each example: chat message contents, prompt and completion, or the text column."""
    data = recipe.data
    for row in rows:
        if data.messages_column in row and recipe.task == "sft":
            for message in row[data.messages_column]:
                yield str(message.get("content") or "")
        elif data.prompt_column in row and data.completion_column in row and recipe.task == "sft":
            for part in (row[data.prompt_column], row[data.completion_column]):
                if isinstance(part, list):
                    yield from (str(m.get("content") or "") for m in part)
                else:
                    yield str(part)
        else:
            yield str(row[data.text_column])


def train_tokenizer(texts: Iterable[str], settings: TokenizerTraining) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        min_frequency=settings.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=10**9,
    )


def load_tokenizer(recipe: Recipe) -> Any:
    """The tokenizer named by ``tokenizer.path`` (else the model's), with a pad token."""
    from transformers import AutoTokenizer

    reference = recipe.tokenizer.path or recipe.model.path
    assert reference is not None, "recipe validation guarantees a tokenizer source"
    local = expand_path(reference)
    revision = recipe.model.revision if not recipe.tokenizer.path else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(local) if local.exists() else reference,
            revision=revision,
            trust_remote_code=recipe.model.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the tokenizer {reference}: {exc}") from exc
    return finish_tokenizer(tokenizer, recipe)


def finish_tokenizer(tokenizer: Any, recipe: Recipe) -> Any:
    """Apply the recipe's chat template and make sure a pad token exists."""
    if recipe.tokenizer.chat_template:
        tokenizer.chat_template = read_text_bounded(
            expand_path(recipe.tokenizer.chat_template), MAX_SETTINGS_BYTES, "tokenizer.chat_template:"
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"the tokenizer {recipe.tokenizer.path or recipe.model.path} has neither a pad nor an eos token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
