"""What a comparison finds, record by record: the differences of one record, the first divergence, a rename.

    record.diverged; record.worst; record.divergence()       # RecordDiff: one matched record, its MetricDiffs
    str(divergence); divergence.to_json()                   # Divergence: where two runs first differ
    CellView.of(record)                                     # what a plot shows of one record

The matched records as arrays are ``matched`` (RecordDiffs), the whole report ``report`` (Report).
Nothing here reads a dump or compares values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

from ..dump.record import RecordKey
from .config import MOMENTS
from .values import format_value, is_finite_number, json_value

BIT_IDENTICAL, BYTES_DIFFER = "bit-identical", "differs in its bytes"  # an exact comparison's two verdicts

__all__ = ["BIT_IDENTICAL", "BYTES_DIFFER", "ZERO_GRAD_NOTE", "CellView", "Damaged", "Divergence", "GradNorm", "MetricDiff",
           "NoiseFloor", "RecordDiff", "Rename", "StepSummary"]

ZERO_GRAD_NOTE = "materialised zero gradient, absent in the other run"


@dataclass(frozen=True)
class MetricDiff:
    """One compared quantity of one record: a structural field, a count, a moment or the samples.

    Structural fields and counts must be equal (tolerance 0). For "samples" the values are those of
    the worst sample (largest |diff| / tolerance) and ``index`` is its flat index in the tensor.
    ``floor``: with a calibration run, the metric's noise floor (noise_factor x its noise level; the
    tolerance is at least this), None without one.
    """

    metric: str
    base: Any
    other: Any
    abs_diff: float
    rel_diff: float
    tolerance: float
    index: int | None = None
    floor: float | None = None

    @property
    def ok(self) -> bool:
        return self.abs_diff <= self.tolerance

    @property
    def ratio(self) -> float:
        """|diff| / tolerance: above 1 means the metric broke."""
        if self.abs_diff == 0:
            return 0.0
        return self.abs_diff / self.tolerance if self.tolerance > 0 else math.inf


@dataclass(frozen=True)
class Divergence:
    """Where two runs first differ: a record and the metric that broke, with both values.

    ``metric`` "record" means the record exists in one run only (``base``/``other`` say "present"
    or "missing"). ``noise_floor``: with a calibration run, "beyond" or "within" (``RecordDiff.beyond_noise``).
    """

    rank: int
    step: int
    phase: str
    name: str
    metric: str
    base: Any
    other: Any
    seq: int | None = None
    abs_diff: float | None = None
    rel_diff: float | None = None
    tolerance: float | None = None
    noise_floor: str | None = None

    def __str__(self) -> str:
        if self.metric == "hash":
            return (f"rank {self.rank} step {self.step} {self.phase} {self.name}: differs in its bytes "
                    f"(hash {self.base} (base) vs {self.other} (other))")
        text = (f"rank {self.rank} step {self.step} {self.phase} {self.name}: "
                f"{self.metric} {format_value(self.base)} (base) vs {format_value(self.other)} (other)")
        if self.abs_diff is not None and self.tolerance is not None and math.isfinite(self.abs_diff):
            text += f", |diff| {format_value(self.abs_diff)} > tolerance {format_value(self.tolerance)}"
        if self.noise_floor is not None:
            text += f", {self.noise_floor} the noise floor"
        return text

    def to_json(self) -> dict[str, Any]:
        found = {key: json_value(getattr(self, key)) for key in (
            "rank", "step", "phase", "name", "seq", "metric", "base", "other", "abs_diff", "rel_diff", "tolerance")}
        if self.noise_floor is not None:
            found["noise_floor"] = self.noise_floor
        return found


@dataclass
class RecordDiff:
    """The comparison of one matched record."""

    rank: int
    step: int
    phase: str
    name: str
    seq: int  # the base run's execution sequence number
    metrics: list[MetricDiff]  # structure, counts, moments, then the worst sample
    samples_compared: int = 0
    samples_max_abs: float | None = None
    samples_cosine: float | None = None
    # this record's noise level per statistic (metrics.NOISED; None: no calibration run, or no counterpart in it)
    noise: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> RecordKey:
        return self.rank, self.step, self.phase, self.name

    @property
    def diverged(self) -> bool:
        return any(not metric.ok for metric in self.metrics)

    @property
    def worst(self) -> MetricDiff | None:
        """The metric with the largest |diff| / tolerance (the first in check order on ties)."""
        worst = None
        for metric in self.metrics:
            if worst is None or metric.ratio > worst.ratio:
                worst = metric
        return worst

    @property
    def ratio(self) -> float:
        worst = self.worst
        return worst.ratio if worst is not None else 0.0

    @property
    def rel_error(self) -> float:
        """The largest |other - base| among min, max, mean and std, relative to the record's magnitude.

        The magnitude is max(|value|, |min|, |max|) of the base run, so a mean or std near zero (a
        normalised activation, a gradient) does not turn a rounding difference into a huge relative error.
        """
        moments = [m for m in self.metrics if m.metric in MOMENTS]
        scale = max((abs(m.base) for m in moments if m.metric in ("min", "max") and is_finite_number(m.base)),
                    default=0.0)
        error = 0.0
        for m in moments:
            if m.abs_diff == 0:
                continue
            magnitude = max(abs(m.base) if is_finite_number(m.base) else 0.0, scale)
            error = max(error, m.abs_diff / magnitude if magnitude > 0 else math.inf)
        return error

    def value(self, run: str, metric: str) -> Any:
        """The base ("base") or other ("other") value of a metric, None when it was not compared."""
        for item in self.metrics:
            if item.metric == metric:
                return item.base if run == "base" else item.other
        return None

    @property
    def noise_ratio(self) -> float | None:
        """|diff| / noise floor, the largest over the metrics with a floor (the samples: their largest |diff|; 0
        when none differs); inf when a structure field or count differs; None when calibration measured nothing
        here (no calibration run, no counterpart in it, or a counterpart identical to the base)."""
        if self.noise is None or not any(level > 0 for level in self.noise.values()):
            return None
        found = 0.0
        for metric in self.metrics:
            if metric.floor is None:
                if not metric.ok:  # a structure or count: no noise explains it
                    return math.inf
                continue
            diff = metric.abs_diff
            if metric.metric == "samples" and self.samples_max_abs is not None:
                diff = max(diff, float(self.samples_max_abs))
            found = max(found, 0.0 if diff == 0 else diff / metric.floor if metric.floor > 0 else math.inf)
        return found

    @property
    def beyond_noise(self) -> bool | None:
        """Whether some metric differs by more than its noise floor (None: calibration measured nothing here)."""
        ratio = self.noise_ratio
        return None if ratio is None else ratio > 1

    def divergence(self) -> Divergence:
        worst = self.worst
        assert worst is not None
        beyond = self.beyond_noise
        return Divergence(self.rank, self.step, self.phase, self.name, worst.metric, worst.base, worst.other,
                          self.seq, worst.abs_diff, worst.rel_diff, worst.tolerance,
                          None if beyond is None else "beyond" if beyond else "within")

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "rank": self.rank, "step": self.step, "phase": self.phase, "name": self.name, "seq": self.seq,
            "diverged": self.diverged,
            "metric": worst.metric if worst else None,
            "ratio": json_value(self.ratio),
            "metrics": {m.metric: {"base": json_value(m.base), "other": json_value(m.other),
                                   "abs_diff": json_value(m.abs_diff), "rel_diff": json_value(m.rel_diff),
                                   "tolerance": json_value(m.tolerance), "ok": m.ok,
                                   **({"index": m.index} if m.index is not None else {}),
                                   **({"noise_floor": json_value(m.floor)} if m.floor is not None else {})}
                        for m in self.metrics},
            "samples": {"compared": self.samples_compared, "max_abs_diff": json_value(self.samples_max_abs),
                        "cosine": json_value(self.samples_cosine)},
            "noise": None if self.noise is None else {name: json_value(level) for name, level in self.noise.items()},
            "noise_ratio": json_value(self.noise_ratio),
            "noise_floor": None if (beyond := self.beyond_noise) is None else "beyond" if beyond else "within",
            "notes": self.notes,
        }


@dataclass(frozen=True)
class CellView:
    """What a plot shows of one matched record: its verdict and its worst metric (``RecordDiffs.views``)."""

    rel_error: float
    diverged: bool
    ratio: float
    metric: str | None  # the worst metric (None: nothing was compared)
    base: Any
    other: Any

    @classmethod
    def of(cls, record: RecordDiff) -> "CellView":
        worst = record.worst
        return cls(record.rel_error, record.diverged, record.ratio, worst.metric if worst else None,
                   worst.base if worst else None, worst.other if worst else None)



@dataclass(frozen=True)
class GradNorm:
    """A step's global gradient norm in both runs (None: that run has no grad record with a norm there)."""

    rank: int
    base: float | None
    other: float | None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "base": json_value(self.base), "other": json_value(self.other)}


@dataclass(frozen=True)
class StepSummary:
    step: int
    matched: int
    diverged: int
    only_in_base: int
    only_in_other: int
    worst: RecordDiff | None  # the matched record with the largest ratio in this step
    grad_norm: GradNorm | None = None  # None: neither run has grad records in this step

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "step": self.step, "matched": self.matched, "diverged": self.diverged,
            "only_in_base": self.only_in_base, "only_in_other": self.only_in_other,
            "worst": None if worst is None else {
                "rank": worst.rank, "phase": worst.phase, "name": worst.name,
                "metric": worst.worst.metric if worst.worst else None, "ratio": json_value(worst.ratio),
                "rel_error": json_value(worst.rel_error)},
            "global_grad_norm": None if self.grad_norm is None else self.grad_norm.to_json(),
        }


@dataclass(frozen=True)
class Rename:
    """A name of OTHER compared as a name of BASE: given by the name map, or paired by fuzzy alignment."""

    phase: str | None  # None: every phase (a name map renames a name wherever it stands)
    other: str
    base: str
    how: str  # "map" or "fuzzy"
    confidence: float  # 1.0 for the map; fuzzy: see probes.compare.align
    reason: str

    def __str__(self) -> str:
        where = f"{self.phase} " if self.phase else ""
        sure = "" if self.how == "map" else f", confidence {self.confidence:.2f}: {self.reason}"
        return f"{where}{self.other} -> {self.base} ({self.how}{sure})"

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "other": self.other, "base": self.base, "how": self.how,
                "confidence": self.confidence, "reason": self.reason}



@dataclass(frozen=True)
class Damaged:
    """A step file left out of a comparison because it cannot be read (``skip_damaged``)."""

    path: str
    rank: int | None
    step: int
    line: int | None  # 1-based, where the problem is in a JSON Lines file
    problem: str

    def __str__(self) -> str:
        return f"{self.path}{'' if self.line is None else f', line {self.line}'}: {self.problem}"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "rank": self.rank, "step": self.step, "line": self.line, "problem": self.problem}



@dataclass(frozen=True)
class NoiseFloor:
    """With a calibration run: how the matched records stand against their noise floors (``RecordDiff.beyond_noise``).

    ``beyond``/``within``: records with / without a metric beyond its floor; ``silent``: records whose calibration
    run is identical to the base (no noise measured: their tolerance is the default or given one alone); ``first_beyond``: the first
    record beyond it in execution order; ``largest``: the largest |diff| / noise floor. Records without a
    counterpart in the calibration run are in none of these (``Report.noise_unmatched``).
    """

    beyond: int
    within: int
    silent: int
    first_beyond: RecordKey | None
    largest: float | None

    @classmethod
    def merged(cls, parts: "Sequence[NoiseFloor]") -> "NoiseFloor":
        """The floor of records compared in parts (windows, in execution order)."""
        largest = [part.largest for part in parts if part.largest is not None]
        return cls(sum(part.beyond for part in parts), sum(part.within for part in parts),
                   sum(part.silent for part in parts),
                   next((part.first_beyond for part in parts if part.first_beyond is not None), None),
                   max(largest) if largest else None)

    def to_json(self) -> dict[str, Any]:
        return {"beyond": self.beyond, "within": self.within, "silent": self.silent,
                "first_beyond": None if self.first_beyond is None else dict(zip(("rank", "step", "phase", "name"),
                                                                                 self.first_beyond)),
                "largest_ratio": json_value(self.largest)}
