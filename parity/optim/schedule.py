"""Learning-rate schedule: linear warmup, then constant or cosine decay (docs/spec/megatron.md s2.15).

A pure function of the step index, evaluated in Python floats: both sides of a pair, and every
rank, use the same lr at the same step. Step k (0-based) is trained with the lr of ``k`` completed
steps, as upstream's scheduler does (it is built at step 0 and advanced after each step), so with
warmup the first step runs at lr 0.
"""

from __future__ import annotations

import math

DECAY_STYLES = ("constant", "cosine")


def lr_at(step: int, *, lr: float, lr_min: float = 0.0, warmup_steps: int = 0,
          decay_steps: int | None = None, decay_style: str = "constant") -> float:
    """The lr of training step ``step``; ``decay_steps`` counts from step 0, warmup included."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * float(step) / float(warmup_steps)
    if decay_style == "constant":
        return lr
    if step > decay_steps:
        return lr_min
    ratio = float(step - warmup_steps) / float(decay_steps - warmup_steps)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return lr_min + coeff * (lr - lr_min)
