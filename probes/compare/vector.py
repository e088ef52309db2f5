"""Every matched pair's verdict at once: matching by key, then the metrics of ``metrics`` reduced per pair.

    rows = match(base, other)                           # (base rows, other rows) with the same key
    measured = measure(base, other, rows, config)       # per pair: ratio, diverged, rel_error, the worst metric
    measured = measure(base, other, rows, CompareConfig(exact=True))   # the verdicts of the hashes instead
    levels = noise_levels(base, noise_run, rows)        # per pair and statistic: the noise level (nan: none)

Pairs are read from their float64 columns (``pairs.from_columns``); those a column cannot hold exactly go
through ``pairs.from_records``: the same rules either way (``rules``), so the verdicts are the RecordDiffs'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import MOMENTS, CompareConfig
from .metrics import Evaluation, evaluate, noise_level
from .pairs import context_of, from_columns, from_records
from .reading import LoadedDump, one_key
from .rules import as_floats, finite, ratio

__all__ = ["WORST", "Measured", "match", "measure", "noise_levels"]


def match(base: LoadedDump, other: LoadedDump) -> tuple[np.ndarray, np.ndarray]:
    """(base rows, other rows) of the keys both dumps hold, in base row order; keys are unique per dump."""
    if not len(base) or not len(other):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if len(base) == len(other) and np.array_equal(base.rank, other.rank) and np.array_equal(base.step, other.step) \
            and all(base.table.column(name).equals(other.table.column(name)) for name in ("phase", "name")):
        return np.arange(len(base)), np.arange(len(base))  # the common case: the same keys in the same order
    side = np.concatenate([np.zeros(len(base), np.int64), np.ones(len(other), np.int64)])
    row = np.concatenate([np.arange(len(base)), np.arange(len(other))])
    columns = [np.concatenate([base.rank, other.rank]), np.concatenate([base.step, other.step])]
    for name in ("phase", "name"):
        values = pc.unique(pa.concat_arrays([base.table.column(name).combine_chunks(),
                                             other.table.column(name).combine_chunks()]))
        columns.append(np.concatenate([base.codes(name, values)[0], other.codes(name, values)[0]]))
    key = one_key(columns)
    if key is not None:  # one int64 key: a faster sort
        order = np.lexsort((side, key))
        ordered = key[order]
        same = ordered[1:] == ordered[:-1]
    else:
        order = np.lexsort((side, *reversed(columns)))
        same = np.ones(len(order) - 1, dtype=bool)
        for column in columns:
            ordered = column[order]
            same &= ordered[1:] == ordered[:-1]
    first = np.flatnonzero(same)  # a key in both: base's row, then other's (side sorts last)
    base_rows, other_rows = row[order[first]], row[order[first + 1]]
    by_base = np.argsort(base_rows, kind="stable")
    return base_rows[by_base], other_rows[by_base]


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
    pairs, exact = from_columns(base, other, rows)
    found = verdicts(evaluate(pairs, config, noise, summaries=False), config.noise_factor)
    odd = np.flatnonzero(exact)
    if len(odd):
        part = verdicts(evaluate(from_records(base.records_at(rows[0][odd]), other.records_at(rows[1][odd]),
                                              context_of(base, rows[0][odd])), config,
                                 None if noise is None else noise[odd], summaries=False), config.noise_factor)
        part.worst[:] = WORST.index("structure")  # plots build these records to show them
        found.put(odd, part)
    if config.exact:
        _hash_verdicts(found, base, other, rows)
    return found


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
    """Per pair of the base run and a calibration run (``rows``) and per statistic (``metrics.NOISED``, a
    column each): the noise level, nan where there is none."""
    pairs, exact = from_columns(base, noise, rows)
    levels = noise_level(pairs)
    odd = np.flatnonzero(exact)
    if len(odd):
        levels[odd] = noise_level(from_records(base.records_at(rows[0][odd]), noise.records_at(rows[1][odd])))
    return levels
