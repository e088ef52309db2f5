"""Anomalies in statistics records: non-finite values (nan, inf) and, optionally, values too large.

    anomaly = record_anomaly(record, max_abs=65504.0)     # None, or what is wrong with this record
    first = first_anomaly(load_dump("run"))               # the earliest anomalous record across ranks
    print(first)   # "rank 1, step 3, forward, blocks.0.mlp.output.0 (module blocks.0.mlp, tensor 0): 2 nan, ..."

Read from a record's counts (``nan``, ``inf``) and its min/max over finite elements, so finding one
costs nothing beyond the statistics. ``max_abs``: a finite value with ``|x| > max_abs`` is an anomaly too
(65504 is float16's largest value). Records without statistics ("unsupported") are never anomalies.
The sentinel (``probes.stats.sentinel``), ``probes show`` and ``probes compare`` all use this one rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .record import Record, execution_order

__all__ = ["Anomaly", "first_anomaly", "max_abs_problem", "record_anomaly"]


def max_abs_problem(max_abs: Any) -> str | None:
    """What is wrong with ``max_abs`` as a threshold (a finite number > 0, or None: none); None when nothing is."""
    if max_abs is None or (not isinstance(max_abs, bool) and isinstance(max_abs, (int, float))
                           and 0 < max_abs < math.inf):
        return None
    return f"must be a finite number > 0 (e.g. 65504.0, float16's largest value), got {max_abs!r}"


@dataclass(frozen=True)
class Anomaly:
    """One record holding non-finite values (or, with a ``max_abs``, finite values beyond it)."""

    rank: int
    step: int
    phase: str
    name: str  # the record's name, e.g. "blocks.0.mlp.output.0"
    module: str  # the module's qualified name ("" when the record does not say)
    tensor_index: int | None
    nan: int
    inf: int
    numel: int | None
    largest: float | None  # max(|min|, |max|) over the finite elements
    max_abs: float | None = None  # the threshold in force (None: only nan and inf count)
    seq: int | None = None

    @property
    def over(self) -> bool:
        """Whether a finite value exceeds ``max_abs``."""
        return self.max_abs is not None and self.largest is not None and self.largest > self.max_abs

    def where(self) -> str:
        """"rank R, step S, PHASE, NAME (module M, tensor I)"."""
        site = f"module {self.module or '?'}, tensor {self.tensor_index if self.tensor_index is not None else '?'}"
        return f"rank {self.rank}, step {self.step}, {self.phase}, {self.name} ({site})"

    def what(self) -> str:
        """"2 nan, 0 inf of 512 elements" (and the largest finite magnitude when it is over ``max_abs``)."""
        text = f"{self.nan} nan, {self.inf} inf of {self.numel if self.numel is not None else '?'} elements"
        if self.over:
            text += f", largest finite |value| {self.largest:.6g} > max_abs {self.max_abs:g}"
        return text

    def __str__(self) -> str:
        return f"{self.where()}: {self.what()}"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "name": self.name, "module": self.module,
                "tensor_index": self.tensor_index, "nan": self.nan, "inf": self.inf, "numel": self.numel,
                "largest": self.largest, "max_abs": self.max_abs}


def _count(record: Record, key: str) -> int:
    value = record.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _largest(record: Record) -> float | None:
    magnitudes = [abs(value) for value in (record.get("min"), record.get("max"))
                  if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)]
    return float(max(magnitudes)) if magnitudes else None


def record_anomaly(record: Record, *, max_abs: float | None = None) -> Anomaly | None:
    """What is anomalous in ``record`` (nan or inf elements, or a finite ``|x| > max_abs``), or None."""
    if "unsupported" in record:
        return None
    nan, inf = _count(record, "nan"), _count(record, "inf")
    largest = _largest(record)
    over = max_abs is not None and largest is not None and largest > max_abs
    if not (nan or inf or over):
        return None
    numel = record.get("numel")
    index = record.get("tensor_index")
    return Anomaly(record["rank"], record["step"], record["phase"], record["name"], str(record.get("module", "")),
                   index if isinstance(index, int) else None, nan, inf, numel if isinstance(numel, int) else None,
                   largest, max_abs, record.get("seq") if isinstance(record.get("seq"), int) else None)


def first_anomaly(records: Iterable[Record], *, max_abs: float | None = None) -> Anomaly | None:
    """The earliest anomalous record in execution order (step, forward before backward, seq, rank)."""
    found = (anomaly for record in records if (anomaly := record_anomaly(record, max_abs=max_abs)) is not None)
    return min(found, key=lambda a: execution_order(a.step, a.phase, a.seq, a.rank), default=None)
