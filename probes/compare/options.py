"""The options of a comparison, each declared once: tolerances, filters, which statistics are compared how, the name map.

    config = CompareConfig()                                          # the per-dtype default tolerances
    config = CompareConfig(rtol=1e-3, atol=1e-5)                      # one fixed rule: atol + rtol * |x|
    PRECISIONS["bfloat16"].rtol; precision_of("complex64")            # the default tolerances, defined here only
    config.wants_step(3); config.wants_name("fc1.output.0")          # the filters a dump is read with
    STRUCTURE, COUNTS, MOMENTS                                        # compared equal, equal, within the tolerance
    load_name_map("names.yaml").apply("blocks.1.ffn.0.output.0")     # OTHER's name as BASE writes it (--map)

The rules themselves are ``evaluation``'s (the tolerance) and ``pairs``' (difference, equality); docs/compare.md
(Tolerance) gives the default rule, its constants and the measurements behind them. Each field of ``CompareConfig``
is an option (``probes.utils.flags``): ``compare_dumps``' keyword, ``probes compare``'s flag, their help and their
check (the options of the run: ``engine.CompareOptions``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Union

from ..dump.statistics import STATISTICS, names
from ..utils.flags import option, settle
from ..utils.patterns import check_patterns, name_matcher
from ..utils.phases import PHASES

__all__ = ["AGGREGATES", "COUNTS", "DEFAULT_ATOL", "DEFAULT_NOISE_FACTOR", "DEFAULT_RTOL", "DEFAULT_WINDOW",
           "DRIFT_GROWTH", "EXACT", "MOMENT_PASSES", "MOMENTS", "OPTIONAL_MOMENTS", "PRECISIONS", "STRUCTURE",
           "CompareConfig", "NameMap", "NameMapError", "NameMapLike", "NameRules", "Precision", "as_name_map",
           "coarseness", "load_name_map", "parse_steps", "precision_of"]

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
# Drift (docs/compare.md, Drift): a record diverged at the default tolerance is drift when its ratio is at most this
# many times what was carried when it was computed (the step before, the agreeing records before it). Measured: noise
# grew by up to 2.8x (CTC, eager vs inductor); a bug of 1% in bfloat16 jumped by 13x, fp32 bugs by 1e2 to 1e6.
DRIFT_GROWTH = 4.0
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


def _tolerance(value: Any, *, none: bool = True) -> str | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        return f"must be a finite number >= 0, got {value!r}"
    return None


def _phases(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _known_phases(phases: tuple[str, ...] | None) -> str | None:
    unknown = [phase for phase in phases or () if phase not in PHASES]
    return f"has an unknown phase {unknown[0]!r}; the phases are {', '.join(PHASES)}" if unknown else None


def parse_steps(text: str) -> frozenset[int]:
    """``"3"``, ``"0-4"`` or ``"1,3,5-7"`` as a set of steps (the ``--step`` syntax; ``terminal.ranges`` writes it)."""
    steps: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            start, end = int(first), int(last) if dash else int(first)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a step, range or list of steps: {text!r}") from None
        if start < 0 or end < start:
            raise argparse.ArgumentTypeError(f"bad step range {part!r}")
        steps.update(range(start, end + 1))
    return frozenset(steps)


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """Tolerances and filters of a comparison: what every window of it is compared with.

    A statistic ``x`` of the base run and ``y`` of the other run agree when ``|x - y| <= max(fixed,
    noise_factor * noise)``, where ``noise`` is the statistic's noise level measured from calibration runs
    (``probes.rounding``; 0 without one), ``noise_factor * noise`` its noise floor, and ``fixed`` the default of
    the record's precision (``PRECISIONS``: its dtype, or a less precise one its step computed in) unless ``rtol``
    or ``atol`` is given: then ``atol + rtol * |x|`` for every record (the one not given: ``DEFAULT_RTOL``,
    ``DEFAULT_ATOL``). See docs/compare.md. Each field is an option (``probes.utils.flags``): its help is
    ``probes compare --help``'s and ``compare_dumps``'.
    """

    rtol: float | None = option(None, check=_tolerance, help=(
        "one fixed rule atol + rtol*|x| for every record (default: each record's per-dtype tolerance, "
        f"docs/compare.md; with {{atol}} alone rtol is {DEFAULT_RTOL:g})"))
    atol: float | None = option(None, check=_tolerance, help=(
        f"absolute tolerance of the fixed rule (with {{rtol}} alone: {DEFAULT_ATOL:g})"))
    noise_factor: float = option(DEFAULT_NOISE_FACTOR, metavar="K", check=partial(_tolerance, none=False),
                                 help=f"k of the noise floor (default {DEFAULT_NOISE_FACTOR:g})")
    steps: frozenset[int] | None = option(None, flag="--step", many="extend", parse=parse_steps, metavar="STEPS",
                                          convert=frozenset,
                                          help="only these steps: N, A-B or a comma list (repeatable; default all)")
    names: tuple[str, ...] = option((), flag="--name", many="append", metavar="GLOB", convert=tuple, help=(
        "only records whose name matches this glob, e.g. 'blocks.1.*', or 're:<regex>' (repeatable)"))
    strict_zero_grads: bool = option(False, convert=bool, help=(
        "a gradient exactly zero in one run and absent in the other is a divergence (default: a note)"))
    strict_drift: bool = option(False, convert=bool, help=(
        "a difference grown from what the step before carried (drift) is a divergence (default: drift, listed; "
        "only at the default tolerance, docs/compare.md, Drift)"))
    fuzzy: bool = option(False, convert=bool, help=(
        "pair the records still found in one run only by module class, shape and execution order, and list the "
        "pairs with their confidence (probes.compare.operations)"))
    exact: bool = option(False, convert=bool, help=(
        "a record agrees only when bit-identical (its hash; both runs recorded with hash=True); tolerances are "
        "not used"))
    phases: tuple[str, ...] | None = option(None, flag="--phase", many="append", choices=PHASES, metavar="PHASE",
                                            convert=_phases, check=_known_phases, help=(
        f"only records of this phase ({', '.join(PHASES)}; repeatable); with {{ranks}} it replaces grad, param, "
        "optim"))
    ranks: bool = option(False, convert=bool, help=(
        "compare every rank of the one dump {base} with its rank 0 (data-parallel runs); by default the phases "
        "that must agree across ranks: grad, param, optim"))
    _wants_name: Callable[[str], bool] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        settle(self)
        object.__setattr__(self, "_wants_name", name_matcher(check_patterns(self.names or None, "names"), "names"))

    def fields(self) -> dict[str, object]:
        """The arguments that make this config again (it pickles through them: a window run in another process)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(CompareConfig) if f.init}

    def config(self) -> CompareConfig:
        """The comparison's own config (without the options of the run, when ``self`` is ``CompareOptions``)."""
        return CompareConfig(**self.fields())  # type: ignore[arg-type]

    @property
    def drifts(self) -> bool:
        """Whether the drift rule applies: at the default tolerances, not ``exact``, not ``strict_drift``."""
        return self.fixed is None and not self.exact and not self.strict_drift

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


# --------------------------------------------------------------------------------------------- the name map
# How the record names of OTHER are written in BASE, as regular expressions applied in order, each to the result of
# the previous one (the run checked is renamed; BASE and the noise run keep their names). A map file is YAML or JSON
# (by its ending: .yaml/.yml, else JSON): ``{pattern: replacement}`` or ``[{pattern: ..., replace: ...}, ...]``;
# a pattern is searched anywhere in a name (anchor it with ^/$), its replacement may use its groups (\1).

NameRules = Union[Mapping[str, str], Sequence[Mapping[str, str]]]
NameMapLike = Union["NameMap", NameRules, str, Path]  # what ``name_map=`` options accept
FORMAT_HELP = ('a mapping {"pattern": "replacement"} or a list of {"pattern": ..., "replace": ...} entries, '
               "patterns being Python regular expressions")


class NameMapError(ValueError):
    """A name map that cannot be used: unreadable, malformed, an invalid pattern, or two names made one."""


@dataclass(frozen=True)
class NameMap:
    """Ordered (pattern, replacement) rules rewriting OTHER's record names into BASE's."""

    rules: tuple[tuple[re.Pattern[str], str], ...]
    source: str = "name map"

    @classmethod
    def from_rules(cls, rules: NameRules, *, source: str = "name map") -> "NameMap":
        """A map from ``{pattern: replacement}`` or ``[{"pattern": ..., "replace": ...}, ...]``."""
        if isinstance(rules, Mapping):
            pairs = list(rules.items())
        elif isinstance(rules, Sequence) and not isinstance(rules, (str, bytes)):
            pairs = []
            for number, entry in enumerate(rules, 1):
                if not isinstance(entry, Mapping) or set(entry) != {"pattern", "replace"}:
                    raise NameMapError(f"{source}: entry {number} is {entry!r}; each entry of a list needs exactly "
                                       f"the keys 'pattern' and 'replace' ({FORMAT_HELP})")
                pairs.append((entry["pattern"], entry["replace"]))
        else:
            raise NameMapError(f"{source}: holds {type(rules).__name__}; write {FORMAT_HELP}")
        if not pairs:
            raise NameMapError(f"{source}: has no rule; write {FORMAT_HELP}")
        compiled = []
        for pattern, replacement in pairs:
            if not isinstance(pattern, str) or not isinstance(replacement, str) or not pattern:
                raise NameMapError(f"{source}: rule {pattern!r} -> {replacement!r}: a pattern and its replacement "
                                   "must be strings, the pattern not empty (quote numbers in YAML)")
            try:
                regex = re.compile(pattern)
                regex.sub(replacement, "")  # a bad group reference in the replacement fails here
            except re.error as error:
                raise NameMapError(f"{source}: rule {pattern!r} -> {replacement!r} is not a valid regular expression "
                                   f"({error}); escape literal dots and brackets (\\\\.)") from None
            compiled.append((regex, replacement))
        return cls(tuple(compiled), source)

    def apply(self, name: str) -> str:
        """``name`` rewritten by every rule in turn."""
        for regex, replacement in self.rules:
            name = regex.sub(replacement, name)
        return name


def load_name_map(path: str | Path) -> NameMap:
    """Reads a YAML (.yaml, .yml) or JSON name map file; NameMapError says what is wrong with it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise NameMapError(f"name map {path}: cannot be read ({reason}); give a YAML or JSON file") from None
    return NameMap.from_rules(_parse(path, text), source=f"name map {path}")


def _parse(path: Path, text: str) -> Any:
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise NameMapError(f"name map {path}: reading YAML needs PyYAML (pip install PyYAML), "
                               "or write the map as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise NameMapError(f"name map {path}: not valid YAML ({' '.join(str(error).split())})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise NameMapError(f"name map {path}: not valid JSON ({error}); name a YAML map .yaml or .yml") from None


def as_name_map(name_map: NameMapLike | None) -> NameMap | None:
    """A ``name_map=`` option as a NameMap: a NameMap, its rules, or the path of a YAML/JSON file."""
    if name_map is None or isinstance(name_map, NameMap):
        return name_map
    if isinstance(name_map, (str, Path)):
        return load_name_map(name_map)
    return NameMap.from_rules(name_map)
