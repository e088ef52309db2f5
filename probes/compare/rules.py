"""The comparison rules, defined once, on whole arrays: tolerance, difference, ratio, noise bound, sample pairing.

    tolerance(config, base, noise, rule=r)  # per value: max(atol + rtol * max(|base|, scale), noise_factor * noise)
    bounds(config, precision, numel, mean, std, floor, phase)  # per pair the (rtol, atol, scale) of values, of moments
    precisions(dtypes, codes, groups)       # per record the precision it is compared at (its step's dtypes)
    scale_floors(rms(numel, mean, std), groups)  # per record the largest rms of its group (a module's parameters)
    difference(base, other)                 # |other - base|; a non-number or non-finite value must be the same
    relative(diff, base); ratio(diff, tol)  # rel_diff and |diff| / tolerance, as MetricDiff keeps them
    pair_samples(b_idx, b_val, o_idx, o_val)  # (index, base, other) at the positions both records sampled

Arrays are float64 (values a column holds), int64 (an integer tensor's values, ``*_int`` columns: subtracted
exactly, ``int_distance``) or object (Python values as a record holds them: values kept in ``extra``, the
RecordDiffs' pairs); the same function serves all, so an exact integer is subtracted exactly and a non-number
compares by Python equality. A None value is passed as a separate ``null`` mask. docs/compare.md states the rules in words.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .options import EXACT, MOMENT_PASSES, PRECISIONS, CompareConfig, coarseness, precision_of
from .results import is_finite_number

__all__ = ["as_floats", "bounds", "difference", "distance", "finite", "int_distance", "pair_samples", "precisions",
           "ratio", "relative", "rms", "same", "scale_floors", "tolerance"]


def finite(values: np.ndarray) -> np.ndarray:
    """``is_finite_number`` of each value (a bool is no number)."""
    if values.dtype.kind == "f":
        return np.isfinite(values)
    if values.dtype.kind == "i":
        return np.ones(values.shape, dtype=bool)
    return np.frompyfunc(is_finite_number, 1, 1)(values).astype(bool)


def as_floats(values: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """The values as float64 where ``numbers`` (nan elsewhere): what the tolerance and rel_diff divide by."""
    if values.dtype.kind == "f":
        return np.where(numbers, values, np.nan)
    found = np.full(values.shape, np.nan)
    found[numbers] = values[numbers].astype(np.float64)
    return found


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def same(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per pair: the same value (nan equals nan)."""
    if base.dtype.kind == "f" and other.dtype.kind == "f":
        return (base == other) | (np.isnan(base) & np.isnan(other))
    if base.dtype.kind == "i" and other.dtype.kind == "i":
        return base == other
    return np.frompyfunc(_same_value, 2, 1)(base, other).astype(bool)


def int_distance(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """|other - base| of int64 values, exact (it fits a uint64), then rounded to float64 as Python's float()
    rounds the exact integer: what an integer tensor's values are compared by."""
    with np.errstate(over="ignore"):
        base_bits, other_bits = base.view(np.uint64), other.view(np.uint64)
        return np.where(other >= base, other_bits - base_bits, base_bits - other_bits).astype(np.float64)


def difference(base: np.ndarray, other: np.ndarray, null_base: np.ndarray | None = None,
               null_other: np.ndarray | None = None) -> np.ndarray:
    """|other - base| of two finite numbers (integers exactly, then as a float); otherwise 0 when both are the
    same value (None only equals None), else inf."""
    null_base = np.zeros(base.shape, bool) if null_base is None else null_base
    null_other = np.zeros(other.shape, bool) if null_other is None else null_other
    numbers = finite(base) & finite(other) & ~null_base & ~null_other
    diff = np.where(np.where(null_base | null_other, null_base & null_other, same(base, other)), 0.0, np.inf)
    if numbers.any():
        if base.dtype.kind == "i" and other.dtype.kind == "i":
            found = int_distance(base[numbers], other[numbers])
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                found = np.abs(other[numbers] - base[numbers])
        diff[numbers] = found.astype(np.float64)
    return diff


def relative(diff: np.ndarray, base: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """rel_diff: |diff| / |base| (0 when both are 0, inf when only base is); for non-numbers the diff itself."""
    magnitude = np.abs(as_floats(base, numbers))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scaled = diff / np.where(magnitude != 0, magnitude, 1.0)
    return np.where(~numbers, diff, np.where(magnitude != 0, scaled, np.where(diff == 0, 0.0, np.inf)))


def precisions(dtypes: list[str | None], codes: np.ndarray, groups: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(precision names, per row the index of its precision): a floating-point record is compared at the least
    precise of its own dtype and every floating-point dtype of its group (its rank and step: a float32 tensor
    computed from bfloat16 ones carries their rounding); an integer or bool one exactly.

    ``dtypes``: the distinct dtype names; ``codes``: per row the index of its dtype in them; ``groups``: per
    row its group, 0 to n - 1."""
    names = [EXACT.name, *sorted(PRECISIONS, key=lambda name: coarseness(PRECISIONS[name]))]
    level = np.array([names.index(precision_of(dtype).name) for dtype in dtypes] or [0], np.int64)[codes]
    coarsest = np.zeros(int(groups.max(initial=-1)) + 1, np.int64)
    np.maximum.at(coarsest, groups, level)
    return names, np.where(level == 0, 0, np.maximum(level, coarsest[groups]))


def rms(numel: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """A tensor's root mean square from its statistics (float64 arrays): sqrt(mean^2 + std^2 (numel - 1) / numel),
    without overflow; a mean or std that is no finite number counts as 0, a numel that is none as 1."""
    count = np.where(np.isfinite(numel) & (numel > 0), numel, 1.0)
    mean, std = (np.where(np.isfinite(values), values, 0.0) for values in (mean, std))
    return np.hypot(mean, std * np.sqrt((count - 1) / count))


def scale_floors(scales: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Per row the largest of ``scales`` in its group (``groups``: 0 to n - 1; -1: a group of its own)."""
    grouped = groups >= 0
    largest = np.zeros(int(groups.max(initial=-1)) + 1)
    np.maximum.at(largest, groups[grouped], scales[grouped])
    return np.where(grouped, largest[np.maximum(groups, 0)] if len(largest) else 0.0, scales)


def bounds(config: CompareConfig, precision: np.ndarray, numel: np.ndarray, mean: np.ndarray, std: np.ndarray,
           floor: np.ndarray | None = None, phase: np.ndarray | None = None
           ) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """The fixed tolerance's (rtol, atol, scale) per pair, of single values and of moments (``tolerance``'s
    ``rule``): ``config.fixed``'s (rtol, atol, 0) for every pair when given; else of each pair's ``precision``
    (names): rtol, and for moments max(passes * mtol, rtol / sqrt(numel)) (``PRECISIONS``; passes of the pair's
    ``phase``, ``MOMENT_PASSES``, 1 when none), no atol, and the scale max(rms, floor, tiny), rms the base
    tensor's (``rms``), ``floor`` its scale floor (``scale_floors``; nan or None: 0)."""
    if config.fixed is not None:
        rtol, atol = config.fixed
        return (rtol, atol, 0.0), (rtol, atol, 0.0)
    rtol, mtol, tiny = (np.zeros(len(precision)) for _ in range(3))
    for name in set(precision.tolist()):  # a few precisions: one pass over the pairs each
        which = precision == name
        found = EXACT if name == EXACT.name else precision_of(name)
        rtol[which], mtol[which], tiny[which] = found.rtol, found.mtol, found.tiny
    scale = np.maximum(rms(numel, mean, std), tiny)
    if floor is not None:
        scale = np.maximum(scale, np.nan_to_num(floor, nan=0.0))
    if phase is not None:
        for name in set(phase.tolist()):
            mtol[phase == name] *= MOMENT_PASSES.get(name, 1.0)
    count = np.where(np.isfinite(numel) & (numel > 0), numel, 1.0)
    zero = np.zeros(len(precision))
    return (rtol, zero, scale), (np.maximum(mtol, rtol / np.sqrt(count)), zero, scale)


def tolerance(config: CompareConfig, base: np.ndarray, noise: np.ndarray | None, numbers: np.ndarray | None = None,
              rule: tuple[Any, Any, Any] | None = None) -> np.ndarray:
    """atol + rtol * max(|base|, scale) (|base| taken as 0 where it is no finite number), raised to
    noise_factor * noise where that is larger; ``rule``: (rtol, atol, scale), numbers or per value (``bounds``;
    None: ``config.fixed``'s, scale 0, only when it has one); ``noise``: per value the record's noise level, nan
    (or None for all) without one."""
    numbers = finite(base) if numbers is None else numbers
    if rule is None:
        if config.fixed is None:
            raise ValueError("tolerance: the per-dtype defaults need each value's rule (rules.bounds)")
        rule = (*config.fixed, 0.0)
    rtol, atol, scale = rule
    every = bool(numbers.all())  # the common case: no value to set aside
    fixed = np.abs(base if every and base.dtype.kind == "f" else as_floats(base, numbers))
    if not every:
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


def ratio(diff: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """MetricDiff.ratio: 0 for no difference, else |diff| / tolerance (inf for a tolerance of 0)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        found = diff / np.where(tol > 0, tol, 1.0)
    return np.where(diff == 0, 0.0, np.where(tol > 0, found, np.inf))


def _distance(base: Any, other: Any) -> Any:
    try:
        return abs(other - base)
    except TypeError:  # not numbers: only equality means anything
        return math.inf


def distance(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """|other - base| of two samples as Python computes it (a bool is a number here; no number: inf)."""
    if base.dtype.kind == "f" and other.dtype.kind == "f":
        with np.errstate(invalid="ignore", over="ignore"):
            found = other - base
        return np.abs(found, out=found)  # in place: a second temporary of a large block costs more than the pass
    if base.dtype.kind == "i" and other.dtype.kind == "i":
        return int_distance(base, other)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.frompyfunc(_distance, 2, 1)(base, other)


def pair_samples(base_indices: Any, base_values: Any, other_indices: Any, other_values: Any
                 ) -> tuple[list[tuple[Any, Any, Any]], bool]:
    """((flat index, base value, other value) at the sample positions both records have, whether the index
    lists differ). Equal index lists pair by position; otherwise only the common indices pair. No pairs
    unless all four are lists."""
    if not all(isinstance(v, list) for v in (base_indices, base_values, other_indices, other_values)):
        return [], False
    if base_indices == other_indices:
        return list(zip(base_indices, base_values, other_values)), False
    other_at = dict(zip(other_indices, other_values))
    return [(i, v, other_at[i]) for i, v in zip(base_indices, base_values) if i in other_at], True
