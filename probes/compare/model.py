"""The result model of a comparison: its configuration, the differences found, the report and its JSON.

    config = CompareConfig(rtol=DEFAULT_RTOL, atol=DEFAULT_ATOL)      # the default tolerances, defined here only
    report.agrees; report.first_divergence; report.to_json()          # Report: what compare_dumps returns

Nothing here reads a dump or compares values (``engine``) or formats a page (``text``, ``html``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from ..dump import Anomaly, RecordKey
from ..dump.record import execution_order
from ..dump.statistics import STATISTICS, names
from ..utils.patterns import check_patterns, name_matcher
from ..utils.phases import GRADIENT_PHASES, phase_rank
from ..utils.tables import printable

__all__ = ["CompareConfig", "Divergence", "MetricDiff", "RecordDiff", "RecordDiffs", "Report", "StepSummary",
           "execution_order"]

STRUCTURE = ("shape", "dtype", "numel")
COUNTS = names(compared="count")  # ("nan", "inf"): exact
MOMENTS = names(compared="moment")  # ("min", "max", "mean", "std", "norm"): within the tolerance
# Moments a dump written before they existed lacks: compared only where both records have a value.
OPTIONAL_MOMENTS = frozenset(stat.name for stat in STATISTICS if stat.optional)
DEFAULT_RTOL, DEFAULT_ATOL, DEFAULT_NOISE_FACTOR = 1e-4, 1e-6, 10.0
ZERO_GRAD_NOTE = "materialised zero gradient, absent in the other run"
JSON_FORMAT = "probes-compare"
JSON_VERSION = 1


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def format_value(value: Any) -> str:
    """A value as the reports print it: None "-", floats to 6 digits, names with control characters escaped."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    return printable(value)


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CompareConfig:
    """Tolerances and filters of a comparison.

    A statistic ``x`` of the base run and ``y`` of the other run agree when
    ``|x - y| <= max(atol + rtol * |x|, noise_factor * noise)``, where ``noise`` is the record's noise
    level measured from a second baseline run (0 without one; see docs/compare.md).
    ``steps``: only these steps (None: all). ``names``: only record names matching one of these patterns (globs, or ``"re:<regex>"``).
    ``strict_zero_grads``: a gradient that is exactly zero in one run and absent in the other counts
    as a record on one side only (a divergence) instead of a note. ``fuzzy``: names found in one run
    only are paired by module class, shape and execution order (``probes.compare.align``).
    """

    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    noise_factor: float = DEFAULT_NOISE_FACTOR
    steps: frozenset[int] | None = None
    names: tuple[str, ...] = ()
    strict_zero_grads: bool = False
    fuzzy: bool = False
    _wants_name: Callable[[str], bool] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_wants_name", name_matcher(check_patterns(self.names or None, "names"), "names"))
        for label in ("rtol", "atol", "noise_factor"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def wants_name(self, name: str) -> bool:
        return self._wants_name(name)

    def tolerance(self, value: Any, noise: float | None) -> float:
        fixed = self.atol + self.rtol * abs(value) if is_finite_number(value) else self.atol
        return max(fixed, self.noise_factor * noise) if noise else fixed


# --------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class MetricDiff:
    """One compared quantity of one record: a structural field, a count, a moment or the samples.

    Structural fields and counts must be equal (tolerance 0). For "samples" the values are those of
    the worst sample (largest |diff| / tolerance) and ``index`` is its flat index in the tensor.
    """

    metric: str
    base: Any
    other: Any
    abs_diff: float
    rel_diff: float
    tolerance: float
    index: int | None = None

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
    or "missing").
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

    def __str__(self) -> str:
        text = (f"rank {self.rank} step {self.step} {self.phase} {self.name}: "
                f"{self.metric} {format_value(self.base)} (base) vs {format_value(self.other)} (other)")
        if self.abs_diff is not None and self.tolerance is not None and math.isfinite(self.abs_diff):
            text += f", |diff| {format_value(self.abs_diff)} > tolerance {format_value(self.tolerance)}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {key: _json_value(getattr(self, key)) for key in (
            "rank", "step", "phase", "name", "seq", "metric", "base", "other", "abs_diff", "rel_diff", "tolerance")}


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
    noise: float | None = None  # this record's noise level (None: no noise run, or no counterpart in it)
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

    def divergence(self) -> Divergence:
        worst = self.worst
        assert worst is not None
        return Divergence(self.rank, self.step, self.phase, self.name, worst.metric, worst.base, worst.other,
                          self.seq, worst.abs_diff, worst.rel_diff, worst.tolerance)

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "rank": self.rank, "step": self.step, "phase": self.phase, "name": self.name, "seq": self.seq,
            "diverged": self.diverged,
            "metric": worst.metric if worst else None,
            "ratio": _json_value(self.ratio),
            "metrics": {m.metric: {"base": _json_value(m.base), "other": _json_value(m.other),
                                   "abs_diff": _json_value(m.abs_diff), "rel_diff": _json_value(m.rel_diff),
                                   "tolerance": _json_value(m.tolerance), "ok": m.ok,
                                   **({"index": m.index} if m.index is not None else {})}
                        for m in self.metrics},
            "samples": {"compared": self.samples_compared, "max_abs_diff": _json_value(self.samples_max_abs),
                        "cosine": _json_value(self.samples_cosine)},
            "noise": _json_value(self.noise),
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


class RecordDiffs(Sequence[RecordDiff]):
    """The matched records of a comparison, in execution order: the verdict of each as arrays, each
    RecordDiff built only when asked for (a comparison of a million records builds the few a report shows).

        records.diverged.sum(); records.ratio.max()          # numpy arrays, one entry per matched record
        records[0]; records.take([3, 7]); list(records)       # RecordDiff objects
    """

    def __init__(self, *, rank: np.ndarray, step: np.ndarray, seq: np.ndarray, phase: np.ndarray, name: np.ndarray,
                 labels: tuple[Sequence[str], Sequence[str]], ratio: np.ndarray, diverged: np.ndarray,
                 rel_error: np.ndarray, build: Callable[[np.ndarray], list[RecordDiff]],
                 worst: tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
                 moments: Mapping[tuple[str, str], np.ndarray] | None = None) -> None:
        self.rank, self.step, self.seq = rank, step, seq
        # (metric names, per record the code of its worst metric, its base and other values, and whether each
        # is None); code 1 means a structure field or count, 0 nothing compared. None: only RecordDiffs know.
        self._worst = worst
        self.moments = moments  # ("base" | "other", moment) -> per record the value, nan where absent
        self.phase, self.name = phase, name  # codes into labels[0] (phases) and labels[1] (names)
        self.labels = labels
        self.ratio, self.diverged, self.rel_error = ratio, diverged, rel_error
        self._build = build
        self._built: dict[int, RecordDiff] = {}

    @classmethod
    def of(cls, records: Sequence[RecordDiff]) -> "RecordDiffs":
        """Arrays for RecordDiff objects already built (a report made by hand)."""
        phases = sorted({r.phase for r in records})
        names = sorted({r.name for r in records})
        phase_code, name_code = {p: i for i, p in enumerate(phases)}, {n: i for i, n in enumerate(names)}
        kept = list(records)
        return cls(rank=np.array([r.rank for r in kept], np.int64), step=np.array([r.step for r in kept], np.int64),
                   seq=np.array([r.seq for r in kept], np.int64),
                   phase=np.array([phase_code[r.phase] for r in kept], np.int64),
                   name=np.array([name_code[r.name] for r in kept], np.int64), labels=(phases, names),
                   ratio=np.array([r.ratio for r in kept], np.float64),
                   diverged=np.array([r.diverged for r in kept], bool),
                   rel_error=np.array([r.rel_error for r in kept], np.float64),
                   build=lambda rows: [kept[row] for row in rows.tolist()])

    def __len__(self) -> int:
        return len(self.ratio)

    @overload
    def __getitem__(self, index: int) -> RecordDiff: ...

    @overload
    def __getitem__(self, index: slice) -> list[RecordDiff]: ...

    def __getitem__(self, index: int | slice) -> RecordDiff | list[RecordDiff]:
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("record index out of range")
        return self.take([index])[0]

    def __iter__(self) -> Iterator[RecordDiff]:
        for start in range(0, len(self), 4096):
            yield from self.take(np.arange(start, min(start + 4096, len(self))))

    def take(self, rows: Sequence[int] | np.ndarray) -> list[RecordDiff]:
        """The RecordDiff objects of ``rows`` (built once, then kept)."""
        rows = [int(row) for row in rows]
        missing = np.array(sorted({row for row in rows if row not in self._built}), np.int64)
        if len(missing):
            self._built.update(zip(missing.tolist(), self._build(missing)))
        return [self._built[row] for row in rows]

    def select(self, mask: np.ndarray) -> list[RecordDiff]:
        return self.take(np.flatnonzero(mask))

    def views(self, rows: Sequence[int] | np.ndarray) -> list[CellView]:
        """What plots show of ``rows``, from the arrays where they say it (records are built for the rest)."""
        rows = np.asarray(rows, np.int64)
        if self._worst is None:
            return [CellView.of(record) for record in self.take(rows)]
        names, codes, base, other, nulls = self._worst
        built = dict(zip(rows[codes[rows] == 1].tolist(), map(CellView.of, self.take(rows[codes[rows] == 1]))))
        return [built[row] if row in built else
                CellView(float(self.rel_error[row]), bool(self.diverged[row]), float(self.ratio[row]),
                         names[codes[row]] or None, None if nulls[row, 0] else float(base[row]),
                         None if nulls[row, 1] else float(other[row]))
                for row in rows.tolist()]

    def value(self, rows: np.ndarray, run: str, metric: str) -> list[Any]:
        """A moment's base ("base") or other ("other") value of ``rows`` (None where it was not compared)."""
        if self.moments is None:
            return [record.value(run, metric) for record in self.take(rows)]
        values = self.moments[(run, metric)][rows]
        return [None if math.isnan(value) else value for value in values.tolist()]

    def phase_name(self, row: int) -> tuple[str, str]:
        return self.labels[0][int(self.phase[row])], self.labels[1][int(self.name[row])]

    def where(self, *, rank: int, step: int, phase: str) -> np.ndarray:
        """The mask of the records of one rank, step and phase."""
        phases = list(self.labels[0])
        code = phases.index(phase) if phase in phases else -1
        return (self.rank == rank) & (self.step == step) & (self.phase == code)

    def worst(self, count: int) -> list[RecordDiff]:
        """The ``count`` records with the largest ratio above 0, largest first (ties: execution order)."""
        rows = np.flatnonzero(self.ratio > 0)
        return self.take(rows[np.argsort(-self.ratio[rows], kind="stable")][:count])


@dataclass(frozen=True)
class StepSummary:
    step: int
    matched: int
    diverged: int
    only_in_base: int
    only_in_other: int
    worst: RecordDiff | None  # the matched record with the largest ratio in this step

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "step": self.step, "matched": self.matched, "diverged": self.diverged,
            "only_in_base": self.only_in_base, "only_in_other": self.only_in_other,
            "worst": None if worst is None else {
                "rank": worst.rank, "phase": worst.phase, "name": worst.name,
                "metric": worst.worst.metric if worst.worst else None, "ratio": _json_value(worst.ratio),
                "rel_error": _json_value(worst.rel_error)},
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

    def __post_init__(self) -> None:
        if not isinstance(self.records, RecordDiffs):
            self.records = RecordDiffs.of(self.records)

    @property
    def matched(self) -> int:
        return len(self.records)

    @property
    def diverged_count(self) -> int:
        """How many matched records diverged."""
        return int(self.records.diverged.sum())

    @property
    def divergences(self) -> list[Divergence]:
        """Every diverged matched record, in execution order."""
        return [record.divergence() for record in self.records.select(self.records.diverged)]

    @property
    def steps_only_in_base(self) -> list[int]:
        return sorted(_all_steps(self.base_steps) - _all_steps(self.other_steps))

    @property
    def steps_only_in_other(self) -> list[int]:
        return sorted(_all_steps(self.other_steps) - _all_steps(self.base_steps))

    @property
    def agrees(self) -> bool:
        """True when every record of both runs is matched and within tolerance."""
        return self.first_divergence is None and not self.only_in_base and not self.only_in_other

    def per_step(self) -> list[StepSummary]:
        """One summary per step of either run (matched, diverged, only in one run, the worst record)."""
        key = (len(self.records), len(self.only_in_base), len(self.only_in_other))
        cached = self.__dict__.get("_per_step")
        if cached is None or cached[0] != key:
            self.__dict__["_per_step"] = cached = (key, self._per_step())
        return list(cached[1])

    def _per_step(self) -> list[StepSummary]:
        records = self.records
        steps = sorted(_all_steps(self.base_steps) | _all_steps(self.other_steps) | set(records.step.tolist()))
        # Per step the first record (execution order) of the largest ratio, as max() over the records would pick.
        by_step = np.lexsort((np.arange(len(records)), -records.ratio, records.step))
        found, first = np.unique(records.step[by_step], return_index=True)
        worst = dict(zip(found.tolist(), records.take(by_step[first])))
        index = np.searchsorted(steps, records.step)
        matched = np.bincount(index, minlength=len(steps))
        diverged = np.bincount(index, weights=records.diverged, minlength=len(steps))
        only_base = Counter(key[1] for key in self.only_in_base)
        only_other = Counter(key[1] for key in self.only_in_other)
        return [StepSummary(step, int(matched[i]), int(diverged[i]), only_base[step], only_other[step], worst.get(step))
                for i, step in enumerate(steps)]

    def to_json(self) -> dict[str, Any]:
        """The JSON document of docs/compare.md (strict JSON: non-finite numbers become strings)."""
        config = self.config
        return {
            "format": JSON_FORMAT,
            "version": JSON_VERSION,
            "base": self.base,
            "other": self.other,
            "noise": self.noise,
            "tolerance": {"rtol": config.rtol, "atol": config.atol, "noise_factor": config.noise_factor},
            "filters": {"steps": sorted(config.steps) if config.steps is not None else None,
                        "names": list(config.names)},
            "options": {"strict_zero_grads": config.strict_zero_grads, "fuzzy": config.fuzzy},
            "verdict": "agree" if self.agrees else "diverged",
            "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
            "counts": {"matched": self.matched, "diverged": self.diverged_count,
                       "only_in_base": len(self.only_in_base), "only_in_other": len(self.only_in_other),
                       "noise_unmatched": self.noise_unmatched, "zero_grads": len(self.zero_grads)},
            "steps": {"base": {str(r): s for r, s in self.base_steps.items()},
                      "other": {str(r): s for r, s in self.other_steps.items()},
                      "only_in_base": self.steps_only_in_base, "only_in_other": self.steps_only_in_other,
                      "unfinished": {side: {str(r): s for r, s in ranks.items()}
                                     for side, ranks in self.unfinished.items()}},
            "only_in_base": [_key_json(key) for key in self.only_in_base],
            "only_in_other": [_key_json(key) for key in self.only_in_other],
            "zero_grads": [{**_key_json(key), "present_in": side, "note": ZERO_GRAD_NOTE}
                           for key, side in self.zero_grads],
            "first_nonfinite": {side: anomaly.to_json() if anomaly else None
                                for side, anomaly in self.first_nonfinite.items()},
            "renamed": [rename.to_json() for rename in self.renamed],
            "per_step": [summary.to_json() for summary in self.per_step()],
            "divergences": [record.to_json() for record in self.records.select(self.records.diverged)],
        }


def _all_steps(steps: Mapping[int, list[int]]) -> set[int]:
    return {step for by_rank in steps.values() for step in by_rank}


def _key_json(key: RecordKey) -> dict[str, Any]:
    return {"rank": key[0], "step": key[1], "phase": key[2], "name": key[3]}


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    return value
