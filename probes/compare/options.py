"""The configuration of a comparison: tolerances, filters, and which statistics are compared how.

    config = CompareConfig()                                          # the per-dtype default tolerances
    config = CompareConfig(rtol=1e-3, atol=1e-5)                      # one fixed rule: atol + rtol * |x|
    PRECISIONS["bfloat16"].rtol; precision_of("complex64")            # the default tolerances, defined here only
    config.wants_step(3); config.wants_name("fc1.output.0")          # the filters a dump is read with
    STRUCTURE, COUNTS, MOMENTS                                        # compared equal, equal, within the tolerance

The rules themselves (tolerance, difference, noise, sample pairing) are ``rules``'s; docs/compare.md
(Tolerance) gives the default rule, the constants and the measurements behind them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..dump.statistics import STATISTICS, names
from ..utils.patterns import check_patterns, name_matcher
from ..utils.phases import PHASES

__all__ = ["AGGREGATES", "COUNTS", "DEFAULT_ATOL", "DEFAULT_NOISE_FACTOR", "DEFAULT_RTOL", "DEFAULT_WINDOW", "EXACT",
           "MOMENT_PASSES", "MOMENTS", "OPTIONAL_MOMENTS", "PRECISIONS", "STRUCTURE", "CompareConfig", "Precision",
           "coarseness", "precision_of"]

STRUCTURE = ("shape", "dtype", "numel")
COUNTS = names(compared="count")  # ("nan", "inf"): exact
MOMENTS = names(compared="moment")  # ("min", "max", "mean", "std", "norm"): within the tolerance
# Over every element, so rounding averages down in them (the moments' rule); min, max and samples are single values.
AGGREGATES = ("mean", "std", "norm")
# Moments a dump written before they existed lacks: compared only where both records have a value.
OPTIONAL_MOMENTS = frozenset(stat.name for stat in STATISTICS if stat.optional)
# The fixed rule's other half when only one of rtol and atol is given (the single default before issue 34).
DEFAULT_RTOL, DEFAULT_ATOL = 1e-4, 1e-6
DEFAULT_NOISE_FACTOR = 10.0
# Records of one dump read at a time (a window is whole steps, at least one): bounds a comparison's memory.
DEFAULT_WINDOW = 50_000


@dataclass(frozen=True)
class Precision:
    """The default tolerance of one floating-point precision (docs/compare.md, Tolerance).

    A single value x (min, max, a sample) of a tensor whose root mean square is ``rms`` agrees within
    ``rtol * max(|x|, rms, tiny)``; a moment (mean, std, norm) of ``numel`` elements within
    ``max(passes * mtol, rtol / sqrt(numel)) * max(|x|, rms, tiny)``, ``passes`` of its phase (MOMENT_PASSES).
    ``eps``: the spacing of the format at 1; ``tiny``: its smallest normal number, below which it has no relative
    precision.
    """

    name: str
    eps: float
    tiny: float
    rtol: float
    mtol: float


# Measured on bfloat16 (12 architectures) and float16 autocast runs (docs/compare.md): in units of the format's
# eps, the largest difference of eager against torch.compile was 8.5 (bfloat16) and 6.5 (float16) for single
# values, 0.17 and 0.12 for the moments of activations; a systematic 1% error is 1.28 bfloat16 eps.
VALUE_EPS, MOMENT_EPS = 16.0, 0.64


def _low(name: str, eps: float, tiny: float) -> Precision:
    """A 16-, 8-bit format: its tolerances in units of its eps, as measured on bfloat16 and float16."""
    return Precision(name=name, eps=eps, tiny=tiny, rtol=VALUE_EPS * eps, mtol=MOMENT_EPS * eps)


# Most precise first. float32 and float64 are far below what a 1% bug moves: float32 keeps the former single
# default's rtol (about 840 eps), float64 about 4500 eps; both over 10 times the largest differences measured.
PRECISIONS: dict[str, Precision] = {precision.name: precision for precision in (
    Precision(name="float64", eps=2.0 ** -52, tiny=2.0 ** -1022, rtol=1e-12, mtol=1e-13),
    Precision(name="float32", eps=2.0 ** -23, tiny=2.0 ** -126, rtol=1e-4, mtol=1e-5),
    _low("float16", 2.0 ** -10, 2.0 ** -14),
    _low("bfloat16", 2.0 ** -7, 2.0 ** -126),
    _low("float8_e4m3fn", 2.0 ** -3, 2.0 ** -6),
    _low("float8_e4m3fnuz", 2.0 ** -3, 2.0 ** -7),
    _low("float8_e5m2", 2.0 ** -2, 2.0 ** -14),
    _low("float8_e5m2fnuz", 2.0 ** -2, 2.0 ** -15),
)}
# How many times a record's rounding is compounded, per phase, for its moments: a gradient went through the forward
# and the backward (and an update follows from it), an optimizer state squares gradients (Adam's exp_avg_sq).
# Measured on bfloat16 runs (docs/compare.md): moments of gradients differ up to 2x, of optimizer states up to 4x
# as much as those of activations; single values do not (they are not averaged, so rounding dominates them).
MOMENT_PASSES: dict[str, float] = {"forward": 1.0, "recompute": 1.0, "backward": 2.0, "grad": 2.0, "param": 2.0,
                                   "optim": 4.0}
# Integer and bool tensors: their values exactly; their moments (float64 sums) within float64's rounding.
EXACT = Precision(name="exact", eps=0.0, tiny=0.0, rtol=0.0, mtol=PRECISIONS["float64"].mtol)
_COMPONENTS = {"complex128": "float64", "complex64": "float32", "complex32": "float16"}
_INTEGERS = frozenset({"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"})


def precision_of(dtype: str | None) -> Precision:
    """The precision a record's ``dtype`` (``"bfloat16"``) is compared at on its own: a complex tensor's
    component type, EXACT for integers and bool, float32 for any other (or no) dtype."""
    if dtype in _INTEGERS:
        return EXACT
    found = PRECISIONS.get(_COMPONENTS.get(dtype, dtype))  # type: ignore[arg-type]
    return found if found is not None else PRECISIONS["float32"]


def coarseness(precision: Precision) -> tuple[float, float]:
    """Orders precisions from most to least precise: by eps, then by the smallest normal."""
    return precision.eps, precision.tiny


@dataclass(frozen=True)
class CompareConfig:
    """Tolerances and filters of a comparison.

    A statistic ``x`` of the base run and ``y`` of the other run agree when ``|x - y| <= max(fixed,
    noise_factor * noise)``, where ``noise`` is the statistic's noise level measured from calibration runs
    (``probes.rounding``; 0 without one), ``noise_factor * noise`` its noise floor, and ``fixed`` the default of the record's precision (``PRECISIONS``: its dtype, or a less
    precise one its step computed in) unless ``rtol`` or ``atol`` is given: then ``atol + rtol * |x|`` for
    every record (the one not given: ``DEFAULT_RTOL``, ``DEFAULT_ATOL``). See docs/compare.md.
    ``steps``: only these steps (None: all). ``names``: only record names matching one of these patterns (globs, or ``"re:<regex>"``).
    ``strict_zero_grads``: a gradient that is exactly zero in one run and absent in the other counts
    as a record on one side only (a divergence) instead of a note. ``fuzzy``: names found in one run
    only are paired by module class, shape and execution order (``probes.compare.align``).
    ``exact``: a record agrees when its tensor's bytes are bit-identical (the records' ``hash``, recorded
    with ``hash=True``); the tolerances are not used. ``phases``: only records of these phases (None: all).
    ``ranks``: every rank of one dump is compared with its rank 0 (``compare_dumps(dump, ranks=True)``).
    """

    rtol: float | None = None
    atol: float | None = None
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
            if value is None and label != "noise_factor":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
        unknown = [phase for phase in self.phases or () if phase not in PHASES]
        if unknown:
            raise ValueError(f"unknown phase {unknown[0]!r}; the phases are {', '.join(PHASES)}")

    def fields(self) -> dict[str, object]:
        """The arguments that make this config again (it pickles through them: a window run in another process)."""
        return {name: getattr(self, name) for name in ("rtol", "atol", "noise_factor", "steps", "names",
                                                        "strict_zero_grads", "fuzzy", "exact", "phases", "ranks")}

    @property
    def fixed(self) -> tuple[float, float] | None:
        """(rtol, atol) of the one fixed rule when either was given, else None (the per-dtype defaults)."""
        if self.rtol is None and self.atol is None:
            return None
        return (DEFAULT_RTOL if self.rtol is None else self.rtol, DEFAULT_ATOL if self.atol is None else self.atol)

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def wants_name(self, name: str) -> bool:
        return self._wants_name(name)

    def wants_phase(self, phase: str) -> bool:
        return self.phases is None or phase in self.phases

