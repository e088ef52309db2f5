"""Every metric of every matched pair at once, the pairs' verdicts, and the RecordDiff objects a report shows.

    evaluated = evaluate(pairs, config, noise)          # noise: per pair and statistic (NOISED) the level, or None
    measured = measure(base, other, rows, config)       # per pair: ratio, diverged, rel_error, the worst metric
    measured = measure(base, other, rows, CompareConfig(exact=True))   # the verdicts of the hashes instead
    levels = noise_levels(base, noise_run, rows)        # per pair and statistic: the noise level (nan: none)
    diffs = record_diffs(base, other, rows, config, noise=levels)      # one RecordDiff per pair

The rules of ``rules`` applied to ``pairs``, on columns: pairs are read from their columns
(``pairs.from_columns``: float64, an integer tensor's values int64, compared exactly); those no column holds
(anything kept in ``extra``, samples to pair by index) and the RecordDiffs' pairs are read with the values the
records hold (``pairs.from_records``, object arrays). ``evaluate`` computes every metric once; ``verdicts`` reduces an
evaluation to per-pair verdicts (ratio, diverged, the worst metric), ``record_diffs`` turns the one of a few pairs
into RecordDiff objects: both read what ``evaluate`` computed, nothing else decides a metric.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..dump.hashes import HASH, hex_hash
from .options import AGGREGATES, COUNTS, MOMENTS, OPTIONAL_MOMENTS, STRUCTURE, CompareConfig
from .pairs import Pairs, SampleBlock, context_of, from_columns, from_records
from .reading import LoadedDump
from .results import BIT_IDENTICAL, BYTES_DIFFER, MetricDiff, RecordDiff
from .rules import as_floats, bounds, difference, distance, finite, int_distance, ratio, relative, same, tolerance

__all__ = ["NOISED", "WORST", "Evaluation", "Measured", "Moment", "Samples", "evaluate", "measure", "noise_level",
           "noise_levels", "record_diffs"]

# The statistics that have a noise level of their own: the columns of ``noise_level``'s array.
NOISED = (*MOMENTS, "samples")


@dataclass
class Moment:
    """One moment of every pair: compared at all, |diff|, the tolerance, and whether the base value is a number."""

    compared: np.ndarray
    diff: np.ndarray
    tolerance: np.ndarray
    numbers: np.ndarray
    noise: np.ndarray | None = None  # the noise level (nan: none); None without a calibration run


@dataclass
class Samples:
    """The samples of every pair: the worst paired sample (largest |diff| / tolerance, the first on ties) and
    its index and values (object or float64 arrays), how many were paired, the largest |diff| and the cosine."""

    has: np.ndarray
    index: np.ndarray
    base: np.ndarray
    other: np.ndarray
    diff: np.ndarray
    tolerance: np.ndarray
    compared: np.ndarray
    max_abs: np.ndarray
    cosine: np.ndarray
    noise: np.ndarray | None = None  # the noise level of every sample (nan: none); None without a calibration run
    largest: np.ndarray | None = None  # with a noise level: the largest |diff| of the paired samples


@dataclass
class Evaluation:
    pairs: Pairs
    unequal: np.ndarray  # a structure field or count differs
    moments: dict[str, Moment]
    samples: Samples


def evaluate(pairs: Pairs, config: CompareConfig, noise: np.ndarray | None = None, *,
             summaries: bool = True) -> Evaluation:
    """Every metric of ``pairs`` under ``config`` (see docs/compare.md); ``noise``: per pair and statistic
    (``NOISED``, a column each) the noise level, nan where there is none (``noise_level``).

    ``summaries=False``: the samples' worst index, count, largest |diff| and cosine, which only a RecordDiff
    shows, are left at their defaults (None, 0, 0, 1); the verdicts (``verdicts``) do not read them.
    """
    unequal = np.zeros(pairs.count, dtype=bool)
    for found in pairs.unequal.values():
        unequal |= found
    statistics = (_base_floats(pairs, name) for name in ("numel", "mean", "std"))
    single, aggregate = bounds(config, pairs.precision, *statistics, pairs.floor, pairs.phase)
    moments = {}
    for name in MOMENTS:
        (values_b, null_b), (values_o, null_o) = pairs.base[name], pairs.other[name]
        compared = ~(null_b | null_o) if name in OPTIONAL_MOMENTS else ~(null_b & null_o)
        numbers = finite(values_b) & ~null_b
        level = None if noise is None else noise[:, NOISED.index(name)]
        moments[name] = Moment(compared, _difference(pairs, name),
                               tolerance(config, values_b, level, numbers, aggregate if name in AGGREGATES else single),
                               numbers, level)
    return Evaluation(pairs, unequal, moments,
                      _samples(pairs, config, None if noise is None else noise[:, NOISED.index("samples")], summaries,
                               single))


def _difference(pairs: Pairs, name: str) -> np.ndarray:
    """``rules.difference`` of a single value of every pair, exact where both sides hold an integer."""
    (values_b, null_b), (values_o, null_o) = pairs.base[name], pairs.other[name]
    diff = difference(values_b, values_o, null_b, null_o)
    if name in pairs.ints:
        ints_b, ints_o, both = pairs.ints[name]
        diff[both] = int_distance(ints_b[both], ints_o[both])
    return diff


def _base_floats(pairs: Pairs, name: str) -> np.ndarray:
    values, null = pairs.base[name]
    return as_floats(values, finite(values) & ~null)


def _rule_rows(rule: tuple, rows: np.ndarray, column: bool) -> tuple:
    """A per-pair rule (``rules.bounds``) for the pairs ``rows``: as a column against their samples or as is."""
    return tuple(part if np.isscalar(part) else part[rows, None] if column else part[rows] for part in rule)


def _samples(pairs: Pairs, config: CompareConfig, noise: np.ndarray | None, summaries: bool, rule: tuple
             ) -> Samples:
    count = pairs.count
    kind = object if any(block.base.dtype == object for block in pairs.samples) else np.float64
    found = Samples(np.zeros(count, dtype=bool), np.full(count, None, dtype=object), np.zeros(count, dtype=kind),
                    np.zeros(count, dtype=kind), np.zeros(count), np.zeros(count), np.zeros(count, np.int64),
                    np.zeros(count, dtype=kind), np.ones(count), noise, None if noise is None else np.zeros(count))
    for block in pairs.samples:
        _scan(block, config, noise, found, summaries, rule)
    return found


def _column_max(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per row ``max(0.0, v0, v1, ...)`` over the valid values, in order, as Python's max keeps the first."""
    largest = np.full(len(values), 0.0, dtype=values.dtype)
    for j in range(values.shape[1]):
        larger = valid[:, j] & (values[:, j] > largest).astype(bool)
        largest[larger] = values[larger, j]
    return largest


def _rows(block: SampleBlock, which: np.ndarray | slice) -> SampleBlock:
    return SampleBlock(block.rows[which], block.indices[which], block.base[which], block.other[which],
                       block.valid[which])


# Pairs scanned at a time: each row's metrics are its own, and temporaries of a MB or so are reused
# from the allocator and the cache, where a block's worth (tens of MB) is fresh memory for every pass.
_SCAN_ROWS = 4096


def _scan(block: SampleBlock, config: CompareConfig, noise: np.ndarray | None, found: Samples,
          summaries: bool, rule: tuple) -> None:
    """The samples of the pairs of one block, into ``found``, a slice of rows at a time: the pairs whose
    samples are all valid floats with a finite difference (the common case) on a shorter path."""
    for start in range(0, len(block.rows), _SCAN_ROWS):
        part = _rows(block, slice(start, start + _SCAN_ROWS))
        raw = distance(part.base, part.other)
        if raw.dtype.kind != "f" or not part.valid.all():
            _scan_rows(part, raw, config, noise, found, summaries, False, rule)
            continue
        plain = np.isfinite(raw).all(axis=1)
        if plain.all():
            _scan_rows(part, raw, config, noise, found, summaries, True, rule)
            continue
        for which, is_plain in ((plain, True), (~plain, False)):
            if which.any():
                _scan_rows(_rows(part, which), raw[which], config, noise, found, summaries, is_plain, rule)


def _scan_rows(block: SampleBlock, raw: np.ndarray, config: CompareConfig, noise: np.ndarray | None,
               found: Samples, summaries: bool, plain: bool, rule: tuple) -> None:
    """``_scan`` of pairs whose distances are ``raw``; ``plain``: every sample valid, every distance finite;
    ``rule``: the single values' rule of every pair (``rules.bounds``)."""
    base, other, valid, rows = block.base, block.other, block.valid, block.rows
    level = None if noise is None else noise[rows, None]
    per_sample = _rule_rows(rule, rows, True)
    if plain:  # no nan or inf to compare by equality, no padding: diff is raw, and its ratio can be no nan
        usable = valid
        diff = raw
        tol = tolerance(config, base, level, np.broadcast_to(True, base.shape), per_sample)
        no_difference = diff == 0
        # ratio(diff, tol) in place of a new block: tol >= 0 (rtol, atol >= 0), so a zero tolerance gives inf,
        # and no difference (0 / 0 too) is set to -1: never the worst. The tolerance is taken back below.
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            position_ratio = np.divide(diff, tol, out=tol)
        position_ratio[no_difference] = -1.0
    else:
        tol = tolerance(config, base, level, None, per_sample)
        usable = np.isfinite(raw.astype(np.float64)) & valid  # a nan or inf on either side: must be the same value
        diff = np.where(usable, raw, np.where(same(base, other), 0.0, np.inf))
        as_float = diff.astype(np.float64)
        position_ratio = ratio(as_float, tol)
        position_ratio[~(valid & (as_float != 0) & (position_ratio >= 0))] = -1.0  # nan (inf / inf) is never the worst
    at = np.argmax(position_ratio, axis=1)  # the first of the largest
    picked = np.arange(len(rows))
    worst_base, worst_other = base[picked, at], other[picked, at]
    found.has[rows] = True
    found.base[rows], found.other[rows] = worst_base, worst_other
    found.diff[rows] = difference(worst_base, worst_other)
    # The tolerance is per value: that of the worst sample alone is the same number.
    found.tolerance[rows] = tolerance(config, worst_base, None if level is None else level[:, 0], None,
                                      _rule_rows(rule, rows, False)) if plain else tol[picked, at]
    if found.largest is not None:
        found.largest[rows] = diff.max(axis=1) if plain else _column_max(diff, valid).astype(np.float64)
    if not summaries:
        return
    found.index[rows] = block.indices[picked, at]
    found.compared[rows] = valid.sum(axis=1)
    found.max_abs[rows] = _column_max(diff, valid)
    # Sums in position order, as one loop over the samples adds them.
    dot, base_norm, other_norm = (np.full(len(rows), 0.0, dtype=base.dtype) for _ in range(3))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for j in range(base.shape[1]):
            take = usable[:, j]
            b, o = base[take, j], other[take, j]
            dot[take] += b * o
            base_norm[take] += b * b
            other_norm[take] += o * o
        dot, base_norm, other_norm = (values.astype(np.float64) for values in (dot, base_norm, other_norm))
        cosine = dot / np.sqrt(base_norm * other_norm)
    found.cosine[rows] = np.where((base_norm == 0) & (other_norm == 0), 1.0,
                                  np.where((base_norm == 0) | (other_norm == 0), 0.0, cosine))


def noise_level(pairs: Pairs) -> np.ndarray:
    """Per pair of the base run and a calibration run (``perturbed_rounding``) and per statistic of ``NOISED``
    (a column each): the noise level, how much calibration says the statistic moves (docs/compare.md, Noise floor).

    With ``d`` the change of a statistic from the base record to its calibration counterpart and ``n`` the base
    record's finite values:

    - ``mean``: max(|d mean|, F), ``std``: max(|d std|, F), ``norm``: max(|d norm|, F * sqrt(n)), where
      ``F = rms(d samples) / sqrt(n)`` is what independent changes of the values give a mean: an average moves
      far less than its values, so a scaled output moves it beyond its level where rounding moves single
      values as much, and a statistic that agrees by chance still gets the floor its values give it;
    - ``min``, ``max``, ``samples`` (single values): ``V``, the largest of |d min|, |d max|, |d sample| and
      the least some value must have moved for the averages to move as they did (|d mean|, |d norm| / sqrt(n)).

    Only values both records hold as finite numbers count. nan in the whole row where shape, dtype or numel
    differ (nothing to calibrate from).
    """
    count = pairs.count
    changes = {}
    for name in MOMENTS:
        (values_b, null_b), (values_n, null_n) = pairs.base[name], pairs.other[name]
        numbers = finite(values_b) & finite(values_n) & ~null_b & ~null_n
        changes[name] = np.where(numbers, _difference(pairs, name), 0.0)
    root = np.sqrt(_finite_count(pairs))
    per_value = np.where(root > 0, 1.0 / np.where(root > 0, root, 1.0), 0.0)
    values = np.maximum.reduce([changes["min"], changes["max"], changes["mean"], changes["norm"] * per_value])  # V
    floor = np.zeros(count)  # F
    for block in pairs.samples:
        numbers = finite(block.base) & finite(block.other) & block.valid
        diffs = np.where(numbers, difference(block.base, block.other), 0.0)
        values[block.rows] = np.maximum(values[block.rows], diffs.max(axis=1, initial=0.0))
        floor[block.rows] = np.where(root[block.rows] > 0, _rms(diffs, numbers) * per_value[block.rows], 0.0)
    levels = np.empty((count, len(NOISED)))
    with np.errstate(over="ignore"):
        for column, name in enumerate(NOISED):
            levels[:, column] = (values if name in ("min", "max", "samples") else
                                 np.maximum(changes[name], floor * root if name == "norm" else floor))
    structure = np.zeros(count, dtype=bool)
    for name in STRUCTURE:
        structure |= pairs.unequal[name]
    levels[structure] = np.nan
    return levels


def _rms(diffs: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """Per row the root mean square of the ``numbers`` entries of ``diffs`` (0 where none): the squares of
    ``diffs / largest`` (no overflow) summed in position order, as one loop over the samples adds them."""
    largest = diffs.max(axis=1, initial=0.0)
    scale = np.where((largest > 0) & np.isfinite(largest), largest, 1.0)
    total = np.zeros(len(diffs))
    for j in range(diffs.shape[1]):
        take = numbers[:, j]
        total[take] += np.square(diffs[take, j] / scale[take])
    found = scale * np.sqrt(total / np.maximum(numbers.sum(axis=1), 1))
    return np.where(np.isfinite(largest), found, np.inf)


def _finite_count(pairs: Pairs) -> np.ndarray:
    """Per pair the base record's finite values: numel - nan - inf (0 where numel is no number)."""
    total = np.zeros(pairs.count)
    for name, sign in (("numel", 1.0), ("nan", -1.0), ("inf", -1.0)):
        values, null = pairs.base[name]
        numbers = finite(values) & ~null
        total += sign * np.where(numbers, as_floats(values, numbers), 0.0)
    return np.maximum(total, 0.0)


WORST = ("", "structure", *MOMENTS, "samples")  # codes of Measured.worst: 0 none, 1 a structure field, count or hash


@dataclass
class Measured:
    """Per matched pair: the largest |diff| / tolerance, whether a metric broke, the moments' relative error,
    and which metric was the worst (``WORST[code]``, the first of the largest ratio) with its two values.
    Code 1 also marks the pairs whose values only their RecordDiff shows (the plots build it)."""

    ratio: np.ndarray
    diverged: np.ndarray
    rel_error: np.ndarray
    worst: np.ndarray
    worst_base: np.ndarray  # nan where the value is None (see worst_null)
    worst_other: np.ndarray
    worst_null: np.ndarray  # (count, 2) bool: the worst metric's base / other value is None
    moments: dict[tuple[str, str], np.ndarray]  # ("base" | "other", moment) -> values (nan where absent)
    # |diff| / noise floor (k * the noise level), the largest over the metrics with a level, inf for a structure or
    # count that differs; nan where nothing was measured (no calibration run, no counterpart in it, or a counterpart
    # identical to the base: every level 0)
    noise_ratio: np.ndarray | None = None

    _PER_PAIR = ("ratio", "diverged", "rel_error", "worst", "worst_base", "worst_other", "worst_null", "noise_ratio")

    def reordered(self, order: np.ndarray) -> "Measured":
        """The same, pairs reordered."""
        return Measured(*(getattr(self, name)[order] for name in self._PER_PAIR[:-1]),
                        {key: values[order] for key, values in self.moments.items()},
                        None if self.noise_ratio is None else self.noise_ratio[order])

    def put(self, rows: np.ndarray, part: "Measured") -> None:
        """Sets the pairs ``rows`` to those of ``part``."""
        for name in self._PER_PAIR:
            if getattr(self, name) is not None:
                getattr(self, name)[rows] = getattr(part, name)
        for key, values in part.moments.items():
            self.moments[key][rows] = values


def _floats(values: np.ndarray, null: np.ndarray) -> np.ndarray:
    """A value column as float64, nan where None (object values: nan for anything but a finite number)."""
    return np.where(null, np.nan, values) if values.dtype.kind == "f" else as_floats(values, finite(values))


def verdicts(evaluated: Evaluation, config_factor: float = 0.0) -> Measured:
    """The RecordDiff verdicts (ratio, diverged, rel_error, worst) of every evaluated pair; with noise levels,
    also each pair's ratio to its noise floor (``config_factor``: the config's noise_factor)."""
    pairs = evaluated.pairs
    count = pairs.count
    unequal = evaluated.unequal
    found = Measured(np.where(unequal, np.inf, 0.0), unequal.copy(), np.zeros(count),
                     np.where(unequal, WORST.index("structure"), 0).astype(np.int8), np.full(count, np.nan),
                     np.full(count, np.nan), np.zeros((count, 2), dtype=bool), {})

    def broke(metric: str, diff: np.ndarray, tolerance: np.ndarray, where: np.ndarray, values_b: np.ndarray,
              values_o: np.ndarray, nulls: np.ndarray) -> None:
        new = ratio(diff, tolerance)
        # RecordDiff.worst: the first metric, replaced by a later one of a larger ratio (never by a nan ratio)
        larger = where & ((found.worst == 0) | (new > found.ratio))
        found.worst[larger] = WORST.index(metric)
        found.worst_base[larger], found.worst_other[larger] = values_b[larger], values_o[larger]
        found.worst_null[larger] = nulls[larger]
        found.ratio[larger] = new[larger]
        found.diverged |= where & (diff > tolerance)

    scale = np.zeros(count)  # RecordDiff.rel_error: relative to the record's magnitude
    for name in ("min", "max"):
        moment = evaluated.moments[name]
        values, null = pairs.base[name]
        usable = moment.compared & moment.numbers
        scale = np.where(usable, np.maximum(scale, np.abs(np.where(usable, as_floats(values, moment.numbers), 0.0))),
                         scale)
    for name, moment in evaluated.moments.items():
        (values_b, null_b), (values_o, null_o) = pairs.base[name], pairs.other[name]
        floats_b, floats_o = _floats(values_b, null_b), _floats(values_o, null_o)
        found.moments[("base", name)], found.moments[("other", name)] = floats_b, floats_o
        broke(name, moment.diff, moment.tolerance, moment.compared & ~unequal, floats_b, floats_o,
              np.stack([null_b, null_o], axis=1))
        magnitude = np.maximum(np.abs(np.where(moment.numbers, as_floats(values_b, moment.numbers), 0.0)), scale)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            error = np.where(magnitude > 0, moment.diff / np.where(magnitude > 0, magnitude, 1.0), np.inf)
        found.rel_error = np.where(moment.compared & (moment.diff != 0), np.maximum(found.rel_error, error),
                                   found.rel_error)
    samples = evaluated.samples
    if samples.has.any():
        no_nulls = np.zeros(count, dtype=bool)
        broke("samples", samples.diff, samples.tolerance, samples.has & ~unequal,
              _floats(samples.base, no_nulls), _floats(samples.other, no_nulls), np.zeros((count, 2), dtype=bool))
    if samples.noise is not None:
        found.noise_ratio = _noise_ratio(evaluated, config_factor)
    return found


def _noise_ratio(evaluated: Evaluation, factor: float) -> np.ndarray:
    """``Measured.noise_ratio`` of every pair: each metric's |diff| against its noise floor, the largest."""
    samples = evaluated.samples
    metrics = [(moment.diff, moment.noise, moment.compared) for moment in evaluated.moments.values()]
    metrics.append((samples.largest, samples.noise, samples.has))
    has_level = np.zeros(evaluated.pairs.count, dtype=bool)  # a level above 0: calibration measured something
    for _, level, _ in metrics:
        has_level |= level > 0
    found = np.where(has_level, 0.0, np.nan)
    for diff, level, where in metrics:
        usable = where & ~np.isnan(level)
        with np.errstate(over="ignore"):
            new = ratio(np.where(usable, diff, 0.0), factor * np.where(usable, level, 0.0))
        found = np.where(usable, np.maximum(found, new), found)
    return np.where(has_level & evaluated.unequal, np.inf, found)


def measure(base: LoadedDump, other: LoadedDump, rows: tuple[np.ndarray, np.ndarray], config: CompareConfig,
            noise: np.ndarray | None = None) -> Measured:
    """The verdicts of every pair ``rows``; ``noise``: each pair's noise level (nan: none)."""
    pairs, by_records = from_columns(base, other, rows)
    found = verdicts(evaluate(pairs, config, noise, summaries=False), config.noise_factor)
    _shown_by_records(found, np.flatnonzero(pairs.integer))
    odd = np.flatnonzero(by_records)
    if len(odd):
        part = verdicts(evaluate(from_records(base.records_at(rows[0][odd]), other.records_at(rows[1][odd]),
                                              context_of(base, rows[0][odd])), config,
                                 None if noise is None else noise[odd], summaries=False), config.noise_factor)
        part.worst[:] = WORST.index("structure")  # plots build these records to show them
        found.put(odd, part)
    if config.exact:
        _hash_verdicts(found, base, other, rows)
    return found


def _shown_by_records(found: Measured, rows: np.ndarray) -> None:
    """The pairs ``rows``, whose exact values only their RecordDiff shows (integers), marked as such (code 1:
    the plots build it), their values as a record's (``_floats``: nan for anything but a finite number)."""
    found.worst[rows] = WORST.index("structure")
    for values in (found.worst_base, found.worst_other, *found.moments.values()):
        part = values[rows]
        values[rows] = np.where(np.isfinite(part), part, np.nan)


def _hash_verdicts(found: Measured, base: LoadedDump, other: LoadedDump, rows: tuple[np.ndarray, np.ndarray]) -> None:
    """Exact mode: a pair diverges when its hashes differ (both missing: the same), whatever the tolerances;
    the moments and rel_error stay for the plots."""
    hashes = []
    for loaded, at in ((base, rows[0]), (other, rows[1])):
        column = loaded.table.column("hash").take(pa.array(at, pa.int64()))
        hashes.append((column.is_null().to_numpy(zero_copy_only=False),
                       column.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)))
    (null_b, hash_b), (null_o, hash_o) = hashes
    differs = (null_b != null_o) | (~null_b & (hash_b != hash_o))
    found.diverged = differs
    found.ratio = np.where(differs, np.inf, 0.0)
    found.worst = np.where(differs, WORST.index("structure"), 0).astype(np.int8)  # the hash: a RecordDiff shows it
    found.worst_base = np.full(len(differs), np.nan)
    found.worst_other = np.full(len(differs), np.nan)
    found.worst_null = np.zeros((len(differs), 2), dtype=bool)
    found.noise_ratio = None


def noise_levels(base: LoadedDump, noise: LoadedDump, rows: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Per pair of the base run and a calibration run (``rows``) and per statistic (``NOISED``, a
    column each): the noise level, nan where there is none."""
    pairs, by_records = from_columns(base, noise, rows)
    levels = noise_level(pairs)
    odd = np.flatnonzero(by_records)
    if len(odd):
        levels[odd] = noise_level(from_records(base.records_at(rows[0][odd]), noise.records_at(rows[1][odd])))
    return levels


def record_diffs(base_dump: LoadedDump, other_dump: LoadedDump, rows: tuple[np.ndarray, np.ndarray],
                 config: CompareConfig, noise: np.ndarray | None = None) -> list[RecordDiff]:
    """One RecordDiff per pair ``rows`` (base rows, other rows: the same rank, step, phase and name); ``noise``:
    per pair and statistic (``NOISED``, a column each) the noise level, nan where there is none (None: no
    calibration run). With ``config.exact`` the one metric is the hash."""
    base, other = base_dump.records_at(rows[0]), other_dump.records_at(rows[1])
    levels = None if noise is None else np.asarray(noise, np.float64).reshape(len(base), len(NOISED))
    if config.exact:
        return [_hash_diff(b, o, None if levels is None else _levels(levels[row]))
                for row, (b, o) in enumerate(zip(base, other))]
    pairs = from_records(base, other, context_of(base_dump, rows[0]))
    evaluated = evaluate(pairs, config, levels)
    found = []
    for row, (b, o) in enumerate(zip(base, other)):
        metrics = []
        for key in (*STRUCTURE, *COUNTS):
            if pairs.unequal[key][row]:
                values = np.empty(2, dtype=object)
                values[:] = [b.get(key), o.get(key)]
                size = difference(values[:1], values[1:])[0] if key in COUNTS and finite(values).all() else math.inf
                metrics.append(MetricDiff(key, b.get(key), o.get(key), float(size), math.inf, 0.0))
        for name in MOMENTS:
            moment = evaluated.moments[name]
            if moment.compared[row]:
                values_b = pairs.base[name][0][row:row + 1]
                rel = relative(moment.diff[row:row + 1], values_b, moment.numbers[row:row + 1])[0]
                metrics.append(MetricDiff(name, b.get(name), o.get(name), float(moment.diff[row]), float(rel),
                                          float(moment.tolerance[row]),
                                          floor=_floor(config, moment.noise, row)))
        level = None if levels is None else _levels(levels[row])
        record = RecordDiff(b["rank"], b["step"], b["phase"], b["name"], b.get("seq", 0), metrics, noise=level)
        samples = evaluated.samples
        if samples.has[row]:
            values_b = samples.base[row:row + 1]
            numbers = finite(values_b)
            rel = relative(samples.diff[row:row + 1], values_b, numbers)[0]
            metrics.append(MetricDiff("samples", samples.base[row], samples.other[row], float(samples.diff[row]),
                                      float(rel), float(samples.tolerance[row]), samples.index[row],
                                      floor=_floor(config, samples.noise, row)))
            record.samples_compared = int(samples.compared[row])
            record.samples_max_abs = samples.max_abs[row]
            record.samples_cosine = float(samples.cosine[row])
        if pairs.shifted[row]:
            record.notes.append(f"sample_indices differ: compared the {int(samples.compared[row])} common positions")
        found.append(record)
    return found




def _levels(row: np.ndarray) -> dict[str, float] | None:
    """A record's noise levels by statistic (those it has), None when it has none."""
    found = {name: float(level) for name, level in zip(NOISED, row.tolist()) if not math.isnan(level)}
    return found or None


def _floor(config: CompareConfig, levels: np.ndarray | None, row: int) -> float | None:
    """A metric's noise floor: noise_factor x its noise level (None: no level)."""
    if levels is None or math.isnan(levels[row]):
        return None
    return config.noise_factor * float(levels[row])  # Python floats: an overflow is inf, no warning


def _hash_diff(base: Mapping[str, Any], other: Mapping[str, Any], noise: dict[str, float] | None) -> RecordDiff:
    """The exact comparison of one pair: its hashes (hex), equal or not; no tolerance."""
    hashes = [record.get(HASH) for record in (base, other)]
    same = hashes[0] == hashes[1]
    size = 0.0 if same else math.inf
    shown = [None if value is None else hex_hash(value) for value in hashes]
    record = RecordDiff(base["rank"], base["step"], base["phase"], base["name"], base.get("seq", 0),
                        [MetricDiff(HASH, shown[0], shown[1], size, size, 0.0)], noise=noise)
    record.notes.append(BIT_IDENTICAL if same else BYTES_DIFFER)
    return record
