"""What a comparison (one window of steps) finds of its op records: each diverged operation with what its inputs'
records say (``results.OpFinding``), grouped under its module call (``results.ModuleOps``), and the first diverging
operation (``results.Operations``).

    operations = find_operations(base, other, pairs, records, alone, first)   # None when neither run has op records

Only the steps of diverged operations (and of the first divergence) are looked at, on their rows alone; a dump
without op records costs one pass over its ``kind`` column. An operation's ``inputs`` are BASE's (the record
names of its tensor arguments), OTHER's where BASE's record has none (a compiled run records no provenance),
written in BASE's names (``renamed_from``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa

from ..dump.record import execution_order
from ..utils.phases import GRADIENT_PHASES
from .recorddiffs import RecordDiffs
from .align import op_rows
from .reading import LoadedDump
from .results import (AGREES, DIFFERS, NO_RECORD, Check, Divergence, ModuleOps, OpFinding, Operations, module_record,
                      op_name)

__all__ = ["find_operations"]

_FORWARD = "forward"
_UNNAMED = "a parameter, a constant or a tensor made outside the recorded modules"  # an input named ""
_UNRECORDED = "not recorded, or not compared"
_ROOT = "<root>"  # the root module's name in records (probes.core.manager.ROOT_NAME)
# What tells that a module's output record is the output of an operation the module returned: the same values.
_SAME_TENSOR = ("shape", "dtype", "numel", "min", "max", "mean", "std", "norm", "samples")
_NUMEL = _SAME_TENSOR.index("numel")


@dataclass(frozen=True)
class _Row:
    """One record of the steps looked at: a matched pair (``pair``: its index in ``records``) or one run's record."""

    rank: int
    step: int
    phase: str
    seq: int
    name: str
    kind: str | None
    inputs: list[str] | None
    values: tuple  # _SAME_TENSOR of the record (of BASE for a pair)
    pair: int | None = None  # the matched pair, None for a record in one run only
    side: str = "both"  # "both", "base" or "other"


class _Steps:
    """The records of some (rank, step)s of both runs, by key, with what each says."""

    def __init__(self, base: LoadedDump, other: LoadedDump, pairs: tuple[np.ndarray, np.ndarray],
                 records: RecordDiffs, alone: tuple[np.ndarray, np.ndarray], steps: set[tuple[int, int]]) -> None:
        self.records = records
        self.rows: dict[tuple[int, int, str, str], _Row] = {}
        self._metrics: dict[int, tuple[str, float]] = {}
        renamed = self._renamed(other, steps)
        chosen = pairs[0][_at(base, steps, pairs[0])]  # matched rows; those in one run only come from ``alone``
        pair_of = np.full(len(base), -1, np.int64)
        pair_of[pairs[0]] = np.arange(len(pairs[0]))
        partner = np.full(len(base), -1, np.int64)
        partner[pairs[0]] = pairs[1]
        inputs_other = other.column("inputs", partner[chosen])
        for row, found, fallback in zip(chosen.tolist(), self._gather(base, chosen), inputs_other):
            if found.inputs is None and fallback is not None:  # BASE recorded no provenance (compiled)
                found = replace(found, inputs=_mapped(found, fallback, renamed))
            self._add(replace(found, pair=int(pair_of[row])))
        for side, loaded, rows in (("base", base, alone[0]), ("other", other, alone[1])):
            for found in self._gather(loaded, rows[_at(loaded, steps, rows)]):
                self._add(replace(found, side=side, inputs=_mapped(found, found.inputs, renamed) if side == "other"
                                  else found.inputs))

    @staticmethod
    def _renamed(other: LoadedDump, steps: set[tuple[int, int]]) -> dict[tuple[int, int, str], str]:
        """(rank, step, OTHER's original name) -> the BASE name it is compared under, in ``steps``."""
        renamed = other.table.column("renamed_from").is_valid().to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(renamed)
        rows = rows[_at(other, steps, rows)]
        return dict(zip(zip(other.rank[rows].tolist(), other.step[rows].tolist(), other.column("renamed_from", rows)),
                        other.column("name", rows)))

    @staticmethod
    def _gather(loaded: LoadedDump, rows: np.ndarray) -> list[_Row]:
        part = loaded.table.select(["phase", "name", "kind", "inputs", *_SAME_TENSOR]).take(pa.array(rows, pa.int64()))
        values = zip(*(part.column(name).to_pylist() for name in _SAME_TENSOR))
        return [_Row(*fields, tuple(tuple(value) if isinstance(value, list) else value for value in same))
                for *fields, same in zip(loaded.rank[rows].tolist(), loaded.step[rows].tolist(),
                                         part.column("phase").to_pylist(), loaded.seq[rows].tolist(),
                                         part.column("name").to_pylist(), part.column("kind").to_pylist(),
                                         part.column("inputs").to_pylist(), values)]

    def _add(self, row: _Row) -> None:
        self.rows[(row.rank, row.step, row.phase, row.name)] = row

    def metric(self, row: _Row) -> tuple[str, float]:
        """(the metric that broke, |diff| / tolerance) of a diverged record."""
        if row.pair is None:
            return "record", math.inf
        if not self._metrics:  # every diverged pair of these steps at once, from the arrays where they say it
            pairs = sorted({found.pair for found in self.rows.values() if found.pair is not None and
                            self.diverged(found)})
            named = self.records.worst_metric_names(pairs)
            self._metrics = {pair: (metric, float(self.records.ratio[pair])) for pair, metric in zip(pairs, named)
                             if metric is not None}
            built = [pair for pair, metric in zip(pairs, named) if metric is None]
            for pair, record in zip(built, self.records.at(built)):  # built together: fastest
                worst = record.worst
                self._metrics[pair] = (worst.metric if worst is not None else "record", record.ratio)
        return self._metrics[row.pair]

    def diverged(self, row: _Row) -> bool:
        return row.pair is None or bool(self.records.diverged[row.pair])

    def check(self, rank: int, step: int, phase: str, name: str) -> Check:
        """What the record ``name`` of (rank, step, phase) says."""
        if not name:
            return Check(name, phase, NO_RECORD, note=_UNNAMED)
        row = self.rows.get((rank, step, phase, name))
        if row is None:
            return Check(name, phase, NO_RECORD, note=_UNRECORDED)
        if not self.diverged(row):
            return Check(name, phase, AGREES, ratio=float(self.records.ratio[row.pair]))
        metric, ratio = self.metric(row)
        return Check(name, phase, DIFFERS, metric, ratio, "" if row.side == "both" else f"only in {row.side}")


def _at(loaded: LoadedDump, steps: set[tuple[int, int]], rows: np.ndarray | None = None) -> np.ndarray:
    """The rows (of ``rows``; all by default) in one of the (rank, step)s ``steps``: positions in ``rows`` when
    given, else rows."""
    if not steps:
        return np.zeros(0, np.int64)
    wanted = np.array(sorted(rank * (1 << 32) + step for rank, step in steps), np.int64)
    if rows is None:
        return np.flatnonzero(np.isin(loaded.rank * (1 << 32) + loaded.step, wanted))
    return np.flatnonzero(np.isin(loaded.rank[rows] * (1 << 32) + loaded.step[rows], wanted))


def _mapped(row: _Row, inputs: list[str] | None, renamed: dict[tuple[int, int, str], str]) -> list[str] | None:
    """OTHER's ``inputs`` of ``row`` in BASE's names."""
    return None if inputs is None else [renamed.get((row.rank, row.step, name), name) for name in inputs]


def _inside(module: str, outer: str) -> bool:
    """Whether ``module`` is ``outer`` or a module inside it."""
    return outer == _ROOT or module == outer or module.startswith(outer + ".")


def _input_phase(phase: str) -> str:
    """The phase an operation's inputs are looked up in: the forward values, for a gradient too."""
    return _FORWARD if phase in GRADIENT_PHASES else phase


def find_operations(base: LoadedDump, other: LoadedDump, pairs: tuple[np.ndarray, np.ndarray], records: RecordDiffs,
                    alone: tuple[np.ndarray, np.ndarray], first: Divergence | None) -> Operations | None:
    """The op findings of one comparison; ``pairs``: the matched (base rows, other rows), in the order of
    ``records``; ``alone``: the rows of each run in one run only, in steps both runs finished (divergences);
    ``first``: the first divergence. None when neither run has op records."""
    rows_base, rows_other = op_rows(base), op_rows(other)
    if not len(rows_base) and not len(rows_other):
        return None
    is_op = np.zeros(len(base), dtype=bool)
    is_op[rows_base] = True
    other_op = np.zeros(len(other), dtype=bool)
    other_op[rows_other] = True
    matched = np.flatnonzero(is_op[pairs[0]])
    diverged = matched[np.asarray(records.diverged, bool)[matched]] if len(matched) else matched
    alone = (alone[0][is_op[alone[0]]], alone[1][other_op[alone[1]]])
    steps = {(int(base.rank[pairs[0][at]]), int(base.step[pairs[0][at]])) for at in diverged.tolist()}
    for loaded, rows in zip((base, other), alone):
        steps |= set(zip(loaded.rank[rows].tolist(), loaded.step[rows].tolist()))
    if first is not None:
        steps.add((first.rank, first.step))
    found = _Steps(base, other, pairs, records, alone, steps)
    consumers = _consumers(found)
    subjects = sorted((row for row in found.rows.values() if row.kind == "op" and found.diverged(row)),
                      key=lambda row: execution_order(row.step, row.phase, row.seq, row.rank))
    findings = [_finding(found, row, consumers) for row in subjects]
    operations = Operations(len(matched), len(diverged), _grouped(found, findings))
    if first is not None:
        _first(operations, found, findings, first)
    return operations


def _consumers(found: _Steps) -> dict[tuple[int, int, str], list[tuple[int, str]]]:
    """(rank, step, record name) -> (seq, name) of the forward records that took it on: the op records that took it
    as an input, and the output records of the modules that returned it: module outputs after it with its values
    (``_SAME_TENSOR``; the latest such operation), of its operation's module or of a module inside or around that
    one (an op-selected module calling a submodule whose own operations are not recorded: ``attn/linear:0`` is
    ``attn.qkv.output.0``)."""
    consumers: dict[tuple[int, int, str], list[tuple[int, str]]] = {}
    by_values: dict[tuple, list[tuple[int, str, str]]] = {}  # (rank, step, values) -> (seq, name, module) of ops
    for row in found.rows.values():
        parsed = op_name(row.name) if row.kind == "op" and row.phase == _FORWARD else None
        if parsed is not None:
            if row.values[_NUMEL] is not None:
                by_values.setdefault((row.rank, row.step, row.values), []).append((row.seq, row.name, parsed.module))
            for name in dict.fromkeys(row.inputs or ()):
                if name:
                    consumers.setdefault((row.rank, row.step, name), []).append((row.seq, row.name))
    for row in found.rows.values():
        site = module_record(row.name) if row.kind == "output" and row.phase == _FORWARD else None
        if site is None:
            continue
        returned = [(seq, name) for seq, name, module in by_values.get((row.rank, row.step, row.values), [])
                    if seq < row.seq and (_inside(module, site[0]) or _inside(site[0], module))]
        if returned:
            consumers.setdefault((row.rank, row.step, max(returned)[1]), []).append((row.seq, row.name))
    return consumers


def _finding(found: _Steps, row: _Row, consumers: dict[tuple[int, int, str], list[tuple[int, str]]]) -> OpFinding:
    metric, ratio = found.metric(row)
    phase = _input_phase(row.phase)
    inputs = tuple(found.check(row.rank, row.step, phase, name) for name in row.inputs or ())
    gradients: tuple[Check, ...] = ()
    if row.phase in GRADIENT_PHASES:
        gradients = tuple(found.check(row.rank, row.step, row.phase, name)
                          for _, name in sorted(consumers.get((row.rank, row.step, row.name), [])))
    return OpFinding(row.rank, row.step, row.phase, row.name, row.seq, metric, float(ratio), inputs, gradients)


def _grouped(found: _Steps, findings: Sequence[OpFinding]) -> list[ModuleOps]:
    """The findings under their module call, in execution order of each call's first finding."""
    groups: dict[tuple[int, int, str, str, int], list[OpFinding]] = {}
    for finding in findings:
        groups.setdefault((finding.rank, finding.step, finding.phase, *finding.parsed.site), []).append(finding)
    own: dict[tuple[int, int, str, str, int], list[_Row]] = {}
    for row in found.rows.values():
        site = module_record(row.name) if row.kind in ("input", "output") else None
        key = None if site is None else (row.rank, row.step, row.phase, *site)
        if key in groups:
            own.setdefault(key, []).append(row)
    return [ModuleOps(*key, tuple(found.check(row.rank, row.step, row.phase, row.name)
                                  for row in sorted(own.get(key, []), key=lambda row: row.seq)), tuple(listed))
            for key, listed in groups.items()]


def _first(operations: Operations, found: _Steps, findings: Sequence[OpFinding], first: Divergence) -> None:
    """The first diverging operation: the first divergence itself, or the earliest diverged operation of its module
    call (or of a module inside it) in the same rank, step and phase."""
    key = (first.rank, first.step, first.phase, first.name)
    if op_name(first.name) is not None:
        operations.first = next((finding for finding in findings if finding.key == key), None)
        return
    site = module_record(first.name)
    if site is None:
        return
    module, call = site

    def within(name: str) -> bool:
        parsed = op_name(name)
        return parsed is not None and (parsed.site == site or (parsed.module != module and _inside(parsed.module,
                                                                                                     module)))

    inside = [row for row in found.rows.values()
              if (row.rank, row.step, row.phase) == key[:3] and row.kind == "op" and within(row.name)]
    if not inside:
        return
    operations.inside_first = len(inside)
    operations.first = next((finding for finding in findings
                             if finding.key[:3] == key[:3] and within(finding.name)), None)
