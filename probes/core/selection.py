"""What a subscriber records: which steps, which sites (modules), which phases.

    selection = Selection.of(start_step=0, every_n_steps=10, modules="blocks.*", exclude_modules="re:.*drop.*",
                             phases="forward", ops="blocks.0.attn")
    selection.wants_step(20), selection.wants_site(site), selection.wants_phase("backward")

Every subscriber holds one (``SubscriberBase.selection``, made from its keyword arguments); the step
tracker asks it which subscribers get a probe call, and the manager leaves a site without a probe when
no subscriber wants it (decided at subscribe time, so ORTModule's exported graph never changes).

The rules:

- Steps: ``[start_step, end_step)``, and within it either every ``every_n_steps``-th step counted from
  ``start_step`` (``start_step``, ``start_step + n``, ...) or only the steps listed in ``steps``.
  Left-out steps still count: step numbers are the same with or without a selection.
- Sites: a pattern matches a module's qualified name (``site.name``; the root is ``"<root>"``) or its
  class name (``site.module_class``); an ``inspect_activation`` site matches by its name only. A
  pattern is a glob (``fnmatch.fnmatchcase``: case-sensitive, ``*`` also crosses dots), or a regular
  expression when written ``"re:<regex>"`` (``re.fullmatch``). A site is wanted when no include
  pattern is given or one matches, and no exclude pattern matches. Patterns match each site on its
  own: ``"encoder"`` selects only the module ``encoder``, ``"encoder.*"`` its descendants,
  ``"encoder*"`` both.
- Operations: ``ops`` patterns (the same rule, on module names and classes) choose the modules whose every
  torch operation gets a record of its own (``probes.core.ops``: ``<module>/<op>:<k>.output.<i>``); such a
  module's outputs are recorded too, whatever ``modules`` says (its op records nest under them). No ``ops``:
  no op records.
- Phases: ``"forward"``, ``"backward"``; a forward recomputed by activation checkpointing
  (``"recompute"``, only for subscribers with ``observe_recompute``) follows ``"forward"``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from ..utils.checks import check_int
from ..utils.patterns import check_patterns, compile_pattern
from ..utils.phases import RECOMPUTE, SELECTABLE

if TYPE_CHECKING:
    from .sites import ProbeSite

@dataclass(frozen=True)
class Selection:
    """Steps, sites and phases one subscriber records; ``Selection()`` records everything.

    Build one with ``Selection.of(...)``, which checks the arguments (the fields hold them checked).
    """

    start_step: int = 0
    end_step: int = sys.maxsize
    every_n_steps: int | None = None
    steps: frozenset[int] | None = None
    modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    phases: frozenset[str] = frozenset(SELECTABLE)
    ops: tuple[str, ...] = ()
    _include: tuple[Callable[[str], bool], ...] = field(default=(), init=False, repr=False, compare=False)
    _exclude: tuple[Callable[[str], bool], ...] = field(default=(), init=False, repr=False, compare=False)
    _ops: tuple[Callable[[str], bool], ...] = field(default=(), init=False, repr=False, compare=False)
    _site_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_include", tuple(compile_pattern(p, "modules") for p in self.modules))
        object.__setattr__(self, "_ops", tuple(compile_pattern(p, "ops") for p in self.ops))
        object.__setattr__(self, "_exclude", tuple(compile_pattern(p, "exclude_modules") for p in self.exclude_modules))

    @classmethod
    def of(cls, start_step: int | None = None, end_step: int | None = None, *, every_n_steps: int | None = None,
           steps: Iterable[int] | None = None, modules: str | Sequence[str] | None = None,
           exclude_modules: str | Sequence[str] | None = None,
           phases: str | Sequence[str] | None = None, ops: str | Sequence[str] | None = None) -> "Selection":
        """A checked selection; every bad argument is a ValueError saying what is wrong and what to pass.

            Selection.of(every_n_steps=10, modules=["blocks.*", "re:.*attn.*"], phases="forward")
        """
        start = 0 if start_step is None else check_int(start_step, "start_step (or None)")
        end = sys.maxsize if end_step is None else check_int(end_step, "end_step (or None)")
        if start > end:
            raise ValueError(f"start_step ({start}) must not be greater than end_step ({end})")
        if every_n_steps is not None and steps is not None:
            raise ValueError("pass either every_n_steps (a cadence) or steps (an explicit list of steps), not both")
        if every_n_steps is not None:
            check_int(every_n_steps, "every_n_steps (record every n-th step from start_step; or None)", minimum=1)
        chosen: frozenset[int] | None = None
        if steps is not None:
            if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
                raise ValueError(f"steps must be an iterable of step numbers (e.g. [0, 10, 100]) or None, got {steps!r}")
            chosen = frozenset(check_int(step, "every entry of steps (a step number)") for step in steps)
            if not chosen:
                raise ValueError("steps is empty, so nothing would be recorded; pass None to record every step")
        if ops is not None and not isinstance(ops, str) and isinstance(ops, (list, tuple, set, frozenset)) and not ops:
            raise ValueError("ops is empty; pass None to record no operations, or module patterns (\"blocks.0.attn\")")
        return cls(start_step=start, end_step=end, every_n_steps=every_n_steps, steps=chosen,
                   modules=check_patterns(modules, "modules"), exclude_modules=check_patterns(exclude_modules, "exclude_modules"),
                   phases=_phases(phases), ops=check_patterns(ops, "ops"))

    @property
    def selects_sites(self) -> bool:
        """True when some site may be left out (include or exclude patterns were given)."""
        return bool(self._include or self._exclude)

    def wants_step(self, step: int) -> bool:
        if not self.start_step <= step < self.end_step:
            return False
        if self.every_n_steps is not None:
            return (step - self.start_step) % self.every_n_steps == 0
        return self.steps is None or step in self.steps

    def wants_phase(self, phase: str) -> bool:
        return (phase if phase != RECOMPUTE else "forward") in self.phases

    def wants_site(self, site: "ProbeSite") -> bool:
        if site.kind == "op":
            return self.wants_ops(site.module, site.module_class)
        if not self.selects_sites or (self._ops and site.kind == "output"
                                      and self.wants_ops(site.name, site.module_class)):
            return True
        key = (site.name, site.module_class if site.kind != "inspect" else None)
        wanted = self._site_cache.get(key)
        if wanted is None:
            wanted = self._site_cache[key] = self.wants_names(*key)
        return wanted

    def wants_ops(self, module: str, module_class: str) -> bool:
        """Whether the operations called inside the module of this qualified name and class get records (``ops``)."""
        if not self._ops:
            return False
        key = ("ops", module, module_class)
        wanted = self._site_cache.get(key)
        if wanted is None:
            wanted = self._site_cache[key] = any(match(module) or match(module_class) for match in self._ops)
        return wanted

    def wants_names(self, name: str, module_class: str | None) -> bool:
        """Whether a site of this qualified (or inspect) name and module class (None: match the name only) is wanted."""
        candidates = (name,) if module_class is None else (name, module_class)

        def matches(patterns: tuple[Callable[[str], bool], ...]) -> bool:
            return any(match(candidate) for match in patterns for candidate in candidates)

        return (not self._include or matches(self._include)) and not matches(self._exclude)


def _phases(value: str | Sequence[str] | None) -> frozenset[str]:
    if value is None:
        return frozenset(SELECTABLE)
    chosen = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else None
    if not chosen or any(phase not in SELECTABLE for phase in chosen):
        raise ValueError(f"phases must be one of {', '.join(map(repr, SELECTABLE))}, a list of them, or None (all), "
                         f"got {value!r}")
    return frozenset(chosen)
