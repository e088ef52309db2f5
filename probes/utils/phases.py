"""The phases of a training step, defined once: what a record's ``phase`` may be, and their order.

    from probes.utils.phases import PHASES, phase_rank
    records.sort(key=lambda record: (record["step"], phase_rank(record["phase"]), record["seq"]))

- ``forward``: a module's outputs (or inputs) as the forward computes them;
- ``backward``: the gradients flowing back through them;
- ``recompute``: a forward that activation checkpointing recomputes during the backward (recorded only
  for subscribers that ask; selection treats it as ``forward``).
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["forward", "backward", "recompute"]

PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute")  # in execution order within a step
OBSERVED: tuple[Phase, ...] = ("forward", "backward")  # what a probe sees every step; what selection chooses
GRADIENT_PHASES = frozenset({"backward"})  # phases whose tensors are gradients
RECOMPUTE: Phase = "recompute"

_RANK = {phase: rank for rank, phase in enumerate(PHASES)}


def phase_rank(phase: object) -> int:
    """The position of ``phase`` in a step's execution order; an unknown phase sorts last."""
    return _RANK.get(phase, len(_RANK))  # type: ignore[arg-type]
