"""ctrain: container-first training of Hugging Face models on Slurm clusters."""

from __future__ import annotations

__version__ = "0.1.0"
