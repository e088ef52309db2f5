"""The RecordDiff objects of matched pairs: every metric of each, from ``metrics``.

    diffs = record_diffs(base_records, other_records, config, noise=levels)   # one RecordDiff per pair

Used for the records a report shows (``RecordDiffs`` builds them on demand) and by
``engine.compare_records`` for records at hand; the records become columns of Python values
(``pairs.from_records``), so integers stay exact and values kept in ``extra`` compare as they were written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..dump.hashes import HASH, hex_hash
from .options import COUNTS, MOMENTS, STRUCTURE, CompareConfig
from .metrics import NOISED, evaluate
from .pairs import from_records
from .results import BIT_IDENTICAL, BYTES_DIFFER, MetricDiff, RecordDiff
from .rules import difference, finite, relative

__all__ = ["record_diffs"]


def record_diffs(base: Sequence[Mapping[str, Any]], other: Sequence[Mapping[str, Any]], config: CompareConfig,
                 noise: np.ndarray | None = None,
                 context: tuple[Sequence[str], Sequence[float]] | None = None) -> list[RecordDiff]:
    """One RecordDiff per pair ``base[i]``, ``other[i]`` (same rank, step, phase and name); ``noise``: per pair
    and statistic (``metrics.NOISED``, a column each) the noise level, nan where there is none (None: no
    calibration run); ``context``: each pair's precision and scale floor (``pairs.from_records``; None: of the
    base record alone). With ``config.exact`` the one metric is the hash."""
    levels = None if noise is None else np.asarray(noise, np.float64).reshape(len(base), len(NOISED))
    if config.exact:
        return [_hash_diff(b, o, None if levels is None else _levels(levels[row]))
                for row, (b, o) in enumerate(zip(base, other))]
    pairs = from_records(base, other, context)
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
