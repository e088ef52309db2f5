"""Compare two statistics dumps and find the first divergence.

    report = compare_dumps("pt_out", "ort_out", rtol=1e-4, atol=1e-6)
    if report.first_divergence: print(report.first_divergence)

Records are matched by (rank, step, phase, name); records present on one side only are listed,
never dropped. The first divergence is searched in execution order: earliest step, then the forward
records in the base run's order, then the backward records, across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .dump import load_dump

Key = tuple[int, int, str, str]  # rank, step, phase, name
COUNTS = ("numel", "nan", "inf")
MOMENTS = ("min", "max", "mean", "std")
PHASE_ORDER = {"forward": 0, "backward": 1}


@dataclass(frozen=True)
class Divergence:
    rank: int
    step: int
    phase: str
    name: str
    metric: str
    base: Any
    other: Any

    def __str__(self) -> str:
        return (f"rank {self.rank} step {self.step} {self.phase} {self.name}: "
                f"{self.metric} {self.base!r} (base) vs {self.other!r} (other)")


@dataclass
class Report:
    matched: int = 0
    first_divergence: Divergence | None = None
    divergences: list[Divergence] = field(default_factory=list)
    only_in_base: list[Key] = field(default_factory=list)
    only_in_other: list[Key] = field(default_factory=list)


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(a)


def compare_records(base: dict, other: dict, rtol: float, atol: float) -> tuple[str, Any, Any] | None:
    """The first statistic of ``other`` that differs from ``base`` beyond tolerance, or None."""
    for key in ("shape", "dtype", *COUNTS):
        if base.get(key) != other.get(key):
            return key, base.get(key), other.get(key)
    for key in MOMENTS:
        if not _close(base.get(key), other.get(key), rtol, atol):
            return key, base.get(key), other.get(key)
    return None


def _order(records: Iterable[dict]) -> list[tuple[Key, dict]]:
    keyed = [((r["rank"], r["step"], r["phase"], r["name"]), r) for r in records]
    keyed.sort(key=lambda item: (item[0][1], PHASE_ORDER.get(item[0][2], 2), item[1].get("seq", 0), item[0][0]))
    return keyed


def compare_dumps(base: str | Path, other: str | Path, *, rtol: float = 1e-4, atol: float = 1e-6) -> Report:
    base_records = _order(load_dump(base))
    other_records = dict(_order(load_dump(other)))
    report = Report()
    base_keys = set()
    for key, record in base_records:
        base_keys.add(key)
        counterpart = other_records.get(key)
        if counterpart is None:
            report.only_in_base.append(key)
            continue
        report.matched += 1
        mismatch = compare_records(record, counterpart, rtol, atol)
        if mismatch is not None:
            divergence = Divergence(*key, *mismatch)
            report.divergences.append(divergence)
            report.first_divergence = report.first_divergence or divergence
    report.only_in_other = sorted(set(other_records) - base_keys)
    return report
