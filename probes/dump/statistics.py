"""The statistics of a record, each defined once: its name, its column, how a bucket computes it, how shards merge.

    for stat in STATISTICS: print(stat.name, stat.column, stat.merge or "derived")
    ACCUMULATED      # what a bucket computes and shards merge: the row of a tensor, in this order
    DERIVED          # computed from a merged row (std, norm)
    names(compared="moment")   # ("min", "max", "mean", "std", "norm"): what compare checks with a tolerance
    global_grad_norms(records)  # {(rank, step): sqrt(sum of the grad records' squared norms)}

In the spirit of Transformer Engine's ``stats_computation``: everything else is derived from this
registry: the C++ kernel's row (checked by name when it loads), ``TensorSummary``, the torch path
(``probes.stats.numerics``), the device rows (``probes.stats.rows``), the dump's columns, ``probes show``,
compare's moments and counts, and TensorBoard's default statistics.

An accumulated statistic has a ``bucket`` function of a bucket's prepared values (``probes.stats.numerics``
gives them; torch ops on the tensor's device, float64) and one of five ``merge`` rules. A derived one has
``derive``, a function of the merged statistics (numpy float64 arrays, or python numbers) that gives nan
where it is undefined (the record then holds None). Adding a statistic is one entry here; a new merge
rule also needs its two interpreters (``probes.stats.numerics``: python values and device rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np

from ..utils.phases import GRAD

__all__ = ["ACCUMULATED", "DERIVED", "STATISTICS", "Statistic", "global_grad_norms", "global_norms", "names"]

Merge = Literal["sum", "min", "max", "mean", "m2"]
Column = Literal["int", "float", "number"]  # number: an int for integer tensors (exact), else a float


@dataclass(frozen=True, kw_only=True)
class Statistic:
    """One statistic of a record.

        Statistic(name="nan", column="int", merge="sum", bucket=lambda b: b.nan, compared="count", doc="...")
    """

    name: str
    column: Column
    doc: str
    bucket: Callable[[Any], Any] | None = None  # accumulated: the bucket's value (a 0-d float64 tensor)
    merge: Merge | None = None  # accumulated: how buckets and shards combine
    derive: Callable[[dict[str, Any]], Any] | None = None  # derived: from the merged statistics; nan: undefined
    finite_only: bool = False  # None in a record when the tensor has no finite element
    compared: Literal["moment", "count", "structure"] | None = None  # how compare checks it
    shown: bool = False  # a column of ``probes show``
    plotted: bool = False  # a default TensorBoard statistic
    display: int = 0  # where views list it (``names`` sorts by this, then by registry order)
    optional: bool = False  # dumps written before it existed lack it: compared only where both records have it

    def __post_init__(self) -> None:
        if (self.merge is None) == (self.derive is None) or (self.merge is None) != (self.bucket is None):
            raise ValueError(f"statistic {self.name!r}: give bucket and merge (accumulated) or derive (derived)")


def _std(s: dict[str, Any]) -> Any:
    finite = np.asarray(s["finite"], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(finite >= 2, np.sqrt(np.maximum(s["m2"], 0.0) / (finite - 1)), np.nan)


def _norm(s: dict[str, Any]) -> Any:
    # sum(x^2) = m2 + finite * mean^2: two non-negative terms, so no cancellation.
    finite = np.asarray(s["finite"], dtype=np.float64)
    mean = np.nan_to_num(np.asarray(s["mean"], dtype=np.float64), nan=0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(finite > 0, np.sqrt(np.maximum(s["m2"], 0.0) + finite * mean * mean), np.nan)


STATISTICS: tuple[Statistic, ...] = (
    Statistic(name="numel", column="int", merge="sum", bucket=lambda b: b.numel, compared="structure",
              doc="elements of the tensor"),
    Statistic(name="finite", column="int", merge="sum", bucket=lambda b: b.finite,
              doc="finite elements: the moments and min/max are over these"),
    Statistic(name="mean", display=3, column="float", merge="mean", bucket=lambda b: b.mean, finite_only=True,
              compared="moment", shown=True, plotted=True, doc="mean of the finite elements"),
    Statistic(name="m2", column="float", merge="m2", bucket=lambda b: b.m2,
              doc="sum of squared deviations from the mean (finite elements), kept so that shards merge exactly"),
    Statistic(name="min", display=1, column="number", merge="min", bucket=lambda b: b.min, finite_only=True,
              compared="moment", shown=True, plotted=True, doc="smallest finite element"),
    Statistic(name="max", display=2, column="number", merge="max", bucket=lambda b: b.max, finite_only=True,
              compared="moment", shown=True, plotted=True, doc="largest finite element"),
    Statistic(name="nan", display=6, column="int", merge="sum", bucket=lambda b: b.nan, compared="count", shown=True,
              plotted=True, doc="nan elements"),
    Statistic(name="inf", display=7, column="int", merge="sum", bucket=lambda b: b.inf, compared="count", shown=True,
              plotted=True, doc="+inf and -inf elements"),
    Statistic(name="neg", column="int", merge="sum", bucket=lambda b: b.neg, doc="elements < 0 (-inf included)"),
    Statistic(name="pos", column="int", merge="sum", bucket=lambda b: b.pos, doc="elements > 0 (+inf included)"),
    Statistic(name="zero", column="int", merge="sum", bucket=lambda b: b.zero, doc="elements == 0 (-0.0 included)"),
    Statistic(name="std", display=4, column="float", derive=_std, finite_only=True, compared="moment", shown=True,
              plotted=True, doc="unbiased (n - 1) standard deviation of the finite elements; None below 2"),
    Statistic(name="norm", display=5, column="float", derive=_norm, finite_only=True, optional=True, compared="moment", shown=True,
              plotted=True, doc="L2 norm of the finite elements: sqrt(sum of their squares)"),
)

ACCUMULATED: tuple[Statistic, ...] = tuple(stat for stat in STATISTICS if stat.merge is not None)
DERIVED: tuple[Statistic, ...] = tuple(stat for stat in STATISTICS if stat.derive is not None)


def names(*, compared: str | None = None, shown: bool | None = None, plotted: bool | None = None,
          accumulated: bool | None = None) -> tuple[str, ...]:
    """The names of the statistics that match every filter given, in registry order.

        names(compared="count")   # ("nan", "inf")
    """
    return tuple(stat.name for stat in sorted(STATISTICS, key=lambda stat: stat.display)
                 if (compared is None or stat.compared == compared)
                 and (shown is None or stat.shown == shown)
                 and (plotted is None or stat.plotted == plotted)
                 and (accumulated is None or (stat.merge is not None) == accumulated))


def global_norms(norms: np.ndarray, groups: np.ndarray, count: int) -> np.ndarray:
    """Per group (``groups``: each norm's group, 0 to ``count`` - 1), the global norm of its tensors from their
    ``norm`` statistics: sqrt of the sum of their squares, in float64, summed in the order given.

    Norms are over finite elements (the ``norm`` statistic leaves nan and inf out); a tensor without a norm
    (nan here: no finite element, or no statistics) is left out. nan for a group with no norm at all.
    """
    norms = np.asarray(norms, np.float64)
    groups = np.asarray(groups, np.int64)
    known = ~np.isnan(norms)
    squares = np.bincount(groups[known], weights=norms[known] ** 2, minlength=count)
    found = np.bincount(groups[known], minlength=count)
    return np.where(found > 0, np.sqrt(squares), np.nan)


def global_grad_norms(records: Iterable[Mapping[str, Any]]) -> dict[tuple[int, int], float]:
    """(rank, step) -> the global gradient norm of that step: ``global_norms`` of its ``grad`` records' norms,
    in the records' order. Only the (rank, step)s with a grad record that has a norm are listed."""
    keys: dict[tuple[int, int], int] = {}
    norms: list[float] = []
    groups: list[int] = []
    for record in records:
        if record.get("phase") != GRAD:
            continue
        group = keys.setdefault((record["rank"], record["step"]), len(keys))
        norm = record.get("norm")
        norms.append(float(norm) if isinstance(norm, (int, float)) and not isinstance(norm, bool) else np.nan)
        groups.append(group)
    values = global_norms(np.array(norms, np.float64), np.array(groups, np.int64), len(keys))
    return {key: float(values[group]) for key, group in keys.items() if not np.isnan(values[group])}
