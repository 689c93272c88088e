"""The embedded demo's data: two-digit arithmetic as chats, generated here, so the demo needs no download.

``data.source: builtin:addition`` yields every problem ``a + b`` with ``10 <= a, b <= 99`` once
(8100 chats) in an order fixed by the recipe's seed; ``data.eval_size`` holds some out, and
``ctrain eval`` asks the trained model those and counts exact answers. ``builtin:subtraction``
(every ``a - b`` with ``10 <= b <= a <= 99``, 4095 chats) is a second task in the same words and
digits: the LoRA demo adapts a model trained on addition to it (recipes/demo-lora.yaml).
"""

from __future__ import annotations

import random
from typing import Any

# Columns of each builtin source (read by the recipe check without generating anything).
BUILTIN_COLUMNS: dict[str, tuple[str, ...]] = {"addition": ("messages",), "subtraction": ("messages",)}

OPERANDS = range(10, 100)


def addition_chat(a: int, b: int) -> list[dict[str, str]]:
    """One problem as a chat: the user asks, the assistant answers with the number only."""
    return [
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": str(a + b)},
    ]


def subtraction_chat(a: int, b: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"What is {a} - {b}?"},
        {"role": "assistant", "content": str(a - b)},
    ]


def builtin_rows(name: str, seed: int) -> list[dict[str, Any]]:
    """All examples of builtin source ``name``, shuffled with ``seed``."""
    if name == "addition":
        problems = [(a, b) for a in OPERANDS for b in OPERANDS]
        chat = addition_chat
    elif name == "subtraction":
        problems = [(a, b) for a in OPERANDS for b in OPERANDS if b <= a]
        chat = subtraction_chat
    else:
        raise KeyError(name)
    random.Random(seed).shuffle(problems)
    return [{"messages": chat(a, b)} for a, b in problems]
