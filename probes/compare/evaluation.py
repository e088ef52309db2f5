"""Every metric of every matched pair at once, the pairs' verdicts, and the RecordDiff objects a report shows.

    evaluated = evaluate(pairs, config, noise)          # noise: per pair and statistic (NOISED) the level, or None
    measured = measure(base, other, rows, config)       # per pair: ratio, diverged, rel_error, the worst metric
    measured = measure(base, other, rows, CompareConfig(exact=True))   # the verdicts of the hashes instead
    levels = noise_levels(base, noise_run, rows)        # per pair and statistic: the noise level (nan: none)
    diffs = record_diffs(base, other, rows, config, noise=levels)      # one RecordDiff per pair
    grown = drift(rank, step, measured, before)         # per pair: what it grew from where it is drift (nan: not)

One path: pairs are read from their columns (``pairs.from_columns``), ``evaluate`` computes every metric once,
``verdicts`` reduces it to per-pair verdicts and ``record_diffs`` reads the RecordDiffs of a few pairs from the
same arrays: nothing else decides a metric. The tolerance: ``_tolerance`` with ``_bounds``' rule per pair.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from ..dump.hashes import HASH, hex_hash
from .options import (AGGREGATES, COUNTS, DRIFT_GROWTH, EXACT, MOMENT_PASSES, MOMENTS, OPTIONAL_MOMENTS, STRUCTURE,
                      CompareConfig, precision_of)
from .pairs import (Pairs, SampleBlock, Values, both_ints, difference, differs, distance, exact_distance,
                    from_columns, numbers, same)
from .reading import LoadedDump
from .results import BIT_IDENTICAL, BYTES_DIFFER, MetricDiff, RecordDiff

__all__ = ["NOISED", "WORST", "Carried", "Evaluation", "Measured", "Moment", "Samples", "carried", "drift", "evaluate",
           "measure", "noise_levels", "record_diffs"]

# The statistics that have a noise level of their own: the columns of ``noise_level``'s array.
NOISED = (*MOMENTS, "samples")


def _bounds(config: CompareConfig, precision: np.ndarray, numel: np.ndarray, own: np.ndarray, floor: np.ndarray,
            phase: np.ndarray) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """The (rtol, atol, scale) per pair of single values and of moments (``_tolerance``'s ``rule``):
    ``config.fixed``'s (rtol, atol, 0) when given; else of each pair's ``precision``: rtol, for moments
    max(passes * mtol, rtol / sqrt(numel)) (passes of its ``phase``, ``MOMENT_PASSES``), no atol, and the scale
    max(``own``: the base tensor's rms without mask fills, ``floor``, tiny)."""
    if config.fixed is not None:
        rtol, atol = config.fixed
        return (rtol, atol, 0.0), (rtol, atol, 0.0)
    rtol, mtol, tiny = (np.zeros(len(precision)) for _ in range(3))
    for name in set(precision.tolist()):  # a few precisions: one pass over the pairs each
        which = precision == name
        found = EXACT if name == EXACT.name else precision_of(name)
        rtol[which], mtol[which], tiny[which] = found.rtol, found.mtol, found.tiny
    scale = np.maximum(np.maximum(np.nan_to_num(own, nan=0.0), tiny), np.nan_to_num(floor, nan=0.0))
    for name in set(phase.tolist()):
        mtol[phase == name] *= MOMENT_PASSES.get(name, 1.0)
    count = np.where(np.isfinite(numel) & (numel > 0), numel, 1.0)
    zero = np.zeros(len(precision))
    return (rtol, zero, scale), (np.maximum(mtol, rtol / np.sqrt(count)), zero, scale)


def _tolerance(config: CompareConfig, base: np.ndarray, noise: np.ndarray | None, numbers: np.ndarray,
               rule: tuple[Any, Any, Any]) -> np.ndarray:
    """atol + rtol * max(|base|, scale) (|base| taken as 0 where it is no finite number, ``numbers``), raised to
    noise_factor * noise where that is larger; ``rule``: (rtol, atol, scale), numbers or per value (``_bounds``);
    ``noise``: per value the record's noise level, nan (or None for all) without one."""
    rtol, atol, scale = rule
    fixed = np.abs(base)
    if not numbers.all():  # the common case: no value to set aside
        fixed[~numbers] = 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        if not np.isscalar(scale) or scale:
            np.maximum(fixed, scale, out=fixed)
        fixed *= rtol
        fixed += atol
    if noise is None:
        return fixed
    with np.errstate(invalid="ignore", over="ignore"):
        bound = config.noise_factor * noise  # nan (0 * inf, or no level) never raises the tolerance
    return np.where(bound > fixed, bound, fixed)


def _ratio(diff: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """MetricDiff.ratio: 0 for no difference, else |diff| / tolerance (inf for a tolerance of 0)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        found = diff / np.where(tol > 0, tol, 1.0)
    return np.where(diff == 0, 0.0, np.where(tol > 0, found, np.inf))


def _relative(diff: np.ndarray, base: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """rel_diff: |diff| / |base| (0 when both are 0, inf when only base is); for non-numbers the diff itself."""
    magnitude = np.abs(np.where(numbers, base, np.nan))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scaled = diff / np.where(magnitude != 0, magnitude, 1.0)
    return np.where(~numbers, diff, np.where(magnitude != 0, scaled, np.where(diff == 0, 0.0, np.inf)))


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
    """The samples of every pair: the worst paired sample (largest |diff| / tolerance, the first on ties), its
    position in the base record's lists and values (float64, nan where no number or a bool), how many were
    paired and the cosine; ``shown``: the worst sample's values and the largest |diff| as a record holds them."""

    has: np.ndarray
    index: np.ndarray
    base: np.ndarray
    other: np.ndarray
    diff: np.ndarray
    tolerance: np.ndarray
    compared: np.ndarray
    cosine: np.ndarray
    shown: dict[int, tuple[Any, Any, Any]]
    noise: np.ndarray | None = None  # the noise level of every sample (nan: none); None without a calibration run
    largest: np.ndarray | None = None  # with a noise level: the largest |diff| of the paired samples


@dataclass
class Evaluation:
    pairs: Pairs
    unequal: np.ndarray  # a structure field or count differs
    moments: dict[str, Moment]
    samples: Samples


def _floats(values: Values) -> np.ndarray:
    """Values as float64, nan where None, a bool or of no number type."""
    hidden = np.zeros(values.floats.shape, bool) if values.null is None else values.null
    return np.where(hidden if values.odd is None else hidden | (values.odd != 0), np.nan, values.floats)


def evaluate(pairs: Pairs, config: CompareConfig, noise: np.ndarray | None = None, *,
             summaries: bool = True) -> Evaluation:
    """Every metric of ``pairs`` under ``config`` (see docs/compare.md); ``noise``: per pair and statistic
    (``NOISED``, a column each) the noise level, nan where there is none (``noise_levels``).

    ``summaries=False``: the samples' worst index, count, largest |diff| and cosine, which only a RecordDiff
    shows, are left at their defaults (None, 0, 0, 1); the verdicts (``verdicts``) do not read them.
    """
    unequal = np.logical_or.reduce(list(pairs.unequal.values()))
    numel = np.where(numbers(pairs.base["numel"]), pairs.base["numel"].floats, np.nan)
    single, aggregate = _bounds(config, pairs.precision, numel, pairs.scale, pairs.floor, pairs.phase)
    moments = {}
    for name in MOMENTS:
        base, other = pairs.base[name], pairs.other[name]
        compared = ~(base.null | other.null) if name in OPTIONAL_MOMENTS else ~(base.null & other.null)
        number = numbers(base)
        level = None if noise is None else noise[:, NOISED.index(name)]
        moments[name] = Moment(compared, difference(base, other, pairs.equal),
                               _tolerance(config, base.floats, level, number,
                                          aggregate if name in AGGREGATES else single), number, level)
    count = pairs.count
    level = None if noise is None else noise[:, NOISED.index("samples")]
    samples = Samples(np.zeros(count, dtype=bool), np.zeros(count, np.int64), np.zeros(count),
                      np.zeros(count), np.zeros(count), np.zeros(count), np.zeros(count, np.int64), np.ones(count), {},
                      level, None if level is None else np.zeros(count))
    for block in pairs.samples:
        _scan(block, pairs, config, samples, summaries, single)
    return Evaluation(pairs, unequal, moments, samples)


def _rule_rows(rule: tuple, rows: np.ndarray, column: bool) -> tuple:
    """A per-pair rule (``_bounds``) for the pairs ``rows``: as a column against their samples or as is."""
    return tuple(part if np.isscalar(part) else part[rows, None] if column else part[rows] for part in rule)


def _column_max(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per row ``max(0.0, v0, v1, ...)`` over the valid values (>= 0), as Python's max takes it (never a nan)."""
    return np.where(valid & (values > 0), values, 0.0).max(axis=1, initial=0.0)


# Pairs scanned at a time: each row's metrics are its own, and temporaries of a MB or so are reused
# from the allocator and the cache, where a block's worth (tens of MB) is fresh memory for every pass.
_SCAN_ROWS = 4096


def _scan(block: SampleBlock, pairs: Pairs, config: CompareConfig, found: Samples, summaries: bool, rule: tuple
          ) -> None:
    """The samples of the pairs of one block, into ``found``, a slice of rows at a time: the pairs whose
    samples are all valid numbers with a finite difference (the common case) on a shorter path."""
    for start in range(0, len(block.rows), _SCAN_ROWS):
        part = block.take(slice(start, start + _SCAN_ROWS))
        base, other = part.sides()
        raw = distance(base, other)
        plain = np.isfinite(raw).all(axis=1) & part.valid.all(axis=1) & (part.exact is None)
        for which, is_plain in ((plain, True), (~plain, False)):
            if which.all():  # the whole slice: no copy
                _scan_rows(part, base, other, raw, pairs, config, found, summaries, is_plain, rule)
            elif which.any():
                _scan_rows(part.take(which), base.take(which), other.take(which), raw[which], pairs, config, found,
                           summaries, is_plain, rule)


def _scan_rows(block: SampleBlock, base: Values, other: Values, raw: np.ndarray, pairs: Pairs,
               config: CompareConfig, found: Samples, summaries: bool, plain: bool, rule: tuple) -> None:
    """``_scan`` of pairs whose distances are ``raw``; ``plain``: every sample valid, every distance finite;
    ``rule``: the single values' rule of every pair (``_bounds``)."""
    valid, rows = block.valid, block.rows
    level = None if found.noise is None else found.noise[rows, None]
    per_sample = _rule_rows(rule, rows, True)
    if plain:  # no nan or inf to compare by equality, no padding: diff is raw, and its ratio can be no nan
        usable = valid
        diff = raw
        tol = _tolerance(config, base.floats, level, np.broadcast_to(True, raw.shape), per_sample)
        no_difference = diff == 0
        # _ratio(diff, tol) in place of a new block: tol >= 0 (rtol, atol >= 0), so a zero tolerance gives inf,
        # and no difference (0 / 0 too) is set to -1: never the worst. The tolerance is taken back below.
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            position_ratio = np.divide(diff, tol, out=tol)
        position_ratio[no_difference] = -1.0
    else:
        tol = _tolerance(config, base.floats, level, numbers(base), per_sample)
        usable = np.isfinite(raw) & valid  # a nan or inf on either side: must be the same value
        diff = np.where(usable, raw, np.where(same(base, other, pairs.equal), 0.0, np.inf))
        position_ratio = _ratio(diff, tol)
        position_ratio[~(valid & (diff != 0) & (position_ratio >= 0))] = -1.0  # nan (inf / inf) is never the worst
    at = np.argmax(position_ratio, axis=1)  # the first of the largest
    picked = np.arange(len(rows))
    worst_base, worst_other = base.take((picked, at)), other.take((picked, at))
    found.has[rows] = True
    found.base[rows], found.other[rows] = _floats(worst_base), _floats(worst_other)
    found.diff[rows] = difference(worst_base, worst_other, pairs.equal)
    # The tolerance is per value: that of the worst sample alone is the same number.
    found.tolerance[rows] = _tolerance(config, worst_base.floats, None if level is None else level[:, 0],
                                      numbers(worst_base), _rule_rows(rule, rows, False)) if plain else tol[picked, at]
    if found.largest is not None:
        found.largest[rows] = _column_max(diff, valid)
    if not summaries:
        return
    found.index[rows] = block.positions[picked, at]
    found.compared[rows] = valid.sum(axis=1)
    largest = _column_max(diff, valid)
    exact = _exact_largest(base, other, diff, usable, largest)
    for row, line in enumerate(rows.tolist()):
        found.shown[line] = (worst_base.value(row, pairs.objects), worst_other.value(row, pairs.objects),
                             exact.get(row, float(largest[row])))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        dot, base_norm, other_norm = (_row_sums(_products(first, second), usable)
                                      for first, second in ((base, other), (base, base), (other, other)))
        cosine = dot / np.sqrt(base_norm * other_norm)
    found.cosine[rows] = np.where((base_norm == 0) & (other_norm == 0), 1.0,
                                  np.where((base_norm == 0) | (other_norm == 0), 0.0, cosine))


def _row_sums(values: np.ndarray, take: np.ndarray) -> np.ndarray:
    """Per row the sum of the ``take`` entries of ``values``, in position order (as one loop over them adds)."""
    total = np.zeros(len(values))
    for j in range(values.shape[1]):
        column = take[:, j]
        total[column] += values[column, j]
    return total


def _both_ints(base: Values, other: Values) -> np.ndarray:
    return np.broadcast_to(both_ints(base, other), base.floats.shape)


def _products(first: Values, second: Values) -> np.ndarray:
    """Python's products of two samples as float64: integers' exact product rounded once (a float64 product of
    integers up to 2**53 is that product; larger ones are multiplied as Python ints)."""
    with np.errstate(over="ignore", invalid="ignore"):
        found = first.floats * second.floats
    wide = _both_ints(first, second) & ((np.abs(first.floats) > 2.0 ** 53) | (np.abs(second.floats) > 2.0 ** 53))
    for at in zip(*np.nonzero(wide)):
        found[at] = float(int(first.ints[at]) * int(second.ints[at]))
    return found


def _exact_largest(base: Values, other: Values, diff: np.ndarray, usable: np.ndarray, largest: np.ndarray
                   ) -> dict[int, int]:
    """Per row whose largest |diff| is a difference of two integers, that difference exactly (a Python int,
    as Python's max over the samples' differences keeps it)."""
    found = {}
    ints = _both_ints(base, other) & usable & (diff == largest[:, None]) & (largest[:, None] > 0)
    for row in np.flatnonzero(ints.any(axis=1)).tolist():
        at = np.flatnonzero(ints[row])
        found[row] = max(int(value) for value in exact_distance(base.ints[row, at], other.ints[row, at]))
    return found


def noise_levels(base: LoadedDump, noise: LoadedDump, rows: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Per pair ``rows`` of the base run and a calibration run (``perturbed_rounding``) and per statistic of
    ``NOISED`` (a column each): the noise level, how much calibration says the statistic moves (docs/compare.md,
    Noise floor).

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
    pairs = from_columns(base, noise, rows)[0]
    count = pairs.count
    changes = {}
    for name in MOMENTS:
        base, run = pairs.base[name], pairs.other[name]
        changes[name] = np.where(numbers(base) & numbers(run), difference(base, run, pairs.equal), 0.0)
    root = np.sqrt(_finite_count(pairs))
    per_value = np.where(root > 0, 1.0 / np.where(root > 0, root, 1.0), 0.0)
    values = np.maximum.reduce([changes["min"], changes["max"], changes["mean"], changes["norm"] * per_value])  # V
    floor = np.zeros(count)  # F
    for block in pairs.samples:
        base, run = block.sides()
        both = numbers(base) & numbers(run) & block.valid
        diffs = np.where(both, difference(base, run, pairs.equal), 0.0)
        values[block.rows] = np.maximum(values[block.rows], diffs.max(axis=1, initial=0.0))
        floor[block.rows] = np.where(root[block.rows] > 0, _rms(diffs, both) * per_value[block.rows], 0.0)
    levels = np.empty((count, len(NOISED)))
    with np.errstate(over="ignore"):
        for column, name in enumerate(NOISED):
            levels[:, column] = (values if name in ("min", "max", "samples") else
                                 np.maximum(changes[name], floor * root if name == "norm" else floor))
    levels[np.logical_or.reduce([pairs.unequal[name] for name in STRUCTURE])] = np.nan
    return levels


def _rms(diffs: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """Per row the root mean square of the ``numbers`` entries of ``diffs`` (0 where none): the squares of
    ``diffs / largest`` (no overflow) summed in position order, as one loop over the samples adds them."""
    largest = diffs.max(axis=1, initial=0.0)
    scale = np.where((largest > 0) & np.isfinite(largest), largest, 1.0)
    total = _row_sums(np.square(diffs / scale[:, None]), numbers)
    found = scale * np.sqrt(total / np.maximum(numbers.sum(axis=1), 1))
    return np.where(np.isfinite(largest), found, np.inf)


def _finite_count(pairs: Pairs) -> np.ndarray:
    """Per pair the base record's finite values: numel - nan - inf (0 where numel is no number)."""
    total = np.zeros(pairs.count)
    for name, sign in (("numel", 1.0), ("nan", -1.0), ("inf", -1.0)):
        values = pairs.base[name]
        total += sign * np.where(numbers(values), values.floats, 0.0)
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

    @classmethod
    def broken(cls, where: np.ndarray) -> "Measured":
        """Pairs that diverge where ``where`` says, by what only their RecordDiff shows (a structure field, a
        count, the hash): ratio inf, worst code 1; no relative error, no moments yet."""
        count = len(where)
        return cls(np.where(where, np.inf, 0.0), where.copy(), np.zeros(count),
                   np.where(where, WORST.index("structure"), 0).astype(np.int8), np.full(count, np.nan),
                   np.full(count, np.nan), np.zeros((count, 2), dtype=bool), {})

    def reordered(self, order: np.ndarray) -> "Measured":
        """The same, pairs reordered."""
        return Measured(self.ratio[order], self.diverged[order], self.rel_error[order], self.worst[order],
                        self.worst_base[order], self.worst_other[order], self.worst_null[order],
                        {key: values[order] for key, values in self.moments.items()},
                        None if self.noise_ratio is None else self.noise_ratio[order])


def verdicts(evaluated: Evaluation, config_factor: float = 0.0) -> Measured:
    """The RecordDiff verdicts (ratio, diverged, rel_error, worst) of every evaluated pair; with noise levels,
    also each pair's ratio to its noise floor (``config_factor``: the config's noise_factor)."""
    pairs = evaluated.pairs
    count = pairs.count
    unequal = evaluated.unequal
    found = Measured.broken(unequal)

    def broke(metric: str, diff: np.ndarray, tolerance: np.ndarray, where: np.ndarray, values_b: np.ndarray,
              values_o: np.ndarray, nulls: np.ndarray) -> None:
        new = _ratio(diff, tolerance)
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
        usable = moment.compared & moment.numbers
        scale = np.where(usable, np.maximum(scale, np.abs(np.where(usable, pairs.base[name].floats, 0.0))), scale)
    for name, moment in evaluated.moments.items():
        base, other = pairs.base[name], pairs.other[name]
        floats_b, floats_o = _floats(base), _floats(other)
        found.moments[("base", name)], found.moments[("other", name)] = floats_b, floats_o
        broke(name, moment.diff, moment.tolerance, moment.compared & ~unequal, floats_b, floats_o,
              np.stack([base.null, other.null], axis=1))
        magnitude = np.maximum(np.abs(np.where(moment.numbers, base.floats, 0.0)), scale)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            error = np.where(magnitude > 0, moment.diff / np.where(magnitude > 0, magnitude, 1.0), np.inf)
        found.rel_error = np.where(moment.compared & (moment.diff != 0), np.maximum(found.rel_error, error),
                                   found.rel_error)
    samples = evaluated.samples
    if samples.has.any():
        broke("samples", samples.diff, samples.tolerance, samples.has & ~unequal, samples.base, samples.other,
              np.zeros((count, 2), dtype=bool))
    if samples.noise is not None:
        found.noise_ratio = _noise_ratio(evaluated, config_factor)
    return found


def _noise_ratio(evaluated: Evaluation, factor: float) -> np.ndarray:
    """``Measured.noise_ratio`` of every pair: each metric's |diff| against its noise floor, the largest."""
    samples = evaluated.samples
    metrics = [(moment.diff, moment.noise, moment.compared) for moment in evaluated.moments.values()]
    metrics.append((samples.largest, samples.noise, samples.has))
    has_level = np.logical_or.reduce([level > 0 for _, level, _ in metrics])  # calibration measured something
    found = np.where(has_level, 0.0, np.nan)
    for diff, level, where in metrics:
        usable = where & ~np.isnan(level)
        with np.errstate(over="ignore"):
            new = _ratio(np.where(usable, diff, 0.0), factor * np.where(usable, level, 0.0))
        found = np.where(usable, np.maximum(found, new), found)
    return np.where(has_level & evaluated.unequal, np.inf, found)


def measure(base: LoadedDump, other: LoadedDump, rows: tuple[np.ndarray, np.ndarray], config: CompareConfig,
            noise: np.ndarray | None = None) -> Measured:
    """The verdicts of every pair ``rows``; ``noise``: each pair's noise level (nan: none)."""
    pairs, shown = from_columns(base, other, rows)
    found = verdicts(evaluate(pairs, config, noise, summaries=False), config.noise_factor)
    # The pairs whose exact values (integers, values from ``extra``) or samples paired by index only their
    # RecordDiff shows: marked as such (code 1: the plots build it), their values nan but finite numbers.
    marked = np.flatnonzero(pairs.integer | shown)
    found.worst[marked] = WORST.index("structure")
    for values in (found.worst_base, found.worst_other, *found.moments.values()):
        part = values[marked]
        values[marked] = np.where(np.isfinite(part), part, np.nan)
    if config.exact:  # a pair diverges when its hashes differ (both missing: the same), whatever the tolerances
        changed = differs(*(loaded.table.column("hash").take(pa.array(at, pa.int64()))
                            for loaded, at in ((base, rows[0]), (other, rows[1]))))
        exact = Measured.broken(changed)  # a RecordDiff shows the hash
        exact.rel_error, exact.moments = found.rel_error, found.moments  # they stay for the plots
        return exact
    return found


def _grown(ratio: np.ndarray, diverged: np.ndarray, value: np.ndarray, start: float) -> tuple[np.ndarray, float]:
    """One rank's records of one step, in execution order: (per record what it grew from where it is drift, nan
    where it is not; the largest ratio it carries on). ``start``: what the step before carried. A record within its
    tolerance carries its ratio on; one beyond it (by a value: ``value``) at most DRIFT_GROWTH times what was carried
    when it was computed is drift and carries its ratio on too; any other is a jump and carries nothing, and no
    record of the step after a jump is drift."""
    found = np.full(len(ratio), np.nan)
    within = np.where(diverged, 0.0, np.nan_to_num(ratio, nan=0.0))
    before = np.maximum(start, np.concatenate([[0.0], np.maximum.accumulate(within)[:-1]]))  # agreeing ones before
    grown = 0.0  # the largest drift before
    for position in np.flatnonzero(diverged).tolist():
        was = max(float(before[position]), grown)
        if not (value[position] and ratio[position] <= DRIFT_GROWTH * was):
            break  # a jump: what the step computes after it is propagated from a divergence, not drift
        found[position] = was
        grown = max(grown, float(ratio[position]))
    return found, max(float(within.max(initial=0.0)), grown)


Carried = tuple[float, float]  # of a step: (its largest ratio, what it carries on into the next: ``carried``)


def carried(rank: np.ndarray, step: np.ndarray, ratio: np.ndarray, diverged: np.ndarray, worst: np.ndarray,
            before: Mapping[tuple[int, int], Carried] | None = None) -> dict[tuple[int, int], Carried]:
    """(rank, step) -> (its largest ratio, what it carries on into the next step) of the pairs given in execution
    order (their ratio, raw verdict and worst metric code; ``before``: the same of steps before them). A step carries
    on the largest ratio of its records but the jumps, a jump judged against the largest ratio of the step before:
    two steps decide it, never a chain of them, so that a window reading the two steps before it judges as a
    comparison of every step does."""
    value = _by_value(ratio, diverged, worst)
    found: dict[tuple[int, int], Carried] = dict(before or {})
    groups = _groups(rank, step)
    for key, previous in _previous([*found, *groups]):
        if key in groups:
            rows = groups[key]
            start = found[previous][0] if previous is not None else 0.0
            found[key] = (float(np.nan_to_num(ratio[rows], nan=0.0).max(initial=0.0)),
                          _grown(ratio[rows], diverged[rows], value[rows], start)[1])
    return found


def _previous(keys: list[tuple[int, int]]) -> list[tuple[tuple[int, int], tuple[int, int] | None]]:
    """Each (rank, step) in order with its rank's step before among ``keys`` (None: its rank's first)."""
    last: dict[int, tuple[int, int]] = {}
    found = []
    for key in sorted(set(keys)):
        found.append((key, last.get(key[0])))
        last[key[0]] = key
    return found


def _by_value(ratio: np.ndarray, diverged: np.ndarray, worst: np.ndarray) -> np.ndarray:
    """The pairs that diverged by a value (a moment or the samples, a finite ratio): only these can be drift."""
    return diverged & np.isfinite(ratio) & (worst > 1)


def _groups(rank: np.ndarray, step: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """(rank, step) -> its rows, in order."""
    if not len(rank):
        return {}
    keys, inverse = np.unique(np.stack([rank, step], axis=1).astype(np.int64), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(keys) + 1))
    return {(int(r), int(s)): order[bounds[i]:bounds[i + 1]] for i, (r, s) in enumerate(keys.tolist())}


def drift(rank: np.ndarray, step: np.ndarray, measured: Measured, before: Mapping[tuple[int, int], Carried]
          ) -> np.ndarray:
    """Per pair (in execution order) what it grew from where the pair is drift, nan where it is not (docs/compare.md,
    Drift): it diverged by a value at most DRIFT_GROWTH times what was carried when it was computed: what its rank's
    step before carried on (``carried``; ``before``: that of the steps before the pairs' first), or the ratio of a
    record of its own step and rank before it that is not a jump. A rank's first step carries nothing in."""
    found = np.full(len(measured.ratio), np.nan)
    value = _by_value(measured.ratio, measured.diverged, measured.worst)
    if not value.any():
        return found
    groups = _groups(rank, step)
    into = carried(rank, step, measured.ratio, measured.diverged, measured.worst, before)
    for key, previous in _previous(list(into)):
        rows = groups.get(key)
        if previous is not None and rows is not None and value[rows].any():
            found[rows] = _grown(measured.ratio[rows], measured.diverged[rows], value[rows], into[previous][1])[0]
    return found


def record_diffs(base_dump: LoadedDump, other_dump: LoadedDump, rows: tuple[np.ndarray, np.ndarray],
                 config: CompareConfig, noise: np.ndarray | None = None) -> list[RecordDiff]:
    """One RecordDiff per pair ``rows`` (base rows, other rows: the same rank, step, phase and name), read from
    the evaluation of the pairs; ``noise``: as ``evaluate``'s (None: no calibration run). With ``config.exact``
    the one metric is the hash."""
    count = len(rows[0])
    keys = _keys(base_dump, rows[0])
    levels = None if noise is None else np.asarray(noise, np.float64).reshape(count, len(NOISED))
    shown_levels = [None if levels is None else _levels(levels[row]) for row in range(count)]
    if config.exact:
        hashes = zip(*(_record_values(loaded, at, HASH, None) for loaded, at in ((base_dump, rows[0]),
                                                                                 (other_dump, rows[1]))))
        return [_hash_diff(key, pair, level) for key, pair, level in zip(keys, hashes, shown_levels)]
    pairs = from_columns(base_dump, other_dump, rows)[0]
    evaluated = evaluate(pairs, config, levels)
    sizes = {key: np.where(numbers(pairs.base[key]) & numbers(pairs.other[key]),
                           difference(pairs.base[key], pairs.other[key], pairs.equal), np.inf) for key in COUNTS}
    relative = {name: _relative(moment.diff, pairs.base[name].floats, moment.numbers)
                for name, moment in evaluated.moments.items()}
    samples = evaluated.samples
    relative["samples"] = _relative(samples.diff, samples.base, np.isfinite(samples.base))
    found = []
    for row, key in enumerate(keys):
        metrics = []
        for name in (*STRUCTURE, *COUNTS):
            if pairs.unequal[name][row]:
                if name in pairs.base:
                    shown = [side[name].value(row, pairs.objects) for side in (pairs.base, pairs.other)]
                else:
                    shown = [side.python(name, row) for side in pairs.sides]
                metrics.append(MetricDiff(name, *shown, float(sizes[name][row]) if name in COUNTS else math.inf,
                                          math.inf, 0.0))
        for name, moment in evaluated.moments.items():
            if moment.compared[row]:
                metrics.append(MetricDiff(name, pairs.base[name].value(row, pairs.objects),
                                          pairs.other[name].value(row, pairs.objects), float(moment.diff[row]),
                                          float(relative[name][row]), float(moment.tolerance[row]),
                                          floor=_floor(config, moment.noise, row)))
        record = RecordDiff(*key, metrics, noise=shown_levels[row])
        if samples.has[row]:
            value_b, value_o, largest = samples.shown[row]
            metrics.append(MetricDiff("samples", value_b, value_o, float(samples.diff[row]),
                                      float(relative["samples"][row]), float(samples.tolerance[row]),
                                      pairs.sides[0].python("sample_indices", row)[samples.index[row]],
                                      floor=_floor(config, samples.noise, row)))
            record.samples_compared = int(samples.compared[row])
            record.samples_max_abs = largest
            record.samples_cosine = float(samples.cosine[row])
        if pairs.shifted[row]:
            record.notes.append(f"sample_indices differ: compared the {int(samples.compared[row])} common positions")
        found.append(record)
    return found


def _record_values(loaded: LoadedDump, rows: np.ndarray, name: str, absent: Any) -> list[Any]:
    """A key's value in the records of ``rows`` as the records hold it (``absent``: where a record has none)."""
    part = loaded.table.select([name, "nulls", "extra"]).take(pa.array(rows, pa.int64()))
    found = []
    for value, nulls, extra in zip(*(part.column(column).to_pylist() for column in (name, "nulls", "extra"))):
        if value is None and extra is not None:
            value = json.loads(extra).get(name, value)
        found.append(value if value is not None or (nulls and name in nulls) else absent)
    return found


def _keys(loaded: LoadedDump, rows: np.ndarray) -> list[tuple[int, int, str, str, Any]]:
    """(rank, step, phase, name, seq) of the records of ``rows``."""
    return list(zip(loaded.rank[rows].tolist(), loaded.step[rows].tolist(), loaded.column("phase", rows),
                    loaded.column("name", rows), _record_values(loaded, rows, "seq", 0)))


def _levels(row: np.ndarray) -> dict[str, float] | None:
    """A record's noise levels by statistic (those it has), None when it has none."""
    return {name: float(level) for name, level in zip(NOISED, row.tolist()) if not math.isnan(level)} or None


def _floor(config: CompareConfig, levels: np.ndarray | None, row: int) -> float | None:
    """A metric's noise floor: noise_factor x its noise level (None: no level)."""
    if levels is None or math.isnan(levels[row]):
        return None
    return config.noise_factor * float(levels[row])  # Python floats: an overflow is inf, no warning


def _hash_diff(key: tuple, hashes: tuple[Any, Any], noise: dict[str, float] | None) -> RecordDiff:
    """The exact comparison of one pair: its hashes (hex), equal or not; no tolerance."""
    same_hash = hashes[0] == hashes[1]
    size = 0.0 if same_hash else math.inf
    shown = [None if value is None else hex_hash(value) for value in hashes]
    record = RecordDiff(*key, [MetricDiff(HASH, shown[0], shown[1], size, size, 0.0)], noise=noise)
    record.notes.append(BIT_IDENTICAL if same_hash else BYTES_DIFFER)
    return record
