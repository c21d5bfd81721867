"""Where the course's shipped things live: the tiny model, its draft model, the committed GPU results.

Why a module of its own: every floor needs these names (the embedded server serves the tiny model, the memory
lesson counts it, lessons 11, 14 and 15 read the committed GPU runs), and a constant borrowed sideways from one
lesson by another hides who owns it.  It sits on the bottom floor, so any module may import it; notebooks reach
these names through the lesson module that teaches them (``llmlab.engines``, ``llmlab.memory``).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
MODELS_DIR = PACKAGE / "models"
TINY_NAME = "llmlab-tiny"
TINY_MODEL = MODELS_DIR / TINY_NAME
# Notebook 12's draft model: the tiny model's tokenizer, a quarter of its work per token
# (python -m llmlab.ops.tinymodel --draft).
DRAFT_MODEL = MODELS_DIR / "llmlab-tiny-draft"
# The committed measurements (rehearsals and lesson runs on GPUs, CPU benchmarks), in the repository.
RESULTS_DIR = PACKAGE.parent / "benchmarks" / "results"
