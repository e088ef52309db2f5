"""Every metric of every matched pair at once: the rules of ``rules`` applied to ``pairs``.

    evaluated = evaluate(pairs, config, noise)     # noise: per pair and statistic (NOISED) the level, or None
    evaluated.moments["mean"].diff; evaluated.samples.cosine
    levels = noise_level(pairs)                    # pairs of the base run and a calibration run: (pairs, NOISED)

``vector`` reduces an evaluation to verdicts (ratio, diverged, the worst metric), ``details`` turns the one of
a few pairs into RecordDiff objects: both read what is computed here, nothing else decides a metric.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .options import AGGREGATES, MOMENTS, OPTIONAL_MOMENTS, STRUCTURE, CompareConfig
from .pairs import Pairs, SampleBlock
from .rules import as_floats, bounds, difference, distance, finite, ratio, same, tolerance

__all__ = ["NOISED", "Evaluation", "Moment", "Samples", "evaluate", "noise_level"]

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
    shows, are left at their defaults (None, 0, 0, 1); the verdicts (``vector``) do not read them.
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
        moments[name] = Moment(compared, difference(values_b, values_o, null_b, null_o),
                               tolerance(config, values_b, level, numbers, aggregate if name in AGGREGATES else single),
                               numbers, level)
    return Evaluation(pairs, unequal, moments,
                      _samples(pairs, config, None if noise is None else noise[:, NOISED.index("samples")], summaries,
                               single))


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
        changes[name] = np.where(numbers, difference(values_b, values_n), 0.0)
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
