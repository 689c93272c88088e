"""The embedded demo's data: two-digit addition as chats, generated here, so the demo needs no download.

``data.source: builtin:addition`` yields every problem ``a + b`` with ``10 <= a, b <= 99`` once
(8100 chats) in an order fixed by the recipe's seed; ``data.eval_size`` holds some out, and
``ctrain eval`` asks the trained model those and counts exact answers.
"""

from __future__ import annotations

import random
from typing import Any

# Columns of each builtin source (read by the recipe check without generating anything).
BUILTIN_COLUMNS: dict[str, tuple[str, ...]] = {"addition": ("messages",)}

OPERANDS = range(10, 100)


def addition_chat(a: int, b: int) -> list[dict[str, str]]:
    """One problem as a chat: the user asks, the assistant answers with the number only."""
    return [
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": str(a + b)},
    ]


def builtin_rows(name: str, seed: int) -> list[dict[str, Any]]:
    """All examples of builtin source ``name``, shuffled with ``seed``."""
    if name != "addition":
        raise KeyError(name)
    problems = [(a, b) for a in OPERANDS for b in OPERANDS]
    random.Random(seed).shuffle(problems)
    return [{"messages": addition_chat(a, b)} for a, b in problems]
