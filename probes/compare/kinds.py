"""The kind of a divergence in plain words: which part of the training step first differs. One table, ``KINDS``.

    kind = divergence_kind(first, recorded={"forward", "backward", "grad", "param"}, differing={"param"})
    kind.code; kind.sentence             # "update"; "gradients agree, the update differs"
    kind.to_json()                       # compare's JSON field first_divergence_kind

The kind is the phase of the first divergence (the earliest phase of its step, ``probes.utils.phases``): every
record of the phases before it in that step agrees, on every rank. "Agree" is said only of phases the step
recorded; the earlier phases it did not record are named ("backward not recorded"): nothing is known of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..utils.phases import PHASES, RECOMPUTE, phase_rank
from .results import Divergence

__all__ = ["KINDS", "DivergenceKind", "Kind", "divergence_kind"]


@dataclass(frozen=True)
class Kind:
    """What a first divergence in ``phase`` means; ``agrees`` says so of the ``basis`` phases, when recorded."""

    phase: str
    code: str  # stable, for scripts reading the JSON
    differs: str
    agrees: str = ""
    basis: tuple[str, ...] = ()


KINDS: tuple[Kind, ...] = (
    Kind("forward", "forward", "the forward differs (activations)"),
    Kind("backward", "backward", "the gradients flowing back differ", "the forward agrees", ("forward",)),
    Kind("recompute", "recompute", "the recomputed forward differs (activation checkpointing)",
         "the forward and the backward agree", ("forward", "backward")),
    Kind("grad", "gradients", "the parameter gradients differ (accumulation, clipping, all-reduce)",
         "activations agree", ("forward", "backward")),
    Kind("param", "update", "the update differs", "gradients agree", ("grad",)),
    Kind("optim", "optimizer_state", "the optimizer state differs", "parameters agree", ("param",)),
)
_BY_PHASE = {kind.phase: kind for kind in KINDS}
_NOUNS = {"forward": "the forward", "backward": "the backward", "recompute": "the recomputed forward",
          "grad": "the gradients", "param": "the parameters"}


@dataclass(frozen=True)
class DivergenceKind:
    """The kind of a report's first divergence, and what it was decided from (phases of the diverging step)."""

    code: str
    phase: str
    sentence: str
    recorded: tuple[str, ...]  # the phases the step holds records of, in either run
    differing: tuple[str, ...]  # the phases with a divergence in the step

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "phase": self.phase, "sentence": self.sentence,
                "recorded": list(self.recorded), "differing": list(self.differing)}


def divergence_kind(first: Divergence, *, recorded: Iterable[str], differing: Iterable[str]) -> DivergenceKind:
    """The kind of ``first``, given the phases its step ``recorded`` (either run, any rank) and those ``differing``."""
    held = tuple(sorted(set(recorded) | {first.phase}, key=phase_rank))
    kind = _BY_PHASE.get(first.phase, Kind(first.phase, "other", f"the {first.phase} records differ"))
    earlier = [phase for phase in PHASES if phase_rank(phase) < phase_rank(first.phase)]
    agreeing = [phase for phase in earlier if phase in held]
    missing = [phase for phase in earlier if phase not in held and phase != RECOMPUTE]  # recompute is optional
    if kind.basis and all(phase in held for phase in kind.basis):
        lead = kind.agrees
    elif agreeing:
        lead = " and ".join(_NOUNS[phase] for phase in agreeing) + (" agrees" if len(agreeing) == 1 else " agree")
    else:
        lead = ""
    sentence = f"{lead}, {kind.differs}" if lead else kind.differs
    if missing:
        sentence += f" ({', '.join(missing)} not recorded)"
    return DivergenceKind(kind.code, first.phase, sentence, held,
                          tuple(sorted(set(differing) | {first.phase}, key=phase_rank)))
