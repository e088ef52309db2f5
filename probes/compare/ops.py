"""Operations inside a module, as a comparison sees them: their names, the module call they belong to, what their
inputs' records say, and whether an operation's error is its own or reached it.

    found = op_name("encoder.layers.0.self_attn/einsum:2#1.output.0")
    found.module, found.call, found.op, found.index, found.output    # 'encoder.layers.0.self_attn', 1, 'einsum', 2, 0
    found.short                                                       # 'einsum:2#1.output.0'
    report.first_operation.cause; report.first_operation.explained()  # "local", "the operation itself: ..."
    report.operations.modules[0].ops                                  # the diverged operations of one module call

An op record (kind "op") is named ``<module>/<op>:<k>[#<c>].output.<i>``: output ``i`` of the k-th call of
``op`` in the c-th call (0: the first, not written) of the module in its step. Its ``inputs`` list the record
names its tensor arguments were ("" where none: a parameter, a constant, a tensor made outside the recorded
modules). The cause of a diverged operation, from those records of the same rank and step:

- **forward** (and ``recompute``): ``propagated`` when the forward record of an input differs; ``local`` (the operation itself)
  when none differs and at least one agrees; ``unknown`` when no input has a record to tell.
- **backward**: the gradient of an operation's output is computed from the gradients of the operations that
  used that output (``gradients``: their backward records) and the forward values (``inputs``: the forward
  records, by the same names); ``propagated`` when one of these differs, ``local`` (the backward of the
  operations that used it) when none does and a gradient it is computed from is recorded and agrees,
  ``unknown`` otherwise.

Nothing here reads a dump: ``opfinding`` computes the findings on a window's arrays.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..utils.phases import GRADIENT_PHASES
from .values import json_value

__all__ = ["AGREES", "DIFFERS", "NO_RECORD", "Check", "ModuleOps", "OpFinding", "OpName", "Operations", "module_record",
           "op_name", "relative_name"]

AGREES, DIFFERS, NO_RECORD = "agrees", "differs", "no record"  # what a record looked up by name says
LOCAL, PROPAGATED, UNKNOWN = "local", "propagated", "unknown"  # the cause of an operation's divergence

_OP = re.compile(r"^(?P<module>.+)/(?P<op>[^/:#.]+):(?P<index>\d+)(?:#(?P<call>\d+))?\.output\.(?P<output>\d+)$")
_MODULE = re.compile(r"^(?P<module>.+?)(?:#(?P<call>\d+))?\.(?:input|output)\.\d+$")


@dataclass(frozen=True)
class OpName:
    """An op record's name taken apart (``op_name``)."""

    module: str
    call: int  # the module's call in its step (0: the first)
    op: str
    index: int  # the k-th call of ``op`` in that call of the module
    output: int  # the op's output tensor

    @property
    def short(self) -> str:
        """The name below its module: ``einsum:2.output.0`` (``einsum:2#1.output.0`` in the module's second call)."""
        return f"{self.op}:{self.index}{f'#{self.call}' if self.call else ''}.output.{self.output}"

    @property
    def site(self) -> tuple[str, int]:
        """(module, call): the module call the operation ran in."""
        return self.module, self.call


def op_name(name: str) -> OpName | None:
    """``name`` taken apart when it is an op record's, else None."""
    found = _OP.match(name)
    if found is None:
        return None
    return OpName(found["module"], int(found["call"] or 0), found["op"], int(found["index"]), int(found["output"]))


def module_record(name: str) -> tuple[str, int] | None:
    """(module, call) of a module's input or output record (``blocks.0.attn#1.output.0``), else None."""
    if op_name(name) is not None:
        return None
    found = _MODULE.match(name)
    return None if found is None else (found["module"], int(found["call"] or 0))


def relative_name(name: str, module: str) -> str:
    """``name`` as it reads under ``module``: an operation of that module by its short name (``einsum:2.output.0``),
    any other record in full."""
    found = op_name(name)
    return found.short if found is not None and found.module == module else name


@dataclass(frozen=True)
class Check:
    """What one record, looked up by its name in the same rank and step, says: it agrees, it differs, or there is
    none. ``metric``, ``ratio``: the metric that broke and its |diff| / tolerance (``record``, inf: the record is in
    one run only); ``note``: why there is no record, or which run has it."""

    name: str
    phase: str
    status: str  # AGREES, DIFFERS or NO_RECORD
    metric: str | None = None
    ratio: float | None = None
    note: str = ""

    def describe(self, module: str = "", own: bool = False) -> str:
        """``"linear:0.output.0 differs (mean, ratio 12)"``; names of ``module``'s operations short, and with ``own``
        (the module's own records) the module's name left out (``output.0``)."""
        name = relative_name(self.name, module) if self.name else "(no record name)"
        if own and module_record(self.name) is not None and self.name.startswith(module):
            name = self.name[len(module):].lstrip(".")
        detail = ", ".join(part for part in (self.metric if self.status == DIFFERS else None,
                                             f"ratio {self.ratio:.3g}" if self.status == DIFFERS
                                             and self.ratio is not None and math.isfinite(self.ratio) else None,
                                             self.note or None) if part)
        return f"{name} {self.status}" + (f" ({detail})" if detail else "")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "phase": self.phase, "status": self.status, "metric": self.metric,
                "ratio": json_value(self.ratio), "note": self.note}


@dataclass(frozen=True)
class OpFinding:
    """A diverged operation's record: where it is, what broke, and what its inputs' records say.

    ``inputs``: per tensor argument, in order, its forward record (for a backward record too: the forward values
    its gradient is computed at); ``gradients``: backward records only, the backward records of the operations
    that used this output (its gradient is computed from theirs), in their forward order.
    """

    rank: int
    step: int
    phase: str
    name: str
    seq: int
    metric: str
    ratio: float
    inputs: tuple[Check, ...]
    gradients: tuple[Check, ...] = ()

    @property
    def parsed(self) -> OpName:
        found = op_name(self.name)
        assert found is not None
        return found

    @property
    def key(self) -> tuple[int, int, str, str]:
        return self.rank, self.step, self.phase, self.name

    @property
    def differing(self) -> list[Check]:
        """The records it is computed from that already differ."""
        return [check for check in (*self.inputs, *self.gradients) if check.status == DIFFERS]

    @property
    def cause(self) -> str:
        """``propagated``, ``local`` or ``unknown`` (the module docstring)."""
        if self.differing:
            return PROPAGATED
        sources = self.gradients if self.phase in GRADIENT_PHASES else self.inputs
        return LOCAL if any(check.status == AGREES for check in sources) else UNKNOWN

    def explained(self) -> str:
        """The cause in words, e.g. ``"propagated: an input already differs: linear:0.output.0"``."""
        module = self.parsed.module
        cause = self.cause
        if cause == PROPAGATED:
            said = []
            for checks, one, several in ((self.inputs, "an input", "inputs"),
                                         (self.gradients, "a gradient it is computed from",
                                          "gradients it is computed from")):
                names = [relative_name(check.name, module) for check in checks if check.status == DIFFERS]
                if names:
                    what = one if len(names) == 1 else several
                    if checks is self.inputs and self.phase in GRADIENT_PHASES:
                        what += "'s forward value" if len(names) == 1 else "' forward values"
                    said.append(f"{what} already {'differs' if len(names) == 1 else 'differ'}: {', '.join(names)}")
            return "propagated: " + "; ".join(said)
        unrecorded = sum(check.status == NO_RECORD for check in self.inputs)
        without = f"; {unrecorded} {'input has' if unrecorded == 1 else 'inputs have'} no record" if unrecorded else ""
        if cause == LOCAL:
            if self.phase not in GRADIENT_PHASES:
                return f"local: the operation itself (every recorded input agrees{without})"
            return ("local: the backward of the operations that used it (the gradients it is computed from and the "
                    f"forward values agree{without})")
        if self.phase not in GRADIENT_PHASES:
            return "unknown: no input of it has a record to tell a local error from a propagated one"
        return ("unknown: no gradient it is computed from has a record (no recorded operation used this output) to "
                "tell a local error from a propagated one")

    def to_json(self) -> dict[str, Any]:
        parsed = self.parsed
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "name": self.name, "seq": self.seq,
                "module": parsed.module, "call": parsed.call, "op": parsed.op, "index": parsed.index,
                "output": parsed.output, "metric": self.metric, "ratio": json_value(self.ratio),
                "cause": self.cause, "explanation": self.explained(),
                "inputs": [check.to_json() for check in self.inputs],
                "gradients": [check.to_json() for check in self.gradients]}


@dataclass(frozen=True)
class ModuleOps:
    """One call of one module (rank, step, phase) with diverged operations: its own records, then those operations
    in execution order. How the reports nest op records under their module."""

    rank: int
    step: int
    phase: str
    module: str
    call: int
    records: tuple[Check, ...]  # the module's own input and output records of this call, in execution order
    ops: tuple[OpFinding, ...]

    @property
    def label(self) -> str:
        return f"{self.module}{f'#{self.call}' if self.call else ''}"

    def own(self) -> str:
        """Its own records in a line: ``"input.0 agrees, output.0 differs (std, ratio 4)"``."""
        return ", ".join(check.describe(self.module, own=True) for check in self.records) or "no record of its own"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "module": self.module, "call": self.call,
                "records": [check.to_json() for check in self.records], "ops": [op.to_json() for op in self.ops]}


@dataclass
class Operations:
    """What a comparison says of op records, when a run has them (``Report.operations``; None when neither has).

    ``matched``, ``diverged``: op records matched, and diverged; ``modules``: the module calls with diverged
    operations (matched, or in one run only in a step both finished), in execution order of their first;
    ``first``: the first diverging operation: the first divergence itself, or the earliest diverged operation
    of the first divergence's module call (or of a module inside it) when the first divergence is that module's
    record; ``inside_first``: then, how many op records that module call has in the phase (None: the first
    divergence is no module record, or there is no first divergence).
    """

    matched: int = 0
    diverged: int = 0
    modules: list[ModuleOps] = field(default_factory=list)
    first: OpFinding | None = None
    inside_first: int | None = None

    @classmethod
    def merged(cls, parts: "list[Operations]", first: "Operations | None") -> "Operations":
        """The operations of records compared in parts (windows, in execution order); ``first``: the part with the
        first divergence."""
        return cls(sum(part.matched for part in parts), sum(part.diverged for part in parts),
                   [group for part in parts for group in part.modules],
                   None if first is None else first.first, None if first is None else first.inside_first)

    def first_line(self, divergence_name: str) -> str | None:
        """The first diverging operation in a sentence, relative to the first divergence (named
        ``divergence_name``); None when there is nothing to say."""
        first = self.first
        if first is None:
            if self.inside_first:
                return (f"its {self.inside_first} recorded operations agree: the difference is in what op records "
                        "leave out (views, indexing, in-place calls) or in the module's own output")
            return None
        if first.name == divergence_name:
            return first.explained()
        return f"first diverging operation inside: {first.name} ({first.metric}, ratio {first.ratio:.3g}); {first.explained()}"

    def to_json(self) -> dict[str, Any]:
        return {"matched": self.matched, "diverged": self.diverged,
                "first": None if self.first is None else self.first.to_json(), "inside_first": self.inside_first,
                "modules": [group.to_json() for group in self.modules]}
