"""The tolerance checks of ``engine.compare_records``, on whole columns: every matched pair at once.

    pairs = match(base, other)                          # (base rows, other rows) with the same key
    measured = measure(base, other, pairs, config)      # per pair: ratio, diverged, rel_error
    measured.irregular                                  # pairs left to compare_records (see below)

The rules are ``compare_records``'s, value for value (tests/compare/test_compare_vector.py holds the two
together on adversarial records): structure and counts must be equal, moments and samples within
``config.tolerance``, a non-finite value must be the same on both sides. Pairs the columns cannot say
everything about are *irregular* and left to ``compare_records`` by the caller: a value kept in
``extra`` or as an exact integer (``*_int``), samples of different lengths or at different positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import COUNTS, MOMENTS, OPTIONAL_MOMENTS, CompareConfig
from .reading import LoadedDump

__all__ = ["Measured", "match", "measure", "noise_levels"]


def match(base: LoadedDump, other: LoadedDump) -> tuple[np.ndarray, np.ndarray]:
    """(base rows, other rows) of the keys both dumps hold, in base row order; keys are unique per dump."""
    if not len(base) or not len(other):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    side = np.concatenate([np.zeros(len(base), np.int64), np.ones(len(other), np.int64)])
    row = np.concatenate([np.arange(len(base)), np.arange(len(other))])
    columns = [np.concatenate([base.rank, other.rank]), np.concatenate([base.step, other.step])]
    for name in ("phase", "name"):
        values = pc.unique(pa.concat_arrays([base.table.column(name).combine_chunks(),
                                             other.table.column(name).combine_chunks()]))
        columns.append(np.concatenate([base.codes(name, values)[0], other.codes(name, values)[0]]))
    bits = [int(column.max()).bit_length() if len(column) else 0 for column in columns]
    if min(int(column.min()) for column in columns) >= 0 and sum(bits) <= 62:  # one int64 key: a faster sort
        key = np.zeros(len(side), np.int64)
        for column, width in zip(columns, bits):
            key = (key << width) | column
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


WORST = ("", "structure", *MOMENTS, "samples")  # codes of Measured.worst: 0 none, 1 a structure field or count


@dataclass
class Measured:
    """Per matched pair: the largest |diff| / tolerance, whether a metric broke, the moments' relative error,
    and which metric was the worst (``WORST[code]``, the first of the largest ratio) with its two values."""

    ratio: np.ndarray
    diverged: np.ndarray
    rel_error: np.ndarray
    irregular: np.ndarray  # bool: compare_records must decide these pairs (the rest is not set)
    worst: np.ndarray
    worst_base: np.ndarray  # nan where the value is None (see worst_null)
    worst_other: np.ndarray
    worst_null: np.ndarray  # (count, 2) bool: the worst metric's base / other value is None
    moments: dict[tuple[str, str], np.ndarray]  # ("base" | "other", moment) -> values (nan where absent)

    def take(self, order: np.ndarray) -> "Measured":
        """The same, pairs reordered."""
        return Measured(*(getattr(self, name)[order] for name in ("ratio", "diverged", "rel_error", "irregular",
                                                                    "worst", "worst_base", "worst_other",
                                                                    "worst_null")),
                        {key: values[order] for key, values in self.moments.items()})


_COMPARED = ("shape", "dtype", "numel", *COUNTS, *MOMENTS, "samples", "sample_indices", "extra", "min_int",
             "max_int", "samples_int")


class _Columns:
    """The compared columns of one side's matched rows as numpy arrays (nulls as a mask)."""

    def __init__(self, loaded: LoadedDump, rows: np.ndarray) -> None:
        table = loaded.table.select(list(_COMPARED))
        if not (len(rows) == table.num_rows and np.array_equal(rows, np.arange(len(rows)))):
            table = table.take(pa.array(rows, pa.int64()))
        self.table = table

    def floats(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        column = self.table.column(name)
        values = column.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        return values, pc.is_null(column).to_numpy(zero_copy_only=False)

    def present(self, name: str) -> np.ndarray:
        return pc.is_valid(self.table.column(name)).to_numpy(zero_copy_only=False)

    def strings(self, name: str) -> np.ndarray:
        return np.array(self.table.column(name).to_pylist(), dtype=object)

    def lists(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat values, start offset per row, length per row; -1 for a null list), over every chunk."""
        values, starts, lengths = [], [], []
        base = 0
        for chunk in self.table.column(name).chunks:
            offsets = chunk.offsets.to_numpy()  # they index the chunk's whole child array
            child = chunk.values.to_numpy(zero_copy_only=False)
            values.append(child)
            starts.append(offsets[:-1] + base)
            lengths.append(np.where(chunk.is_null().to_numpy(zero_copy_only=False), -1, np.diff(offsets)))
            base += len(child)
        if not values:
            return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return (np.concatenate(values), np.concatenate(starts).astype(np.int64, copy=False),
                np.concatenate(lengths).astype(np.int64, copy=False))


def _same_lists(a: tuple, b: tuple) -> np.ndarray:
    """Per row: the two lists are equal (both null counts as equal; a null element equals a null element)."""
    values_a, starts_a, lengths_a = a
    values_b, starts_b, lengths_b = b
    same = lengths_a == lengths_b
    if same.all() and len(values_a) == len(values_b) and np.array_equal(starts_a, starts_b):
        if not len(values_a) or np.array_equal(values_a, values_b):
            return same
        # One layout on both sides: compare the flat values once, then per row.
        unequal = ~((values_a == values_b) | (_isnan(values_a) & _isnan(values_b)))
        running = np.concatenate([[0], np.cumsum(unequal)])
        return running[starts_a + np.maximum(lengths_a, 0)] == running[starts_a]
    for length in np.unique(lengths_a[same & (lengths_a > 0)]):
        rows = np.flatnonzero(same & (lengths_a == length))
        block_a = values_a[starts_a[rows, None] + np.arange(length)]
        block_b = values_b[starts_b[rows, None] + np.arange(length)]
        equal = (block_a == block_b) | (_isnan(block_a) & _isnan(block_b))
        same[rows] = equal.all(axis=1)
    return same


def _exact_only(*sides: _Columns) -> np.ndarray:
    """The pairs with a value only a record holds exactly (in ``extra`` or an ``*_int`` column)."""
    found = np.zeros(sides[0].table.num_rows, dtype=bool)
    for side in sides:
        for name in ("extra", "min_int", "max_int", "samples_int"):
            found |= side.present(name)
    return found


def _samples(a: _Columns, b: _Columns) -> tuple[tuple, tuple, np.ndarray, np.ndarray]:
    """Both sides' samples, the pairs where both have samples and positions, and those of them (``regular``)
    whose samples are at the same positions, as many as the positions: the ones compared on columns."""
    samples_a, samples_b = a.lists("samples"), b.lists("samples")
    indices_a, indices_b = a.lists("sample_indices"), b.lists("sample_indices")
    have = (samples_a[2] >= 0) & (samples_b[2] >= 0) & (indices_a[2] >= 0) & (indices_b[2] >= 0)
    regular = have & _same_lists(indices_a, indices_b) & (samples_a[2] == samples_b[2]) \
        & (samples_a[2] == indices_a[2])
    return samples_a, samples_b, have, regular


def _rows_of(lists: tuple[np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray, length: int) -> np.ndarray:
    """The ``rows``' lists, each of ``length`` values, as a (rows, length) array (a view when they are stored
    back to back, as a step file stores them)."""
    values, starts, _ = lists
    if len(rows) and starts[rows[0]] + len(rows) * length <= len(values) \
            and np.array_equal(starts[rows], starts[rows[0]] + np.arange(len(rows)) * length):
        return values[starts[rows[0]]:starts[rows[0]] + len(rows) * length].reshape(len(rows), length)
    return values[starts[rows, None] + np.arange(length)]


def _isnan(values: np.ndarray) -> np.ndarray:
    return np.isnan(values) if values.dtype.kind == "f" else np.zeros(values.shape, dtype=bool)


def _tolerance(config: CompareConfig, base: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
    """``config.tolerance`` per value: atol + rtol * |base| (atol for a non-finite base), or the noise bound."""
    fixed = np.abs(base)
    with np.errstate(invalid="ignore", over="ignore"):
        fixed *= config.rtol
        fixed += config.atol
    odd = ~np.isfinite(base)
    if odd.any():
        fixed[odd] = config.atol
    if noise is None:
        return fixed
    with np.errstate(over="ignore"):
        bound = config.noise_factor * np.nan_to_num(noise, nan=0.0)
    return np.where(np.nan_to_num(noise, nan=0.0) > 0, np.maximum(fixed, bound), fixed)


def _diff(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """|other - base|; where either is not finite: 0 if they are the same value, else inf."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(other - base)
    odd = ~np.isfinite(diff)  # a nan or inf on either side, or a difference too large for a float
    if odd.any():
        b, o = base[odd], other[odd]
        same = (b == o) | (np.isnan(b) & np.isnan(o))
        diff[odd] = np.where(np.isfinite(b) & np.isfinite(o), np.inf, np.where(same, 0.0, np.inf))
    return diff


def _ratio(diff: np.ndarray, tolerance: np.ndarray) -> np.ndarray:
    """MetricDiff.ratio: 0 for no difference, else |diff| / tolerance (inf for a tolerance of 0)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = diff / tolerance
    fix = (diff == 0) | ~(tolerance > 0)
    if fix.any():
        ratio[fix] = np.where(diff[fix] == 0, 0.0, np.inf)
    return ratio


def measure(base: LoadedDump, other: LoadedDump, pairs: tuple[np.ndarray, np.ndarray], config: CompareConfig,
            noise: np.ndarray | None = None) -> Measured:
    """The tolerance checks of every pair (see the module docstring); ``noise``: each pair's noise level (nan: none)."""
    b, o = _Columns(base, pairs[0]), _Columns(other, pairs[1])
    count = len(pairs[0])
    ratio = np.zeros(count)
    diverged = np.zeros(count, dtype=bool)
    irregular = _exact_only(b, o)

    worst = np.zeros(count, np.int8)
    worst_base, worst_other = np.full(count, np.nan), np.full(count, np.nan)
    worst_null = np.zeros((count, 2), dtype=bool)
    no_nulls = np.zeros((count, 2), dtype=bool)

    def broke(metric: str, diff: np.ndarray, tolerance: np.ndarray, where: np.ndarray, values_b: np.ndarray,
              values_o: np.ndarray, nulls: np.ndarray = no_nulls) -> None:
        nonlocal ratio, diverged
        new = _ratio(diff, tolerance)
        # RecordDiff.worst: the first metric, replaced by a later one of a larger ratio (never by a nan ratio,
        # which inf / inf gives: Python's comparisons, as compare_records makes them)
        larger = where & ((worst == 0) | (new > ratio))
        worst[larger] = WORST.index(metric)
        worst_base[larger], worst_other[larger] = values_b[larger], values_o[larger]
        worst_null[larger] = nulls[larger]
        ratio = np.where(larger, new, ratio)
        diverged |= where & (diff > tolerance)

    # Structure and counts: equal or diverged (tolerance 0).
    shape_b, shape_o = b.lists("shape"), o.lists("shape")
    same_shape = _same_lists(shape_b, shape_o)
    unequal = ~same_shape
    dtype_b, dtype_o = b.strings("dtype"), o.strings("dtype")
    unequal |= dtype_b != dtype_o
    for name in ("numel", *COUNTS):
        values_b, null_b = b.floats(name)
        values_o, null_o = o.floats(name)
        unequal |= (null_b != null_o) | (~null_b & ~null_o & (values_b != values_o))
    ratio[unequal] = np.inf
    diverged |= unequal
    worst[unequal] = WORST.index("structure")

    # Moments; and their relative error against the record's magnitude (RecordDiff.rel_error).
    moments = {name: (b.floats(name), o.floats(name)) for name in MOMENTS}
    scale = np.zeros(count)
    for name in ("min", "max"):
        (values_b, null_b), (_, null_o) = moments[name]
        compared = ~(null_b & null_o)
        usable = compared & ~null_b & np.isfinite(values_b)
        scale = np.where(usable, np.maximum(scale, np.abs(np.where(usable, values_b, 0.0))), scale)
    rel_error = np.zeros(count)
    for name, ((values_b, null_b), (values_o, null_o)) in moments.items():
        compared = ~(null_b | null_o) if name in OPTIONAL_MOMENTS else ~(null_b & null_o)
        one_null = null_b != null_o
        diff = np.where(one_null, np.inf, _diff(values_b, values_o))
        tolerance = _tolerance(config, np.where(null_b, np.nan, values_b), noise)
        broke(name, diff, tolerance, compared & ~unequal, values_b, values_o, np.stack([null_b, null_o], axis=1))
        magnitude = np.maximum(np.where(~null_b & np.isfinite(values_b), np.abs(np.nan_to_num(values_b)), 0.0), scale)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            error = np.where(magnitude > 0, diff / np.where(magnitude > 0, magnitude, 1.0), np.inf)
        rel_error = np.where(compared & (diff != 0), np.maximum(rel_error, error), rel_error)

    # Samples, where the shapes are equal and both records have them at the same positions.
    samples_b, samples_o, have, regular = _samples(b, o)
    have &= same_shape
    regular &= same_shape
    irregular |= have & ~regular
    for length in np.unique(samples_b[2][regular & (samples_b[2] > 0)]):
        rows = np.flatnonzero(regular & (samples_b[2] == length))
        values_b, values_o = _rows_of(samples_b, rows, length), _rows_of(samples_o, rows, length)
        diff = _diff(values_b, values_o)
        level = None if noise is None else noise[rows, None]
        tolerance = _tolerance(config, values_b, level)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            position_ratio = diff / tolerance
        position_ratio[diff == 0] = -1.0
        odd = ~(position_ratio >= 0)  # nan (inf / inf) is never the worst: nan > x is false
        if odd.any():
            position_ratio[odd] = np.where(np.isnan(position_ratio[odd]), -1.0, position_ratio[odd])
        at = np.argmax(position_ratio, axis=1)  # the first of the largest, as compare_records scans
        picked = np.arange(len(rows))
        picked_values: dict[str, np.ndarray] = {}
        where = np.zeros(count, dtype=bool)
        where[rows] = ~unequal[rows]
        for name, values in (("diff", diff), ("tolerance", tolerance), ("base", values_b), ("other", values_o)):
            full = np.zeros(count)
            full[rows] = values[picked, at]
            picked_values[name] = full
        broke("samples", picked_values["diff"], picked_values["tolerance"], where, picked_values["base"],
              picked_values["other"])
    moment_values = {(run, name): np.where(nulls, np.nan, values) for name, pair in moments.items()
                     for run, (values, nulls) in zip(("base", "other"), pair)}
    return Measured(ratio, diverged, rel_error, irregular, worst, worst_base, worst_other, worst_null, moment_values)


def noise_levels(base: LoadedDump, noise: LoadedDump, pairs: tuple[np.ndarray, np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``engine.record_noise`` per pair (nan where there is none), and the pairs it must decide itself."""
    b, n = _Columns(base, pairs[0]), _Columns(noise, pairs[1])
    count = len(pairs[0])
    irregular = _exact_only(b, n)
    same = _same_lists(b.lists("shape"), n.lists("shape")) & (b.strings("dtype") == n.strings("dtype"))
    values_b, null_b = b.floats("numel")
    values_n, null_n = n.floats("numel")
    same &= (null_b == null_n) & (null_b | (values_b == values_n))
    level = np.zeros(count)
    for name in MOMENTS:
        (values_b, _), (values_n, _) = b.floats(name), n.floats(name)
        usable = np.isfinite(values_b) & np.isfinite(values_n)
        with np.errstate(invalid="ignore", over="ignore"):
            level = np.where(usable, np.maximum(level, np.abs(values_n - values_b)), level)
    samples_b, samples_n, have, regular = _samples(b, n)
    irregular |= same & have & ~regular
    for length in np.unique(samples_b[2][same & regular & (samples_b[2] > 0)]):
        rows = np.flatnonzero(same & regular & (samples_b[2] == length))
        block_b, block_n = _rows_of(samples_b, rows, length), _rows_of(samples_n, rows, length)
        usable = np.isfinite(block_b) & np.isfinite(block_n)
        with np.errstate(invalid="ignore", over="ignore"):
            level[rows] = np.maximum(level[rows], np.where(usable, np.abs(block_n - block_b), 0.0).max(axis=1))
    return np.where(same, level, np.nan), irregular
