"""The phases of a training step, defined once: what a record's ``phase`` may be, and their order.

    from probes.utils.phases import PHASES, phase_rank
    records.sort(key=lambda record: (record["step"], phase_rank(record["phase"]), record["seq"]))

- ``forward``: a module's outputs (or inputs) as the forward computes them;
- ``backward``: the gradients flowing back through them;
- ``recompute``: a forward that activation checkpointing recomputes during the backward (recorded only
  for subscribers that ask; selection treats it as ``forward``);
- ``grad``: a parameter's gradient as the optimizer uses it (after accumulation and clipping);
- ``param``: a parameter after the optimizer's update;
- ``optim``: an optimizer state tensor of a parameter (``<parameter>.exp_avg``), after the update.

Within a step the order is that of execution: forward, backward, recompute, grad, param, optim; so the
first divergence of a step is the earliest of them (an update that differs shows at ``param``).
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["forward", "backward", "recompute", "grad", "param", "optim"]

PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute", "grad", "param", "optim")  # execution order in a step
OBSERVED: tuple[Phase, ...] = ("forward", "backward")  # what a probe sees every step
PARAMETER_PHASES: tuple[Phase, ...] = ("grad", "param", "optim")  # what the optimizer's step gives (parameters=True)
SELECTABLE: tuple[Phase, ...] = OBSERVED + PARAMETER_PHASES  # what ``phases=`` chooses from
GRADIENT_PHASES = frozenset({"backward"})  # phases whose tensors are gradients
RECOMPUTE: Phase = "recompute"
GRAD: Phase = "grad"  # a parameter's gradient: what the global gradient norm sums

_RANK = {phase: rank for rank, phase in enumerate(PHASES)}


def phase_rank(phase: object) -> int:
    """The position of ``phase`` in a step's execution order; an unknown phase sorts last."""
    return _RANK.get(phase, len(_RANK))  # type: ignore[arg-type]
