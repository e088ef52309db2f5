"""The configuration of a comparison: tolerances, filters, and which statistics are compared how.

    config = CompareConfig(rtol=DEFAULT_RTOL, atol=DEFAULT_ATOL)      # the default tolerances, defined here only
    config.wants_step(3); config.wants_name("fc1.output.0")          # the filters a dump is read with
    STRUCTURE, COUNTS, MOMENTS                                        # compared equal, equal, within the tolerance

The rules themselves (tolerance, difference, noise, sample pairing) are ``rules``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..dump.statistics import STATISTICS, names
from ..utils.patterns import check_patterns, name_matcher
from ..utils.phases import PHASES

__all__ = ["COUNTS", "DEFAULT_ATOL", "DEFAULT_NOISE_FACTOR", "DEFAULT_RTOL", "DEFAULT_WINDOW", "MOMENTS", "OPTIONAL_MOMENTS", "STRUCTURE",
           "CompareConfig"]

STRUCTURE = ("shape", "dtype", "numel")
COUNTS = names(compared="count")  # ("nan", "inf"): exact
MOMENTS = names(compared="moment")  # ("min", "max", "mean", "std", "norm"): within the tolerance
# Moments a dump written before they existed lacks: compared only where both records have a value.
OPTIONAL_MOMENTS = frozenset(stat.name for stat in STATISTICS if stat.optional)
DEFAULT_RTOL, DEFAULT_ATOL, DEFAULT_NOISE_FACTOR = 1e-4, 1e-6, 10.0
# Records of one dump read at a time (a window is whole steps, at least one): bounds a comparison's memory.
DEFAULT_WINDOW = 50_000


@dataclass(frozen=True)
class CompareConfig:
    """Tolerances and filters of a comparison.

    A statistic ``x`` of the base run and ``y`` of the other run agree when
    ``|x - y| <= max(atol + rtol * |x|, noise_factor * noise)``, where ``noise`` is the record's noise
    level measured from a second baseline run (0 without one; see docs/compare.md).
    ``steps``: only these steps (None: all). ``names``: only record names matching one of these patterns (globs, or ``"re:<regex>"``).
    ``strict_zero_grads``: a gradient that is exactly zero in one run and absent in the other counts
    as a record on one side only (a divergence) instead of a note. ``fuzzy``: names found in one run
    only are paired by module class, shape and execution order (``probes.compare.align``).
    ``exact``: a record agrees when its tensor's bytes are bit-identical (the records' ``hash``, recorded
    with ``hash=True``); the tolerances are not used. ``phases``: only records of these phases (None: all).
    ``ranks``: every rank of one dump is compared with its rank 0 (``compare_dumps(dump, ranks=True)``).
    """

    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    noise_factor: float = DEFAULT_NOISE_FACTOR
    steps: frozenset[int] | None = None
    names: tuple[str, ...] = ()
    strict_zero_grads: bool = False
    fuzzy: bool = False
    exact: bool = False
    phases: tuple[str, ...] | None = None
    ranks: bool = False
    _wants_name: Callable[[str], bool] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_wants_name", name_matcher(check_patterns(self.names or None, "names"), "names"))
        for label in ("rtol", "atol", "noise_factor"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
        unknown = [phase for phase in self.phases or () if phase not in PHASES]
        if unknown:
            raise ValueError(f"unknown phase {unknown[0]!r}; the phases are {', '.join(PHASES)}")

    def fields(self) -> dict[str, object]:
        """The arguments that make this config again (it pickles through them: a window run in another process)."""
        return {name: getattr(self, name) for name in ("rtol", "atol", "noise_factor", "steps", "names",
                                                        "strict_zero_grads", "fuzzy", "exact", "phases", "ranks")}

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def wants_name(self, name: str) -> bool:
        return self._wants_name(name)

    def wants_phase(self, phase: str) -> bool:
        return self.phases is None or phase in self.phases

