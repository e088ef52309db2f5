"""Compare two statistics dumps: match records, measure their differences, find the first divergence.

    report = compare_dumps("pt_out", "ort_out", rtol=1e-4, atol=1e-6, noise="pt_out2")
    if not report.agrees: print(report.first_divergence)
    python -m probes compare pt_out ort_out [--noise pt_out2] [--json r.json] [--html r.html]

Records are matched by (rank, step, phase, name); records present on one side only are listed,
never dropped. A gradient that is exactly zero everywhere in one run and absent in the other (one
backend materialises the zeros another leaves out) is a note, not a divergence, unless
``strict_zero_grads``. Every matched record is checked statistic by statistic against a tolerance that is
fixed (``atol + rtol * |base|``) or, given a second baseline run, derived from how much the two
baselines differ. The first divergence is searched in execution order: earliest step, then the
forward records in the base run's order (``seq``), then the backward ones, across ranks.
docs/compare.md states the rules, the exit status of the command and the JSON schema.
Dumps still being written by this process are waited for first (``probes.dump.flush_writers``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..dump import MANIFEST_NAME, DumpFormatError, DumpLayout, _list_steps, _load_dump, flush_writers

__all__ = [
    "CompareConfig",
    "Divergence",
    "LoadedDump",
    "MetricDiff",
    "RecordDiff",
    "Report",
    "StepSummary",
    "compare_dumps",
    "compare_loaded",
    "compare_records",
    "format_report",
    "is_zero_gradient",
    "read_dump",
]

Key = tuple[int, int, str, str]  # rank, step, phase, name
STRUCTURE = ("shape", "dtype", "numel")
COUNTS = ("nan", "inf")
MOMENTS = ("min", "max", "mean", "std")
PHASE_ORDER = {"forward": 0, "backward": 1}
GRADIENT_PHASES = frozenset({"backward"})
DEFAULT_RTOL, DEFAULT_ATOL, DEFAULT_NOISE_FACTOR = 1e-4, 1e-6, 10.0
ZERO_GRAD_NOTE = "materialised zero gradient, absent in the other run"
JSON_FORMAT = "probes-compare"
JSON_VERSION = 1
EXIT_AGREE, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CompareConfig:
    """Tolerances and filters of a comparison.

    A statistic ``x`` of the base run and ``y`` of the other run agree when
    ``|x - y| <= max(atol + rtol * |x|, noise_factor * noise)``, where ``noise`` is the record's noise
    level measured from a second baseline run (0 without one; see docs/compare.md).
    ``steps``: only these steps (None: all). ``names``: only record names matching one of these globs.
    ``strict_zero_grads``: a gradient that is exactly zero in one run and absent in the other counts
    as a record on one side only (a divergence) instead of a note.
    """

    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    noise_factor: float = DEFAULT_NOISE_FACTOR
    steps: frozenset[int] | None = None
    names: tuple[str, ...] = ()
    strict_zero_grads: bool = False

    def __post_init__(self) -> None:
        for label in ("rtol", "atol", "noise_factor"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def wants_name(self, name: str) -> bool:
        return not self.names or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names)

    def tolerance(self, value: Any, noise: float | None) -> float:
        fixed = self.atol + self.rtol * abs(value) if _is_finite_number(value) else self.atol
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
                f"{self.metric} {_fmt(self.base)} (base) vs {_fmt(self.other)} (other)")
        if self.abs_diff is not None and self.tolerance is not None and math.isfinite(self.abs_diff):
            text += f", |diff| {_fmt(self.abs_diff)} > tolerance {_fmt(self.tolerance)}"
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
    def key(self) -> Key:
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
        scale = max((abs(m.base) for m in moments if m.metric in ("min", "max") and _is_finite_number(m.base)),
                    default=0.0)
        error = 0.0
        for m in moments:
            if m.abs_diff == 0:
                continue
            magnitude = max(abs(m.base) if _is_finite_number(m.base) else 0.0, scale)
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


@dataclass
class Report:
    """The result of ``compare_dumps``; ``agrees`` is the verdict."""

    base: str
    other: str
    noise: str | None
    config: CompareConfig
    records: list[RecordDiff]  # matched records, in execution order
    only_in_base: list[Key]
    only_in_other: list[Key]
    base_steps: dict[int, list[int]]  # rank -> finished steps compared
    other_steps: dict[int, list[int]]
    unfinished: dict[str, dict[int, list[int]]]  # "base"/"other" -> rank -> unfinished steps (not read)
    first_divergence: Divergence | None = None
    noise_unmatched: int = 0  # matched records without a counterpart in the noise run
    # (key, "base" or "other": the run that has it) of each gradient exactly zero in one run and absent
    # in the other, in execution order; not in only_in_base/only_in_other. Empty with strict_zero_grads.
    zero_grads: list[tuple[Key, str]] = field(default_factory=list)

    @property
    def matched(self) -> int:
        return len(self.records)

    @property
    def divergences(self) -> list[Divergence]:
        """Every diverged matched record, in execution order."""
        return [record.divergence() for record in self.records if record.diverged]

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
        steps = sorted(_all_steps(self.base_steps) | _all_steps(self.other_steps))
        by_step: dict[int, list[RecordDiff]] = {step: [] for step in steps}
        for record in self.records:
            by_step.setdefault(record.step, []).append(record)
        only_base = Counter(key[1] for key in self.only_in_base)
        only_other = Counter(key[1] for key in self.only_in_other)
        summaries = []
        for step, records in sorted(by_step.items()):
            worst = max(records, key=lambda r: r.ratio, default=None)
            summaries.append(StepSummary(step, len(records), sum(r.diverged for r in records),
                                         only_base[step], only_other[step], worst))
        return summaries

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
            "options": {"strict_zero_grads": config.strict_zero_grads},
            "verdict": "agree" if self.agrees else "diverged",
            "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
            "counts": {"matched": self.matched, "diverged": sum(r.diverged for r in self.records),
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
            "per_step": [summary.to_json() for summary in self.per_step()],
            "divergences": [record.to_json() for record in self.records if record.diverged],
        }


def _all_steps(steps: Mapping[int, list[int]]) -> set[int]:
    return {step for by_rank in steps.values() for step in by_rank}


def _key_json(key: Key) -> dict[str, Any]:
    return {"rank": key[0], "step": key[1], "phase": key[2], "name": key[3]}


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    return value


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------------------------- reading


class Progress:
    """Progress lines on stderr for long operations: silent during the first ``delay`` seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, delay: float = 1.0) -> None:
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()
        self.delay = delay
        self._last_print = -math.inf
        self._printed = False

    def update(self, done: int) -> None:
        now = time.monotonic()
        interval = 0.5 if self.stream.isatty() else 5.0  # a log file needs fewer lines than a terminal
        if now - self.started < self.delay or now - self._last_print < interval:
            return
        self._last_print, self._printed = now, True
        self._write(f"{self.label}: {done}/{self.total}")

    def close(self) -> None:
        if self._printed:
            self._write(f"{self.label}: {self.total}/{self.total} done")
            if self.stream.isatty():
                self.stream.write("\n")

    def _write(self, text: str) -> None:
        tty = self.stream.isatty()
        self.stream.write(("\r" + text) if tty else text + "\n")
        self.stream.flush()


@dataclass
class LoadedDump:
    """The records of one dump, keyed by (rank, step, phase, name), after the config's filters."""

    path: Path
    records: dict[Key, dict[str, Any]]
    steps: dict[int, list[int]]  # rank -> finished steps read
    unfinished: dict[int, list[int]]  # rank -> unfinished steps (not read)


def _step_files(path: Path) -> list[tuple[int | None, int, Path]]:
    """(rank, step, file) of every finished step of a dump directory, a rank directory or one step file."""
    if path.is_file():
        return []  # read whole by the caller
    steps = _list_steps(path)
    root = path if (path / MANIFEST_NAME).exists() else path.parent
    layout = DumpLayout(root)
    return [(rank, step, layout.step_file(rank, step))
            for rank, by_state in steps.items() if rank is not None for step in by_state["finished"]]


def _check_record(path: Path, line: int, record: dict[str, Any]) -> None:
    phase = record.get("phase")
    if not isinstance(phase, str):
        raise DumpFormatError(path, line, f"record {record.get('name')!r} has no 'phase' string")
    if not isinstance(record["name"], str):
        raise DumpFormatError(path, line, f"the record's 'name' is not a string: {record['name']!r}")
    for key in ("step", "rank"):
        if isinstance(record[key], bool) or not isinstance(record[key], int):
            raise DumpFormatError(path, line, f"the record's {key!r} is not an int: {record[key]!r}")


def _check_complete(path: Path, rank: int, step: int, count: int) -> None:
    # The writer lists every record of a finished step in its order file, so a step file that lost whole
    # lines (a copy cut at a line boundary) is caught too, not only one cut inside a line.
    order_file = DumpLayout(path.parent.parent).order_file(rank, step)
    try:
        expected = order_file.read_bytes().count(b"\n")
    except FileNotFoundError:
        return
    if count < expected:
        raise DumpFormatError(path, count + 1, f"truncated: {order_file.name} lists {expected} records, "
                                               f"the step file has {count}")


def read_dump(path: str | Path, config: CompareConfig = CompareConfig(), *,
              progress: bool | TextIO = True) -> LoadedDump:
    """Loads and validates a dump for comparison, keeping only the steps and names ``config`` selects.

    Raises DumpFormatError (naming file and line) for invalid, duplicated or truncated records, and
    OSError for unreadable paths. ``progress``: False, True (stderr) or a stream. A live writer of
    this process into ``path`` is waited for first, so every step it finished is read.
    """
    path = Path(path)
    flush_writers(path)
    loaded = LoadedDump(path, {}, {}, {})
    if path.is_file():
        chunks: Iterable[tuple[Path, list[dict[str, Any]]]] = [(path, _load_dump(path))]
        files: list[tuple[int | None, int, Path]] = []
    else:
        for rank, by_state in _list_steps(path).items():
            if rank is not None and by_state["unfinished"]:
                loaded.unfinished[rank] = by_state["unfinished"]
        files = [item for item in _step_files(path) if config.wants_step(item[1])]
        chunks = _load_files(path, files, progress)
    for file_path, records in chunks:
        for line, record in enumerate(records, 1):
            _check_record(file_path, line, record)
            step, rank = record["step"], record["rank"]
            if not config.wants_step(step):
                continue
            steps = loaded.steps.setdefault(rank, [])
            if not steps or steps[-1] != step:
                steps.append(step)
            if not config.wants_name(record["name"]):
                continue
            key = (rank, step, record["phase"], record["name"])
            if key in loaded.records:
                raise DumpFormatError(file_path, line, f"duplicate record: rank {rank} step {step} "
                                                       f"{record['phase']} {record['name']!r} appears twice")
            record.setdefault("seq", line - 1)
            loaded.records[key] = record
    for rank, step, _ in files:  # a finished step whose records were all filtered out is still a step
        steps = loaded.steps.setdefault(rank, [])
        if step not in steps:
            steps.append(step)
    for steps in loaded.steps.values():
        steps.sort()
    return loaded


def _load_files(root: Path, files: list[tuple[int | None, int, Path]],
                progress: bool | TextIO) -> Iterable[tuple[Path, list[dict[str, Any]]]]:
    meter = Progress(f"reading {root}", len(files), None if progress is True else progress) if progress else None
    for done, (rank, step, file_path) in enumerate(files):
        records = _load_dump(file_path)
        if rank is not None:
            _check_complete(file_path, rank, step, len(records))
        yield file_path, records
        if meter:
            meter.update(done + 1)
    if meter:
        meter.close()


# --------------------------------------------------------------------------------------------- comparing


def _diff(metric: str, base: Any, other: Any, tolerance: float, index: int | None = None) -> MetricDiff:
    """Absolute and relative difference of two values; non-finite values must be identical."""
    if base is None or other is None or not _is_finite_number(base) or not _is_finite_number(other):
        same = _same_value(base, other)
        return MetricDiff(metric, base, other, 0.0 if same else math.inf, 0.0 if same else math.inf,
                          tolerance, index)
    abs_diff = float(abs(other - base))
    rel_diff = abs_diff / abs(base) if base != 0 else (0.0 if abs_diff == 0 else math.inf)
    return MetricDiff(metric, base, other, abs_diff, rel_diff, tolerance, index)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _sample_pairs(base: Mapping[str, Any], other: Mapping[str, Any], notes: list[str] | None = None
                  ) -> list[tuple[int, Any, Any]]:
    """(flat index, base value, other value) at the sample positions both records have."""
    b_idx, o_idx = base.get("sample_indices"), other.get("sample_indices")
    b_val, o_val = base.get("samples"), other.get("samples")
    if not all(isinstance(v, list) for v in (b_idx, o_idx, b_val, o_val)):
        return []
    if b_idx == o_idx:
        return list(zip(b_idx, b_val, o_val))
    other_at = dict(zip(o_idx, o_val))
    pairs = [(i, v, other_at[i]) for i, v in zip(b_idx, b_val) if i in other_at]
    if notes is not None:
        notes.append(f"sample_indices differ: compared the {len(pairs)} common positions")
    return pairs


def record_noise(base: Mapping[str, Any], base2: Mapping[str, Any]) -> float | None:
    """The noise level of a record: the largest |base - base2| over its moments and samples.

    None when the two baselines do not have the same shape and dtype (nothing to calibrate from).
    """
    if any(base.get(key) != base2.get(key) for key in STRUCTURE):
        return None
    diffs = [abs(base2[key] - base[key]) for key in MOMENTS
             if _is_finite_number(base.get(key)) and _is_finite_number(base2.get(key))]
    diffs += [abs(b2 - b) for _, b, b2 in _sample_pairs(base, base2)
              if _is_finite_number(b) and _is_finite_number(b2)]
    return float(max(diffs, default=0.0))


def compare_records(base: Mapping[str, Any], other: Mapping[str, Any], config: CompareConfig = CompareConfig(),
                    noise: float | None = None) -> RecordDiff:
    """Compares one matched pair of records (same rank, step, phase and name)."""
    metrics: list[MetricDiff] = []
    notes: list[str] = []
    for key in (*STRUCTURE, *COUNTS):
        if base.get(key) != other.get(key):
            b, o = base.get(key), other.get(key)
            size = abs(o - b) if key in COUNTS and _is_finite_number(b) and _is_finite_number(o) else math.inf
            metrics.append(MetricDiff(key, b, o, float(size), math.inf, 0.0))
    for key in MOMENTS:
        b, o = base.get(key), other.get(key)
        if b is None and o is None:
            continue
        metrics.append(_diff(key, b, o, config.tolerance(b, noise)))
    record = RecordDiff(base["rank"], base["step"], base["phase"], base["name"], base.get("seq", 0), metrics,
                        noise=noise, notes=notes)
    if base.get("shape") == other.get("shape"):
        _compare_samples(record, _sample_pairs(base, other, notes), config, noise)
    return record


def _compare_samples(record: RecordDiff, pairs: list[tuple[int, Any, Any]], config: CompareConfig,
                     noise: float | None) -> None:
    if not pairs:
        return
    worst_at, worst_ratio = 0, -1.0
    dot = base_norm = other_norm = max_abs = 0.0
    for position, (_, b, o) in enumerate(pairs):
        try:
            diff = abs(o - b)
        except TypeError:  # not numbers: only equality means anything
            diff = math.inf
        if math.isfinite(diff):
            dot += b * o
            base_norm += b * b
            other_norm += o * o
        else:  # a nan or inf on either side: must be the same value
            diff = 0.0 if _same_value(b, o) else math.inf
        if diff:
            tolerance = config.tolerance(b, noise)
            ratio = diff / tolerance if tolerance > 0 else math.inf
            if ratio > worst_ratio:
                worst_at, worst_ratio = position, ratio
        max_abs = max(max_abs, diff)
    index, b, o = pairs[worst_at]
    record.metrics.append(_diff("samples", b, o, config.tolerance(b, noise), index))
    record.samples_compared = len(pairs)
    record.samples_max_abs = max_abs
    if base_norm == 0 and other_norm == 0:
        record.samples_cosine = 1.0
    elif base_norm == 0 or other_norm == 0:
        record.samples_cosine = 0.0
    else:
        record.samples_cosine = dot / math.sqrt(base_norm * other_norm)


def execution_order(step: int, phase: str, seq: Any, rank: int) -> tuple[int, int, int, int]:
    """Sort key of the execution order: step, forward before backward, seq, rank."""
    return step, PHASE_ORDER.get(phase, len(PHASE_ORDER)), seq if isinstance(seq, int) else 0, rank


def compare_loaded(base: LoadedDump, other: LoadedDump, config: CompareConfig,
                   noise: LoadedDump | None = None, *, progress: bool | TextIO = False) -> Report:
    """Compares two loaded dumps (see ``compare_dumps``)."""
    keys = sorted(base.records, key=lambda key: _order_of(key, base))
    records: list[RecordDiff] = []
    only_in_base: list[Key] = []
    noise_unmatched = 0
    meter = Progress("comparing", len(keys), None if progress is True else progress) if progress else None
    for done, key in enumerate(keys):
        counterpart = other.records.get(key)
        if counterpart is None:
            only_in_base.append(key)
            continue
        level = None
        if noise is not None:
            baseline2 = noise.records.get(key)
            level = record_noise(base.records[key], baseline2) if baseline2 is not None else None
            noise_unmatched += level is None
        records.append(compare_records(base.records[key], counterpart, config, level))
        if meter and done % 1000 == 0:
            meter.update(done)
    if meter:
        meter.close()
    only_in_other = sorted(set(other.records) - set(base.records),
                           key=lambda key: _order_of(key, other))
    zero_grads: list[tuple[Key, str]] = []
    if not config.strict_zero_grads:
        only_in_base, zero_base = _split_zero_grads(only_in_base, base, other)
        only_in_other, zero_other = _split_zero_grads(only_in_other, other, base)
        zero_grads = sorted([(key, "base") for key in zero_base] + [(key, "other") for key in zero_other],
                            key=lambda item: _order_of(item[0], base if item[1] == "base" else other))
    report = Report(str(base.path), str(other.path), str(noise.path) if noise else None, config, records,
                    only_in_base, only_in_other, base.steps, other.steps,
                    {"base": base.unfinished, "other": other.unfinished}, noise_unmatched=noise_unmatched,
                    zero_grads=zero_grads)
    report.first_divergence = _first_divergence(report, base, other)
    return report


def is_zero_gradient(record: Mapping[str, Any]) -> bool:
    """Whether a record is a gradient that is exactly zero everywhere, by its counts.

        is_zero_gradient({"phase": "backward", "numel": 6, "zero": 6, "nan": 0, "inf": 0})  # True

    A backward record whose ``zero`` count equals ``numel``, with no nan or inf. Records without
    these counts (a tensor the statistics could not handle) are never zero gradients.
    """
    if record.get("phase") not in GRADIENT_PHASES:
        return False
    counts = [record.get(key) for key in ("numel", "zero", "nan", "inf")]
    if not all(isinstance(count, int) and not isinstance(count, bool) for count in counts):
        return False
    numel, zero, nan, inf = counts
    return zero == numel and nan == 0 and inf == 0


def _split_zero_grads(keys: list[Key], has: LoadedDump, lacks: LoadedDump) -> tuple[list[Key], list[Key]]:
    """``keys`` (records only in ``has``) split into (the rest, zero gradients of steps both runs finished).

    In a step the other run never finished, every record is missing there: that is a different step
    count, so its zero gradients stay with the rest.
    """
    rest: list[Key] = []
    zeros: list[Key] = []
    for key in keys:
        in_both = _finished_in_both(key[0], key[1], has, lacks)
        (zeros if in_both and is_zero_gradient(has.records[key]) else rest).append(key)
    return rest, zeros


def _finished_in_both(rank: int, step: int, one: LoadedDump, other: LoadedDump) -> bool:
    """Whether both runs finished this (rank, step): only there is a record missing on one side a mismatch."""
    return step in one.steps.get(rank, ()) and step in other.steps.get(rank, ())


def _order_of(key: Key, loaded: LoadedDump) -> tuple[int, int, int, int]:
    """The execution-order sort key of a record of ``loaded``."""
    return execution_order(key[1], key[2], loaded.records[key].get("seq"), key[0])


def _first_divergence(report: Report, base: LoadedDump, other: LoadedDump) -> Divergence | None:
    """The earliest value or presence mismatch in execution order.

    A record missing on one side counts only in a (rank, step) both runs finished: a step one run
    did not reach is reported as a different step count, not as thousands of divergences.
    """
    candidates: list[tuple[tuple[int, int, int, int], Divergence]] = []
    first_value = next((r for r in report.records if r.diverged), None)
    if first_value is not None:
        candidates.append((execution_order(first_value.step, first_value.phase, first_value.seq, first_value.rank),
                           first_value.divergence()))
    for keys, loaded, present, missing in ((report.only_in_base, base, "present", "missing"),
                                           (report.only_in_other, other, "missing", "present")):
        for rank, step, phase, name in keys:
            if _finished_in_both(rank, step, base, other):
                seq = loaded.records[(rank, step, phase, name)].get("seq")
                candidates.append((execution_order(step, phase, seq, rank),
                                   Divergence(rank, step, phase, name, "record", present, missing, seq)))
                break  # keys are in execution order: the first one in a common step is the earliest
    return min(candidates, key=lambda item: item[0])[1] if candidates else None


def compare_dumps(base: str | Path, other: str | Path, *, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL,
                  noise: str | Path | None = None, noise_factor: float = DEFAULT_NOISE_FACTOR,
                  steps: Iterable[int] | None = None, names: Sequence[str] = (),
                  progress: bool | TextIO = False, strict_zero_grads: bool = False) -> Report:
    """Compares the dump ``other`` against the dump ``base``; ``noise``: a second baseline run's dump.

    ``strict_zero_grads``: a gradient exactly zero in one run and absent in the other diverges
    (by default it is only noted in ``report.zero_grads``). Raises DumpFormatError (naming file and
    line) or OSError when a dump cannot be read.
    """
    config = CompareConfig(rtol, atol, noise_factor, frozenset(steps) if steps is not None else None, tuple(names),
                           bool(strict_zero_grads))
    loaded_base = read_dump(base, config, progress=progress)
    loaded_other = read_dump(other, config, progress=progress)
    loaded_noise = read_dump(noise, config, progress=progress) if noise is not None else None
    return compare_loaded(loaded_base, loaded_other, config, loaded_noise, progress=progress)


# --------------------------------------------------------------------------------------------- terminal


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(item) for item in value) + "]"
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(value))


def _short(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2g}" if value != 0 else "0"


def _clip(name: str, width: int = 48) -> str:
    name = _fmt(name)
    return name if len(name) <= width else "..." + name[-(width - 3):]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _record_rows(records: Sequence[RecordDiff], mark: Key | None, with_rank: bool) -> list[list[str]]:
    rows = []
    for record in records:
        worst = record.worst
        row = [">>" if record.key == mark else ("x" if record.diverged else "")]
        if with_rank:
            row.append(str(record.rank))
        row += [str(record.step), record.phase, str(record.seq), _clip(record.name),
                (worst.metric if record.ratio > 0 else "equal") if worst else "-", _fmt(worst.base) if worst else "-", _fmt(worst.other) if worst else "-",
                _short(worst.abs_diff) if worst else "-", _short(worst.rel_diff) if worst else "-",
                _short(record.ratio), f"{record.samples_cosine:.6f}" if record.samples_cosine is not None else "-"]
        rows.append(row)
    return rows


def _record_table(records: Sequence[RecordDiff], mark: Key | None, with_rank: bool) -> list[str]:
    header = ["", *(["rank"] if with_rank else []), "step", "phase", "seq", "name", "worst", "base", "other",
              "|diff|", "rel", "ratio", "cos"]
    offset = 1 if with_rank else 0
    right = {1 + offset, 3 + offset, *range(6 + offset, 12 + offset)}
    return _table(header, _record_rows(records, mark, with_rank), right)


def _steps_text(steps: Mapping[int, list[int]]) -> str:
    parts = [f"rank {rank}: {_ranges(by_rank)}" for rank, by_rank in sorted(steps.items())]
    return "; ".join(parts) if parts else "no finished steps"


def _ranges(values: Iterable[int]) -> str:
    values = sorted(values)
    if not values:
        return "none"
    spans, start, prev = [], values[0], values[0]
    for value in values[1:] + [None]:  # type: ignore[list-item]
        if value is not None and value == prev + 1:
            prev = value
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return f"{','.join(spans)} ({len(values)})"


def format_report(report: Report, top: int = 10) -> str:
    """The terminal summary: runs, tolerance, first divergence, records around it, worst records, steps."""
    config = report.config
    with_rank = len(set(report.base_steps) | set(report.other_steps)) > 1
    lines = ["probes compare",
             f"  base   {report.base}   {_steps_text(report.base_steps)}",
             f"  other  {report.other}   {_steps_text(report.other_steps)}"]
    rule = f"|diff| <= atol + rtol*|base|  (rtol {config.rtol:g}, atol {config.atol:g})"
    if report.noise is not None:
        lines.append(f"  noise  {report.noise}   ({report.noise_unmatched} compared records had no noise counterpart)")
        rule = (f"|diff| <= max(atol + rtol*|base|, k*noise)  (rtol {config.rtol:g}, atol {config.atol:g}, "
                f"k {config.noise_factor:g})")
    lines.append(f"  tolerance  {rule}")
    if config.steps is not None or config.names:
        lines.append(f"  filters  steps {_ranges(config.steps) if config.steps is not None else 'all'}; "
                     f"names {' '.join(config.names) or '*'}")
    for side, ranks in report.unfinished.items():
        for rank, steps in ranks.items():
            lines.append(f"  note: {side} rank {rank} has unfinished steps {_ranges(steps)} (not compared)")
    diverged = [r for r in report.records if r.diverged]
    lines.append(f"  {report.matched} records matched, {len(diverged)} diverged, "
                 f"{len(report.only_in_base)} only in base, {len(report.only_in_other)} only in other")
    if report.steps_only_in_base or report.steps_only_in_other:
        lines.append(f"  different step counts: steps only in base {_ranges(report.steps_only_in_base)}, "
                     f"only in other {_ranges(report.steps_only_in_other)}")
    if report.zero_grads:
        lines.append(f"  note: {len(report.zero_grads)} {_plural(len(report.zero_grads), ZERO_GRAD_NOTE)} "
                     "(not counted as divergences; --strict-zero-grads counts them)")

    first = report.first_divergence
    if first is not None:
        lines += ["", f"FIRST DIVERGENCE  rank {first.rank}  step {first.step}  {first.phase}  "
                      f"{_fmt(first.name)}  (seq {first.seq})",
                  f"  {first.metric}: base {_fmt(first.base)}  other {_fmt(first.other)}"
                  + (f"  |diff| {_fmt(first.abs_diff)}  rel {_fmt(first.rel_diff)}  tolerance {_fmt(first.tolerance)}"
                     if first.abs_diff is not None else "")]
        neighbours = [r for r in report.records
                      if (r.rank, r.step, r.phase) == (first.rank, first.step, first.phase)]
        at = next((i for i, r in enumerate(neighbours) if r.key[3] == first.name), None)
        if at is None:  # a missing record: show the matched records that precede it
            at = sum(1 for r in neighbours if (r.seq or 0) < (first.seq or 0))
        window = neighbours[max(0, at - 3): at + 8]
        if window:
            lines += ["", f"Around the first divergence (rank {first.rank}, step {first.step}, {first.phase}, "
                          "in execution order; x = diverged):"]
            lines += _record_table(window, (first.rank, first.step, first.phase, first.name), with_rank)
    worst = sorted((r for r in report.records if r.ratio > 0), key=lambda r: r.ratio, reverse=True)[:top]
    if worst:
        lines += ["", "Worst records (ratio = |diff| / tolerance):"]
        lines += _record_table(worst, (first.rank, first.step, first.phase, first.name) if first else None,
                               with_rank)
    for label, keys in (("only in base", report.only_in_base), ("only in other", report.only_in_other)):
        if keys:
            shown = ", ".join(f"{'r%d ' % k[0] if with_rank else ''}s{k[1]} {k[2]} {_clip(k[3], 40)}"
                              for k in keys[:5])
            lines += ["", f"{len(keys)} records {label}: {shown}{' ...' if len(keys) > 5 else ''}"]
    if report.zero_grads:
        lines += ["", f"Notes ({ZERO_GRAD_NOTE}):"]
        lines += _zero_grad_lines(report.zero_grads, with_rank)
    summaries = report.per_step()
    if summaries:
        shown_steps = [s for s in summaries if s.diverged or s.only_in_base or s.only_in_other][:20] \
            if len(summaries) > 20 else summaries
        if shown_steps:
            lines += ["", "Per step" + (" (steps with differences only)" if len(shown_steps) < len(summaries) else "")
                      + ":"]
            rows = [[str(s.step), str(s.matched), str(s.diverged), str(s.only_in_base), str(s.only_in_other),
                     _short(s.worst.ratio) if s.worst else "-",
                     f"{s.worst.phase} {_clip(s.worst.name, 40)}" if s.worst and s.worst.ratio > 0 else "-"]
                    for s in shown_steps]
            lines += _table(["step", "matched", "diverged", "only base", "only other", "worst ratio", "worst record"],
                            rows, {0, 1, 2, 3, 4, 5})
    lines.append("")
    lines.append(_verdict(report))
    return "\n".join(lines)


def _plural(count: int, note: str) -> str:
    """``note`` ("materialised zero gradient, ...") with its noun in the plural when ``count`` != 1."""
    noun, comma, rest = note.partition(",")
    return note if count == 1 else f"{noun}s{comma}{rest}"


def _zero_grad_lines(zero_grads: Sequence[tuple[Key, str]], with_rank: bool, limit: int = 10) -> list[str]:
    lines = [f"  {'r%d ' % key[0] if with_rank else ''}s{key[1]} {key[2]} {_clip(key[3], 60)}: "
             f"zero in {side}, absent in {'other' if side == 'base' else 'base'}"
             for key, side in zero_grads[:limit]]
    if len(zero_grads) > limit:
        lines.append(f"  ... {len(zero_grads) - limit} more (see --json)")
    return lines


def _verdict(report: Report) -> str:
    first = report.first_divergence
    if report.agrees:
        noted = f"; {len(report.zero_grads)} {_plural(len(report.zero_grads), 'materialised zero gradient')} noted" \
            if report.zero_grads else ""
        return f"verdict: AGREE ({report.matched} records within tolerance{noted})"
    if first is not None:
        return (f"verdict: DIVERGED at rank {first.rank} step {first.step} {first.phase} {_fmt(first.name)} "
                f"({first.metric})")
    return (f"verdict: DIFFERENT RECORDS ({len(report.only_in_base)} only in base, "
            f"{len(report.only_in_other)} only in other; matched records agree)")


# --------------------------------------------------------------------------------------------- command


def parse_steps(text: str) -> frozenset[int]:
    """``"3"``, ``"0-4"`` or ``"1,3,5-7"`` as a set of steps."""
    steps: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            start, end = int(first), int(last) if dash else int(first)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a step, range or list of steps: {text!r}") from None
        if start < 0 or end < start:
            raise argparse.ArgumentTypeError(f"bad step range {part!r}")
        steps.update(range(start, end + 1))
    return frozenset(steps)
