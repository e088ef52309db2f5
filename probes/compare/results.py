"""The result model of a comparison: the Report ``compare_dumps`` returns and what it is made of, and its JSON.

    report.agrees; report.first_divergence; report.per_step()
    record.diverged; record.worst; record.divergence()       # RecordDiff: one matched record, its MetricDiffs
    str(divergence); divergence.to_json()                   # Divergence: where two runs first differ
    report.first_operation.explained()                      # OpFinding: "local: the operation itself (...)"
    report.first_divergence_kind().sentence                 # "gradients agree, the update differs" (KINDS)
    json.dump(report.to_json(), file)                       # the schema of docs/compare.md

The matched records as arrays are ``recorddiffs.RecordDiffs`` (built on RecordDiff, so not imported here).
Nothing here reads a dump or compares values.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dump.anomaly import Anomaly
from ..dump.record import RecordKey
from ..utils.phases import GRADIENT_PHASES, PHASES, RECOMPUTE, phase_rank
from ..utils.tables import printable
from .options import MOMENTS, PRECISIONS, CompareConfig

__all__ = ["AGREES", "BIT_IDENTICAL", "BYTES_DIFFER", "DIFFERS", "JSON_FORMAT", "JSON_VERSION", "KINDS", "NO_RECORD",
           "UNPAIRED", "ZERO_GRAD_NOTE", "CellView", "Check", "Damaged", "Divergence", "DivergenceKind", "GradNorm",
           "Kind", "MetricDiff", "ModuleOps", "NoiseFloor", "OpFinding", "OpName", "Operations", "RecordDiff", "Rename",
           "Report", "StepSummary", "divergence_kind", "format_value", "is_finite_number", "json_value", "key_json",
           "module_record", "op_name", "relative_name"]

BIT_IDENTICAL, BYTES_DIFFER = "bit-identical", "differs in its bytes"  # an exact comparison's two verdicts
ZERO_GRAD_NOTE = "materialised zero gradient, absent in the other run"


def is_finite_number(value: Any) -> bool:
    """An int or float (never a bool) that is finite: what the tolerance rules measure a distance between."""
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


def key_json(key: RecordKey) -> dict[str, Any]:
    """A record key as the JSON writes it: {"rank", "step", "phase", "name"}."""
    return {"rank": key[0], "step": key[1], "phase": key[2], "name": key[3]}


def json_value(value: Any) -> Any:
    """A value as strict JSON holds it: non-finite floats become "NaN", "Infinity", "-Infinity"; keys strings; a
    result its JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (list, tuple)):
        return [json_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): json_value(item) for key, item in value.items()}
    return value.to_json() if hasattr(value, "to_json") else value


class JsonFields:
    """A result whose JSON is its fields as ``json_value``s: all in order, or those of ``json_fields`` (a class
    attribute); those of ``optional`` only when not None."""

    json_fields: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        names = self.json_fields or [item.name for item in dataclasses.fields(self)]  # type: ignore[arg-type]
        return {name: json_value(getattr(self, name)) for name in names
                if name not in self.optional or getattr(self, name) is not None}


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
class Divergence(JsonFields):
    """Where two runs first differ: a record and the metric that broke, with both values.

    ``metric`` "record" means the record exists in one run only (``base``/``other`` say "present"
    or "missing"). ``noise_floor``: with a calibration run, "beyond" or "within" (``RecordDiff.beyond_noise``).
    """

    json_fields = ("rank", "step", "phase", "name", "seq", "metric", "base", "other", "abs_diff", "rel_diff",
                   "tolerance", "noise_floor")
    optional = ("noise_floor",)

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
    # drift (docs/compare.md, Drift): the largest ratio of its rank's step before, which its difference grew from;
    # None: not drift (within tolerance, or diverged)
    drift: float | None = None

    @property
    def key(self) -> RecordKey:
        return self.rank, self.step, self.phase, self.name

    @property
    def diverged(self) -> bool:
        """A metric is beyond its tolerance, and the record is not drift."""
        return self.drift is None and any(not metric.ok for metric in self.metrics)

    @property
    def worst(self) -> MetricDiff | None:
        """The metric with the largest |diff| / tolerance (the first in check order on ties)."""
        return max(self.metrics, key=lambda metric: metric.ratio, default=None)

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
            "noise": json_value(self.noise),
            "noise_ratio": json_value(self.noise_ratio),
            "noise_floor": None if (beyond := self.beyond_noise) is None else "beyond" if beyond else "within",
            "notes": self.notes,
            "drift": None if self.drift is None else {"carried": json_value(self.drift)},
        }

    def drift_json(self) -> dict[str, Any]:
        """What the report's ``drift`` list says of a drift record: its key, its worst metric and both ratios."""
        worst = self.worst
        return {**key_json(self.key), "seq": self.seq, "metric": worst.metric if worst else None,
                "ratio": json_value(self.ratio), "carried": json_value(self.drift)}


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
class GradNorm(JsonFields):
    """A step's global gradient norm in both runs (None: that run has no grad record with a norm there)."""

    rank: int
    base: float | None
    other: float | None


@dataclass(frozen=True)
class StepSummary:
    step: int
    matched: int
    diverged: int
    only_in_base: int
    only_in_other: int
    worst: RecordDiff | None  # the matched record with the largest ratio in this step
    grad_norm: GradNorm | None = None  # None: neither run has grad records in this step
    drift: int = 0  # records beyond their tolerance that are drift (docs/compare.md, Drift)

    @property
    def differs(self) -> bool:
        """Whether a record of the step diverged or is in one run only."""
        return bool(self.diverged or self.only_in_base or self.only_in_other)

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "step": self.step, "matched": self.matched, "diverged": self.diverged, "drift": self.drift,
            "only_in_base": self.only_in_base, "only_in_other": self.only_in_other,
            "worst": None if worst is None else {
                "rank": worst.rank, "phase": worst.phase, "name": worst.name,
                "metric": worst.worst.metric if worst.worst else None, "ratio": json_value(worst.ratio),
                "rel_error": json_value(worst.rel_error)},
            "global_grad_norm": json_value(self.grad_norm),
        }


@dataclass(frozen=True)
class Rename(JsonFields):
    """A name of OTHER compared as a name of BASE: given by the name map, or paired by fuzzy alignment."""

    phase: str | None  # None: every phase (a name map renames a name wherever it stands)
    other: str
    base: str
    how: str  # "map" or "fuzzy"
    confidence: float  # 1.0 for the map; fuzzy: see probes.compare.operations
    reason: str

    def __str__(self) -> str:
        where = f"{self.phase} " if self.phase else ""
        sure = "" if self.how == "map" else f", confidence {self.confidence:.2f}: {self.reason}"
        return f"{where}{self.other} -> {self.base} ({self.how}{sure})"


@dataclass(frozen=True)
class Damaged(JsonFields):
    """A step file left out of a comparison because it cannot be read (``skip_damaged``)."""

    path: str
    rank: int | None
    step: int
    line: int | None  # 1-based, where the problem is in a JSON Lines file
    problem: str

    def __str__(self) -> str:
        return f"{self.path}{'' if self.line is None else f', line {self.line}'}: {self.problem}"


@dataclass(frozen=True)
class NoiseFloor:
    """With a calibration run: how the matched records stand against their noise floors (``RecordDiff.beyond_noise``).
    Records without a counterpart in the calibration run are in none of its counts (``Report.noise_unmatched``)."""

    beyond: int  # records with a metric beyond its floor
    within: int
    silent: int  # records identical in the calibration run: no noise measured, their tolerance alone
    first_beyond: RecordKey | None  # in execution order
    largest: float | None  # the largest |diff| / noise floor

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
                "first_beyond": None if self.first_beyond is None else key_json(self.first_beyond),
                "largest_ratio": json_value(self.largest)}


# --------------------------------------------------------------------------------------------- operations
# An op record (kind "op") is named ``<module>/<op>:<k>[#<c>].output.<i>``: output i of the k-th call of ``op`` in
# the c-th call (0: the first, not written) of the module in its step. Its ``inputs`` are the record names its
# tensor arguments were ("" where none: a parameter, a constant, a tensor made outside the recorded modules). The
# cause of a diverged operation (``OpFinding.cause``), from the records of its rank and step:
# - forward (and recompute): ``propagated`` when an input's record differs; ``local`` (the operation itself) when
#   none differs and one agrees; ``unknown`` when no input has a record to tell;
# - backward: an output's gradient is computed from the gradients of what took it on (``gradients``: the backward
#   records of the operations that used it, and of the outputs of modules that returned it) at the forward values
#   (``inputs``: the forward records of the same names);
#   ``propagated`` when one of these differs, ``local`` (the backward of the operations that used it) when none
#   does and a gradient it is computed from agrees, ``unknown`` otherwise.
# Differs is weighed, not counted: a record it is computed from carries the difference when its |diff| / tolerance
# or its difference relative to its magnitude is at least 1 / ``JUMP`` of the operation's own (an operation
# amplifies what its inputs carry; a bug jumps by orders of magnitude), whether or not it is beyond its own
# tolerance; ``local`` needs every recorded one below in both.
# ``operations`` computes the findings of a window.

AGREES, DIFFERS, NO_RECORD = "agrees", "differs", "no record"  # what a record looked up by name says
# How much larger an operation's |diff| / tolerance must be than that of every record it is computed from for the
# operation itself to be the cause (docs/compare.md, Operations inside a module): an order of magnitude.
JUMP = 10.0
LOCAL, PROPAGATED, UNKNOWN = "local", "propagated", "unknown"  # the cause of an operation's divergence

_EXPLAINED = {  # OpFinding.explained of a cause other than propagated, by (cause, backward)
    (LOCAL, False): "local: the operation itself (every recorded input agrees{without})",
    (LOCAL, True): "local: the backward of the operations that used it (the gradients it is computed from and the "
                   "forward values agree{without})",
    (UNKNOWN, False): "unknown: no input of it has a record to tell a local error from a propagated one",
    (UNKNOWN, True): "unknown: no gradient it is computed from has a record (no recorded operation or module output "
                     "took this output on) to tell a local error from a propagated one"}

# An op record of OTHER whose name a paired record took (op alignment, ``operations``) is listed with this suffix.
UNPAIRED = " (unpaired)"
_OP = re.compile(r"^(?P<module>.+)/(?P<op>[^/:#.]+):(?P<index>\d+)(?:#(?P<call>\d+))?\.output\.(?P<output>\d+)"
                 r"(?P<unpaired> \(unpaired\))?$")
_MODULE = re.compile(r"^(?P<module>.+?)(?:#(?P<call>\d+))?\.(?:input|output)\.\d+$")


@dataclass(frozen=True)
class OpName:
    """An op record's name taken apart (``op_name``)."""

    module: str
    call: int  # the module's call in its step (0: the first)
    op: str
    index: int  # the k-th call of ``op`` in that call of the module
    output: int  # the op's output tensor
    unpaired: bool = False  # OTHER's record that kept its name while a paired record took it (``UNPAIRED``)

    @property
    def short(self) -> str:
        """The name below its module: ``einsum:2.output.0`` (``einsum:2#1.output.0`` in the module's second call)."""
        return (f"{self.op}:{self.index}{f'#{self.call}' if self.call else ''}.output.{self.output}"
                + (UNPAIRED if self.unpaired else ""))

    @property
    def site(self) -> tuple[str, int]:
        """(module, call): the module call the operation ran in."""
        return self.module, self.call


def op_name(name: str) -> OpName | None:
    """``name`` taken apart when it is an op record's, else None."""
    found = _OP.match(name)
    if found is None:
        return None
    return OpName(found["module"], int(found["call"] or 0), found["op"], int(found["index"]), int(found["output"]),
                  found["unpaired"] is not None)


def module_record(name: str) -> tuple[str, int] | None:
    """(module, call) of a module's input or output record (``blocks.0.attn#1.output.0``), else None."""
    if op_name(name) is not None:
        return None
    found = _MODULE.match(name)
    return None if found is None else (found["module"], int(found["call"] or 0))


def relative_name(name: str, module: str) -> str:
    """``name`` as it reads under ``module``: an operation of that module by its short name (``einsum:2.output.0``),
    any other record in full."""
    found = op_name(name)
    return found.short if found is not None and found.module == module else name


@dataclass(frozen=True)
class Check(JsonFields):
    """What one record, looked up by its name in the same rank and step, says: it agrees, it differs, or there is
    none. ``metric``, ``ratio``: the metric that broke and its |diff| / tolerance (``record``, inf: the record is in
    one run only); ``note``: why there is no record, or which run has it; ``rel_error``: its difference relative to
    its magnitude (``RecordDiff.rel_error``; None: in one run only, or no record)."""

    optional = ("rel_error",)
    name: str
    phase: str
    status: str  # AGREES, DIFFERS or NO_RECORD
    metric: str | None = None
    ratio: float | None = None
    note: str = ""
    rel_error: float | None = None

    def describe(self, module: str = "", own: bool = False) -> str:
        """``"linear:0.output.0 differs (mean, ratio 12)"``; names of ``module``'s operations short, and with ``own``
        (the module's own records) the module's name left out (``output.0``)."""
        if not self.name:
            return f"{self.status} ({self.note})" if self.note else self.status
        name = relative_name(self.name, module)
        if own and module_record(self.name) is not None and self.name.startswith(module):
            name = self.name[len(module):].lstrip(".")
        finite = self.ratio is not None and math.isfinite(self.ratio)
        broke = [self.metric, f"ratio {self.ratio:.3g}" if finite else None] if self.status == DIFFERS else []
        detail = ", ".join(part for part in (*broke, self.note) if part)
        return f"{name} {self.status}" + (f" ({detail})" if detail else "")


@dataclass(frozen=True)
class OpFinding:
    """A diverged operation's record: where it is, what broke, and what its inputs' records say.

    ``inputs``: per tensor argument, in order, its forward record (for a backward record too: the forward values
    its gradient is computed at); ``gradients``: backward records only, the backward records of what took this
    output on (its gradient is computed from theirs): the operations that used it, and the output records of the
    modules that returned it (later records of the same values), in forward order. ``reads_nothing``: the run
    recorded that it takes no tensor (a constant or a random draw made in the module; a compiled run records no
    inputs at all, so it never says this). ``rel_error``: its own ``RecordDiff.rel_error`` (None: in one run only).
    """

    rank: int
    step: int
    phase: str
    name: str
    seq: int
    metric: str
    ratio: float
    inputs: tuple[Check, ...]
    gradients: tuple[Check, ...] = ()
    reads_nothing: bool = False
    rel_error: float | None = None

    @property
    def parsed(self) -> OpName:
        found = op_name(self.name)
        assert found is not None
        return found

    @property
    def key(self) -> tuple[int, int, str, str]:
        return self.rank, self.step, self.phase, self.name

    @property
    def differing(self) -> list[Check]:
        """The records it is computed from that already carry its difference: beyond their tolerance, or within it
        by less than ``JUMP`` times less than this operation, in ratio or in relative difference (an amplified
        difference, not a jump)."""
        return [check for check in (*self.inputs, *self.gradients) if self._carries(check)]

    def _carries(self, check: Check) -> bool:
        if check.status == NO_RECORD or check.ratio is None:
            return False
        if check.status == DIFFERS and not (math.isfinite(self.ratio) and math.isfinite(check.ratio)):
            return True
        return check.ratio * JUMP >= self.ratio or self._relatively(check)

    def _relatively(self, check: Check) -> bool:
        """Whether ``check`` differs, relative to its magnitude, by at least 1 / ``JUMP`` of this operation: ratios
        alone cannot weigh every pair (a tolerance depends on the metric and on the tensor's size: a scalar divisor's
        1% is ratio 99, the division's 1% ratio 1000), relative differences can."""
        return (check.rel_error is not None and self.rel_error is not None and check.rel_error > 0
                and check.rel_error * JUMP >= self.rel_error)

    def sources(self) -> list[tuple[str, Check]]:
        """The records it is computed from, labelled as the reports list them ("input 0", "gradient from")."""
        return [*((f"input {position}", check) for position, check in enumerate(self.inputs)),
                *(("gradient from", check) for check in self.gradients)]

    @property
    def cause(self) -> str:
        """``propagated``, ``local`` or ``unknown`` (the comment that opens the operations above)."""
        if self.differing:
            return PROPAGATED
        backward = self.phase in GRADIENT_PHASES
        if self.reads_nothing and not backward:  # made here from no tensor: nothing can have brought the difference
            return LOCAL
        sources = self.gradients if backward else self.inputs
        return LOCAL if any(check.status != NO_RECORD for check in sources) else UNKNOWN

    def explained(self) -> str:
        """The cause in words, e.g. ``"propagated: an input already differs: linear:0.output.0"``."""
        backward = self.phase in GRADIENT_PHASES
        cause = self.cause
        if cause == PROPAGATED:
            said = []
            for checks, what in ((self.inputs, ("an input's forward value", "inputs' forward values") if backward
                                  else ("an input", "inputs")),
                                 (self.gradients, ("a gradient it is computed from", "gradients it is computed from"))):
                carried = [check for check in checks if self._carries(check)]
                names = [relative_name(check.name, self.parsed.module) for check in carried
                         if check.status == DIFFERS]
                if names:
                    one = len(names) == 1
                    said.append(f"{what[not one]} already {'differs' if one else 'differ'}: {', '.join(names)}")
                names = [f"{relative_name(check.name, self.parsed.module)} ({self._weighed(check)})"
                         for check in carried if check.status != DIFFERS]
                if names:
                    one = len(names) == 1
                    said.append(f"{what[not one]} within tolerance already {'carries' if one else 'carry'} a "
                                f"difference within {JUMP:g}x of its ratio {self.ratio:.3g}: {', '.join(names)}")
            return "propagated: " + "; ".join(said)
        unrecorded = sum(check.status == NO_RECORD for check in self.inputs)
        without = f"; {unrecorded} {'input has' if unrecorded == 1 else 'inputs have'} no record" if unrecorded else ""
        beyond = [check.ratio for check in (*self.inputs, *self.gradients) if check.status == DIFFERS]
        if cause == LOCAL and beyond:  # sources beyond their tolerance, but far below this operation's jump
            what = ("the backward of the operations that used it (the records it is computed from differ"
                    if backward else "the operation itself (its recorded inputs differ")
            return (f"local: {what} by at most ratio {max(beyond):.3g}, over {JUMP:g}x below its {self.ratio:.3g}"
                    f"{without})")
        if cause == LOCAL and self.reads_nothing and not backward:
            return "local: the operation itself (it reads no tensor: a constant or a random draw made here)"
        return _EXPLAINED[cause, backward].format(without=without)

    def _weighed(self, check: Check) -> str:
        """How a source within tolerance carries this operation's difference: ``"ratio 0.9"``, or its relative
        difference where only that is within ``JUMP`` of this operation's."""
        if check.ratio is not None and check.ratio * JUMP >= self.ratio:
            return f"ratio {check.ratio:.3g}"
        return f"relative difference {check.rel_error:.3g}, its own {self.rel_error:.3g}"

    def to_json(self) -> dict[str, Any]:
        parsed = self.parsed
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "name": self.name, "seq": self.seq,
                "module": parsed.module, "call": parsed.call, "op": parsed.op, "index": parsed.index,
                "output": parsed.output, "metric": self.metric, "ratio": json_value(self.ratio),
                "rel_error": json_value(self.rel_error),
                "cause": self.cause, "explanation": self.explained(),
                "inputs": json_value(self.inputs), "gradients": json_value(self.gradients)}


@dataclass(frozen=True)
class ModuleOps(JsonFields):
    """One call of one module (rank, step, phase) with diverged operations: its own records, then those operations
    in execution order. How the reports nest op records under their module."""

    rank: int
    step: int
    phase: str
    module: str
    call: int
    records: tuple[Check, ...]  # the module's own input and output records of this call, in execution order
    ops: tuple[OpFinding, ...]

    @property
    def label(self) -> str:
        return f"{self.module}{f'#{self.call}' if self.call else ''}"

    def own(self) -> str:
        """Its own records in a line: ``"input.0 agrees, output.0 differs (std, ratio 4)"``."""
        return ", ".join(check.describe(self.module, own=True) for check in self.records) or "no record of its own"


@dataclass
class Operations(JsonFields):
    """What a comparison says of op records, when a run has them (``Report.operations``; None when neither has)."""

    matched: int = 0  # op records matched
    diverged: int = 0
    # the module calls with diverged operations (matched, or in one run only in a step both finished), in execution
    # order of their first
    modules: list[ModuleOps] = field(default_factory=list)
    first: OpFinding | None = None  # the first diverging operation (``Report.first_operation``)
    # when the first divergence is a module's record: how many op records that module call has in the phase
    inside_first: int | None = None
    json_fields = ("matched", "diverged", "first", "inside_first", "modules")

    @classmethod
    def merged(cls, parts: "list[Operations]", first: "Operations | None") -> "Operations":
        """The operations of records compared in parts (windows, in execution order); ``first``: the part with the
        first divergence."""
        return cls(sum(part.matched for part in parts), sum(part.diverged for part in parts),
                   [group for part in parts for group in part.modules],
                   None if first is None else first.first, None if first is None else first.inside_first)

    def first_line(self, divergence_name: str) -> str | None:
        """The first diverging operation in a sentence, relative to the first divergence (named
        ``divergence_name``); None when there is nothing to say."""
        first = self.first
        if first is None:
            if self.inside_first:
                return (f"its {self.inside_first} recorded operations agree: the difference is in what op records "
                        "leave out (views, indexing, in-place calls) or in the module's own output")
            return None
        if first.name == divergence_name:
            return first.explained()
        return (f"first diverging operation inside: {first.name} ({first.metric}, ratio {first.ratio:.3g}); "
                f"{first.explained()}")


# --------------------------------------------------------------------------------------------- the report
# The kind of a first divergence is its phase: every record of the phases before it in that step agrees, on every
# rank. "Agree" is said only of phases the step recorded; the earlier ones it did not record are named ("backward
# not recorded"): nothing is known of them.

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
class DivergenceKind(JsonFields):
    """The kind of a report's first divergence, and what it was decided from (phases of the diverging step)."""

    code: str
    phase: str
    sentence: str
    recorded: tuple[str, ...]  # the phases the step holds records of, in either run
    differing: tuple[str, ...]  # the phases with a divergence in the step


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
    records: RecordDiffs  # recorddiffs.RecordDiffs: the matched records, in execution order
    only_in_base: list[RecordKey]
    only_in_other: list[RecordKey]
    base_steps: dict[int, list[int]]  # rank -> finished steps compared
    other_steps: dict[int, list[int]]
    unfinished: dict[str, dict[int, list[int]]]  # "base"/"other" -> rank -> unfinished steps (not read)
    first_divergence: Divergence | None = None
    noise_unmatched: int = 0  # matched records without a counterpart in the noise run
    # (key, the run that has it) of each gradient exactly zero in one run and absent in the other, in execution
    # order; not in only_in_base/only_in_other. Empty with strict_zero_grads.
    zero_grads: list[tuple[RecordKey, str]] = field(default_factory=list)
    # run -> its first record holding nan or inf (execution order, across ranks), or None
    first_nonfinite: dict[str, Anomaly | None] = field(default_factory=dict)
    renamed: list[Rename] = field(default_factory=list)  # OTHER's names compared as BASE's, in BASE's order
    # run -> step files left out as unreadable (skip_damaged); a step damaged in one run is left out of both
    damaged: dict[str, list[Damaged]] = field(default_factory=dict)
    # run -> (rank, step) -> the step's global gradient norm (of the grad records compared, in file order)
    grad_norms: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    noise_floor: NoiseFloor | None = None  # None without a calibration run
    operations: Operations | None = None  # None when neither run has op records

    @property
    def matched(self) -> int:
        return len(self.records)

    @property
    def diverged_count(self) -> int:
        """How many matched records diverged."""
        return len(self.records.diverged_rows())

    @property
    def drift_count(self) -> int:
        """How many matched records are drift (beyond their tolerance, grown from the step before: not diverged)."""
        return len(self.records.drift_rows())

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
        drift: Counter[int] = Counter()
        worst: dict[int, tuple[float, int]] = {}  # step -> (ratio, row) of its worst record so far
        for offset, chunk in self.records.chunks():  # a part's counts and worst, merged in execution order
            part = chunk.summary()
            for key, count, bad, grown, row, ratio in zip(part.steps.tolist(), part.matched.tolist(),
                                                          part.diverged.tolist(), part.drifted.tolist(),
                                                          part.worst_rows.tolist(), part.worst_ratios.tolist()):
                matched[key] += count
                diverged[key] += bad
                drift[key] += grown
                if key not in worst or ratio > worst[key][0] or (math.isnan(worst[key][0]) and not math.isnan(ratio)):
                    worst[key] = (ratio, offset + row)
        steps = sorted(_all_steps(self.base_steps) | _all_steps(self.other_steps) | set(matched))
        rows = [row for _, row in worst.values()]
        records = dict(zip(worst, self.records.at(rows)))
        only_base = Counter(key[1] for key in self.only_in_base)
        only_other = Counter(key[1] for key in self.only_in_other)
        norms = self._grad_norms()
        return [StepSummary(step, matched[step], diverged[step], only_base[step], only_other[step], records.get(step),
                            norms.get(step), drift[step])
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
        else the earliest diverged operation of the first divergence's module call (or of a module inside it)."""
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
            "options": {"strict_zero_grads": config.strict_zero_grads, "strict_drift": config.strict_drift,
                        "drift": config.drifts, "fuzzy": config.fuzzy, "exact": config.exact,
                        "ranks": config.ranks, "phases": None if config.phases is None else list(config.phases)},
            "verdict": "agree" if self.agrees else "diverged",
            "first_divergence": json_value(self.first_divergence),
            "first_divergence_kind": json_value(self.first_divergence_kind()),
            **({"bytes": BIT_IDENTICAL if self.agrees else BYTES_DIFFER} if config.exact else {}),
            **({"per_rank": json_value(self.per_rank())} if config.ranks else {}),
            "noise_floor": json_value(self.noise_floor),
            "counts": {"matched": self.matched, "diverged": self.diverged_count, "drift": self.drift_count,
                       "only_in_base": len(self.only_in_base), "only_in_other": len(self.only_in_other),
                       "noise_unmatched": self.noise_unmatched, "zero_grads": len(self.zero_grads)},
            "steps": {"base": json_value(self.base_steps), "other": json_value(self.other_steps),
                      "only_in_base": self.steps_only_in_base, "only_in_other": self.steps_only_in_other,
                      "unfinished": json_value(self.unfinished)},
            "only_in_base": [key_json(key) for key in self.only_in_base],
            "only_in_other": [key_json(key) for key in self.only_in_other],
            "zero_grads": [{**key_json(key), "present_in": side, "note": ZERO_GRAD_NOTE}
                           for key, side in self.zero_grads],
            "first_nonfinite": json_value(self.first_nonfinite),
            "renamed": json_value(self.renamed),
            "damaged": {side: json_value(self.damaged.get(side, []))
                        for side in ("base", "other", *(("noise",) if self.noise is not None else ()))},
            "per_step": json_value(self.per_step()),
            "divergences": json_value(self.records.at(self.records.diverged_rows())),
            "drift": [record.drift_json() for record in self.records.at(self.records.drift_rows())],
            **({"operations": json_value(self.operations)} if self.operations is not None else {}),
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
