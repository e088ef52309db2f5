"""The report of a comparison (what ``compare_dumps`` returns) and its JSON document.

    report.agrees; report.first_divergence; report.per_step()
    report.first_operation.explained()                    # with op records: "local: the operation itself (...)"
    report.first_divergence_kind().sentence               # "gradients agree, the update differs"
    json.dump(report.to_json(), file)                     # the schema of docs/compare.md

The kind of a first divergence (``divergence_kind``, one table ``KINDS``) is the phase of the first divergence
(the earliest phase of its step, ``probes.utils.phases``): every record of the phases before it in that step
agrees, on every rank. "Agree" is said only of phases the step recorded; the earlier phases it did not record
are named ("backward not recorded"): nothing is known of them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dump.anomaly import Anomaly
from ..dump.record import RecordKey
from ..utils.phases import PHASES, RECOMPUTE, phase_rank
from .options import PRECISIONS, CompareConfig
from .recorddiffs import RecordDiffs
from .results import (BIT_IDENTICAL, BYTES_DIFFER, ZERO_GRAD_NOTE, Damaged, Divergence, GradNorm, NoiseFloor, OpFinding,
                      Operations, Rename, StepSummary, key_json, op_name)

__all__ = ["JSON_FORMAT", "JSON_VERSION", "KINDS", "DivergenceKind", "Kind", "Report", "divergence_kind"]

JSON_FORMAT = "probes-compare"
JSON_VERSION = 1


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


@dataclass
class Report:
    """The result of ``compare_dumps``; ``agrees`` is the verdict."""

    base: str
    other: str
    noise: str | None
    config: CompareConfig
    records: RecordDiffs  # matched records, in execution order (a list of RecordDiff is turned into one)
    only_in_base: list[RecordKey]
    only_in_other: list[RecordKey]
    base_steps: dict[int, list[int]]  # rank -> finished steps compared
    other_steps: dict[int, list[int]]
    unfinished: dict[str, dict[int, list[int]]]  # "base"/"other" -> rank -> unfinished steps (not read)
    first_divergence: Divergence | None = None
    noise_unmatched: int = 0  # matched records without a counterpart in the noise run
    # (key, "base" or "other": the run that has it) of each gradient exactly zero in one run and absent
    # in the other, in execution order; not in only_in_base/only_in_other. Empty with strict_zero_grads.
    zero_grads: list[tuple[RecordKey, str]] = field(default_factory=list)
    # "base"/"other" -> the run's first record holding nan or inf (execution order, across ranks), or None.
    first_nonfinite: dict[str, Anomaly | None] = field(default_factory=dict)
    # OTHER's names compared under BASE's names (name map, fuzzy alignment), in BASE's execution order.
    renamed: list[Rename] = field(default_factory=list)
    # "base"/"other"/"noise" -> step files left out because they cannot be read (skip_damaged); a step damaged
    # in one run is left out of both.
    damaged: dict[str, list[Damaged]] = field(default_factory=dict)
    # "base"/"other" -> (rank, step) -> the step's global gradient norm (probes.dump.statistics.global_grad_norms
    # of the grad records compared, in file order); only the (rank, step)s with grad records.
    grad_norms: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    # With a calibration run (``noise``): the records beyond and within their noise floors; None without one.
    noise_floor: NoiseFloor | None = None
    # When a run has op records (kind "op"): the diverged operations under their module calls, the first diverging
    # operation and what its inputs' records say (``probes.compare.results``); None when neither run has op records.
    operations: Operations | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.records, RecordDiffs):
            self.records = RecordDiffs.of(self.records)

    @property
    def matched(self) -> int:
        return len(self.records)

    @property
    def diverged_count(self) -> int:
        """How many matched records diverged."""
        return len(self.records.diverged_rows())

    @property
    def divergences(self) -> list[Divergence]:
        """Every diverged matched record, in execution order."""
        return [record.divergence() for record in self.records.at(self.records.diverged_rows())]

    @property
    def steps_only_in_base(self) -> list[int]:
        return sorted(_all_steps(self.base_steps) - _all_steps(self.other_steps))

    @property
    def steps_only_in_other(self) -> list[int]:
        return sorted(_all_steps(self.other_steps) - _all_steps(self.base_steps))

    @property
    def agrees(self) -> bool:
        """True when every record of both runs is matched and within tolerance. Op records of one run only are
        listed, not counted (``ops_in_one_run``): decompositions differ between backends, and an operation that
        changes a result shows in the records of the operations after it."""
        return self.first_divergence is None and len(self.ops_in_one_run) == len(self.only_in_base) + len(
            self.only_in_other)

    @property
    def ops_in_one_run(self) -> list[RecordKey]:
        """The op records in ``only_in_base`` and ``only_in_other`` (docs/compare.md, operations of one run only)."""
        return [key for key in (*self.only_in_base, *self.only_in_other) if op_name(key[3]) is not None]

    def per_rank(self) -> dict[int, Divergence | None]:
        """Per rank compared (``ranks=True``: each rank against rank 0): its first divergence, None where it agrees."""
        found: dict[int, Divergence | None] = {rank: None for rank in sorted({*self.base_steps, *self.other_steps})}
        for offset, chunk in self.records.chunks():
            diverged = chunk.summary().diverged_rows
            if not len(diverged):
                continue
            ranks = np.asarray(chunk.rank[diverged])
            for rank in found:
                rows = diverged[ranks == rank]
                if found[rank] is None and len(rows):
                    found[rank] = self.records[offset + int(rows[0])].divergence()
        first = self.first_divergence
        if first is not None and found.get(first.rank) is None:
            found[first.rank] = first  # a record on one side only
        return found

    def per_step(self) -> list[StepSummary]:
        """One summary per step of either run (matched, diverged, only in one run, the worst record)."""
        key = (len(self.records), len(self.only_in_base), len(self.only_in_other))
        cached = self.__dict__.get("_per_step")
        if cached is None or cached[0] != key:
            self.__dict__["_per_step"] = cached = (key, self._per_step())
        return list(cached[1])

    def _per_step(self) -> list[StepSummary]:
        matched: Counter[int] = Counter()
        diverged: Counter[int] = Counter()
        worst: dict[int, tuple[float, int]] = {}  # step -> (ratio, row) of its worst record so far
        for offset, chunk in self.records.chunks():  # a part's counts and worst, merged in execution order
            part = chunk.summary()
            for key, count, bad, row, ratio in zip(part.steps.tolist(), part.matched.tolist(), part.diverged.tolist(),
                                                   part.worst_rows.tolist(), part.worst_ratios.tolist()):
                matched[key] += count
                diverged[key] += bad
                if key not in worst or ratio > worst[key][0] or (math.isnan(worst[key][0]) and not math.isnan(ratio)):
                    worst[key] = (ratio, offset + row)
        steps = sorted(_all_steps(self.base_steps) | _all_steps(self.other_steps) | set(matched))
        rows = [row for _, row in worst.values()]
        records = dict(zip(worst, self.records.at(rows)))
        only_base = Counter(key[1] for key in self.only_in_base)
        only_other = Counter(key[1] for key in self.only_in_other)
        norms = self._grad_norms()
        return [StepSummary(step, matched[step], diverged[step], only_base[step], only_other[step], records.get(step),
                            norms.get(step))
                for step in steps]

    def _grad_norms(self) -> dict[int, GradNorm]:
        """Per step the global gradient norms of both runs, on the lowest rank either run has one for."""
        base, other = self.grad_norms.get("base", {}), self.grad_norms.get("other", {})
        lowest: dict[int, int] = {}
        for rank, step in (*base, *other):
            lowest[step] = min(rank, lowest.get(step, rank))
        return {step: GradNorm(rank, base.get((rank, step)), other.get((rank, step))) for step, rank in lowest.items()}

    @property
    def first_operation(self) -> OpFinding | None:
        """The first diverging operation, with its inputs' verdicts: the first divergence when it is an op record,
        else the earliest diverged operation of the first divergence's module call (or of a module inside it);
        None when there is none or no run has op records."""
        return None if self.operations is None else self.operations.first

    def first_divergence_kind(self) -> DivergenceKind | None:
        """What kind of divergence the first one is (``divergence_kind``), from the phases of its step."""
        first = self.first_divergence
        if first is None:
            return None
        phases = list(self.records.labels[0])
        recorded: set[str] = set()
        differing: set[str] = set()
        for _, chunk in self.records.chunks():
            if first.step not in chunk.summary().steps:
                continue
            at_step = np.asarray(chunk.step) == first.step
            if at_step.any():
                recorded |= {phases[code] for code in np.unique(chunk.phase[at_step]).tolist()}
                differing |= {phases[code] for code in np.unique(chunk.phase[at_step & chunk.diverged]).tolist()}
        base_steps, other_steps = self.base_steps, self.other_steps
        for rank, step, phase, _ in (*self.only_in_base, *self.only_in_other):
            if step == first.step:
                recorded.add(phase)
                if step in base_steps.get(rank, ()) and step in other_steps.get(rank, ()):
                    differing.add(phase)  # a record missing in a step both runs finished
        return divergence_kind(first, recorded=recorded, differing=differing)

    def to_json(self) -> dict[str, Any]:
        """The JSON document of docs/compare.md (strict JSON: non-finite numbers become strings)."""
        config = self.config
        return {
            "format": JSON_FORMAT,
            "version": JSON_VERSION,
            "base": self.base,
            "other": self.other,
            "noise": self.noise,
            "tolerance": tolerance_json(config),
            "filters": {"steps": sorted(config.steps) if config.steps is not None else None,
                        "names": list(config.names)},
            "options": {"strict_zero_grads": config.strict_zero_grads, "fuzzy": config.fuzzy, "exact": config.exact,
                        "ranks": config.ranks, "phases": None if config.phases is None else list(config.phases)},
            "verdict": "agree" if self.agrees else "diverged",
            "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
            "first_divergence_kind": kind.to_json() if (kind := self.first_divergence_kind()) else None,
            **({"bytes": BIT_IDENTICAL if self.agrees else BYTES_DIFFER} if config.exact else {}),
            **({"per_rank": {str(rank): None if first is None else first.to_json()
                             for rank, first in self.per_rank().items()}} if config.ranks else {}),
            "noise_floor": None if self.noise_floor is None else self.noise_floor.to_json(),
            "counts": {"matched": self.matched, "diverged": self.diverged_count,
                       "only_in_base": len(self.only_in_base), "only_in_other": len(self.only_in_other),
                       "noise_unmatched": self.noise_unmatched, "zero_grads": len(self.zero_grads)},
            "steps": {"base": {str(r): s for r, s in self.base_steps.items()},
                      "other": {str(r): s for r, s in self.other_steps.items()},
                      "only_in_base": self.steps_only_in_base, "only_in_other": self.steps_only_in_other,
                      "unfinished": {side: {str(r): s for r, s in ranks.items()}
                                     for side, ranks in self.unfinished.items()}},
            "only_in_base": [key_json(key) for key in self.only_in_base],
            "only_in_other": [key_json(key) for key in self.only_in_other],
            "zero_grads": [{**key_json(key), "present_in": side, "note": ZERO_GRAD_NOTE}
                           for key, side in self.zero_grads],
            "first_nonfinite": {side: anomaly.to_json() if anomaly else None
                                for side, anomaly in self.first_nonfinite.items()},
            "renamed": [rename.to_json() for rename in self.renamed],
            "damaged": {side: [item.to_json() for item in self.damaged.get(side, [])]
                        for side in ("base", "other", *(("noise",) if self.noise is not None else ()))},
            "per_step": [summary.to_json() for summary in self.per_step()],
            "divergences": [record.to_json() for record in self.records.at(self.records.diverged_rows())],
            **({"operations": self.operations.to_json()} if self.operations is not None else {}),
        }


def tolerance_json(config: CompareConfig) -> dict[str, Any]:
    """The report's ``tolerance``: the fixed rule's rtol and atol when given, else null and the per-dtype defaults."""
    found: dict[str, Any] = {"rtol": None, "atol": None, "noise_factor": config.noise_factor}
    if config.fixed is not None:
        found["rtol"], found["atol"] = config.fixed
        return found
    found["per_dtype"] = {name: {"rtol": p.rtol, "mtol": p.mtol, "tiny": p.tiny} for name, p in PRECISIONS.items()}
    return found


def _all_steps(steps: Mapping[int, list[int]]) -> set[int]:
    return {step for by_rank in steps.values() for step in by_rank}
