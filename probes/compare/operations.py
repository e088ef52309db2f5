"""Records whose names differ between the runs, and the operations of a comparison: OTHER's records given the BASE
names they are compared under (fuzzy alignment, op alignment), then what a comparison finds of its op records.

    renames = fuzzy_renames(loaded_base, loaded_other)     # [Rename(phase, other, base, "fuzzy", confidence, why)]
    apply_renames(loaded_other, renames)                    # OTHER's records now carry BASE's names
    pairs = align_operations(loaded_base, loaded_other)   # [Rename(None, other, base, "op", confidence, why)]
    operations = find_operations(base, other, pairs, records, alone, first)   # None when neither run has op records

**Fuzzy alignment** (docs/names.md, Fuzzy alignment): on one reference step, per phase, within the segment after
each name both runs have, the records of one run only grouped by signature (module class, shape...), the i-th of a
group in BASE paired with the i-th in OTHER; the pairs hold for every step and rank.
**Op alignment** (docs/compare.md, Operations of one run only): an op record's name counts the calls of its op in
its module call, so one operation more or less shifts the later names; in each module call with op records of one
run only, both runs' op records are aligned as sequences (difflib's common runs, then decompositions by output,
shape and dtype), on the forward records, for the backward too.
**Op findings**: each diverged operation with its inputs' verdicts (``results.OpFinding``), under its module call
(``results.ModuleOps``), and the first diverging operation, from the steps of diverged operations alone. An
operation's ``inputs`` are BASE's, OTHER's (in BASE's names) where BASE's record has none (a compiled run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from difflib import SequenceMatcher
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..dump import Record
from ..dump.record import RecordKey, execution_order
from ..utils.names import ROOT_NAME
from ..utils.phases import GRADIENT_PHASES, phase_rank
from .recorddiffs import RecordDiffs
from .reading import LoadedDump, rms
from .results import (AGREES, DIFFERS, NO_RECORD, UNPAIRED, Check, Divergence, ModuleOps, OpFinding, OpName,
                      Operations, Rename, module_record, op_name)

__all__ = ["align_operations", "apply_renames", "find_operations", "fuzzy_renames", "reference_step"]

MIN_CONFIDENCE = 0.5  # of fuzzy and op alignment's pairs
CLASS_CHANGED_FACTOR = 0.75
_FORWARD = "forward"

Signature = tuple[Any, ...]
_T = TypeVar("_T")


def _matched_groups(base: list[_T], other: list[_T], signature: Callable[[_T], Signature], factor: float
                    ) -> list[tuple[list[_T], list[_T], float, str]]:
    """(BASE's, OTHER's, confidence, how many as a reason says it) of each signature both sides have, in BASE's order:
    the i-th of a group in BASE pairs with the i-th in OTHER."""
    groups_base: dict[Signature, list[_T]] = {}
    groups_other: dict[Signature, list[_T]] = {}
    for items, groups in ((base, groups_base), (other, groups_other)):
        for item in items:
            groups.setdefault(signature(item), []).append(item)
    found = []
    for key, in_base in groups_base.items():
        in_other = groups_other.get(key, [])
        if in_other:
            nb, no = len(in_base), len(in_other)
            found.append((in_base, in_other, factor * min(nb, no) / max(nb, no),
                          f"{nb}" if nb == no else f"{nb} in base, {no} in other"))
    return found


def _strict(record: Record) -> Signature:
    return (record.get("module_class"), *_loose(record))


def _loose(record: Record) -> Signature:
    shape = record.get("shape")
    return (record.get("kind"), record.get("tensor_index"), tuple(shape) if isinstance(shape, list) else shape,
            record.get("dtype"))


def reference_step(base: Mapping[int, list[int]], other: Mapping[int, list[int]]) -> tuple[int, int] | None:
    """(rank, step): the lowest common rank's first step both runs finished (rank -> steps of each)."""
    for rank in sorted(set(base) & set(other)):
        common = sorted(set(base[rank]) & set(other[rank]))
        if common:
            return rank, common[0]
    return None


def _sequence(at_step: dict[RecordKey, Record], phase: str) -> list[Record]:
    records = [record for key, record in at_step.items() if key[2] == phase]
    return sorted(records, key=lambda record: record.get("seq", 0))


def _segments(sequence: list[Record], anchors: set[str]) -> dict[str | None, list[Record]]:
    """The records of ``sequence`` that are no anchor, by the anchor before them (None: before the first)."""
    segments: dict[str | None, list[Record]] = {}
    anchor: str | None = None
    for record in sequence:
        if record["name"] in anchors:
            anchor = record["name"]
        else:
            segments.setdefault(anchor, []).append(record)
    return segments


def _pair(base: list[Record], other: list[Record], signature: Callable[[Record], Signature], factor: float,
          anchor: str | None, phase: str, found: list[Rename]) -> tuple[list[Record], list[Record]]:
    """Pairs the i-th of each signature group; returns what stays unpaired on each side."""
    paired: set[int] = set()
    for in_base, in_other, confidence, counts in _matched_groups(base, other, signature, factor):
        for ordinal, (b, o) in enumerate(zip(in_base, in_other), 1):
            found.append(Rename(phase, o["name"], b["name"], "fuzzy", round(confidence, 3),
                                _reason(b, o, ordinal, counts, anchor)))
            paired.update((id(b), id(o)))
    return [r for r in base if id(r) not in paired], [r for r in other if id(r) not in paired]


def _reason(base: Record, other: Record, ordinal: int, counts: str, anchor: str | None) -> str:
    classes = (f"class {base.get('module_class')}" if base.get("module_class") == other.get("module_class")
               else f"class {other.get('module_class')} as {base.get('module_class')}")
    return (f"{classes}, {base.get('kind')} {base.get('tensor_index')}, shape {base.get('shape')} {base.get('dtype')}; "
            f"#{ordinal} of {counts} such after {anchor if anchor else 'the start'}")


def fuzzy_renames(base: LoadedDump, other: LoadedDump) -> list[Rename]:
    """The pairs of names found in one run only that stand for the same tensor, made at ``MIN_CONFIDENCE`` or more
    (see the module docstring)."""
    reference = reference_step(base.steps_by_rank, other.steps_by_rank)
    if reference is None:
        return []
    at_base, at_other = base.step_records(*reference), other.step_records(*reference)
    found: list[Rename] = []
    for phase in sorted({key[2] for key in at_base}):
        base_sequence, other_sequence = _sequence(at_base, phase), _sequence(at_other, phase)
        anchors = {r["name"] for r in base_sequence} & {r["name"] for r in other_sequence}
        segments_base, segments_other = _segments(base_sequence, anchors), _segments(other_sequence, anchors)
        for anchor, in_base in segments_base.items():
            in_other = segments_other.get(anchor, [])
            in_base, in_other = _pair(in_base, in_other, _strict, 1.0, anchor, phase, found)
            _pair(in_base, in_other, _loose, CLASS_CHANGED_FACTOR, anchor, phase, found)
    order = {(r["phase"], r["name"]): r.get("seq", 0) for r in at_base.values()}
    kept = [rename for rename in found if rename.confidence >= MIN_CONFIDENCE]
    return sorted(kept, key=lambda rename: (phase_rank(rename.phase), order.get((rename.phase, rename.base), 0)))


def apply_renames(loaded: LoadedDump, renames: Iterable[Rename]) -> None:
    """Gives ``loaded``'s records (every rank and step) the BASE names of ``renames``; the original name is
    kept as ``renamed_from``. A record whose new key is already taken keeps its name."""
    by_name = {(rename.phase, rename.other): rename.base for rename in renames}
    if not by_name:
        return
    names = [name for _, name in by_name]
    involved = np.flatnonzero(pc.is_in(loaded.table.column("name"),
                                       value_set=pa.array(names + list(by_name.values()), pa.string()))
                              .to_numpy(zero_copy_only=False))
    keys = loaded.keys(involved)
    taken = set(keys)
    new_names = {}
    for row, (rank, step, phase, name) in zip(involved.tolist(), keys):
        new = by_name.get((phase, name))
        if new is not None and (rank, step, phase, new) not in taken:
            new_names[row] = new
    loaded.rename(new_names)


@dataclass(frozen=True)
class _Op:
    row: int
    rank: int
    step: int
    phase: str
    seq: int
    name: str
    parsed: OpName
    shape: tuple[int, ...] | None
    dtype: str | None

    @property
    def key(self) -> tuple[int, int, str, str]:
        return self.rank, self.step, self.phase, self.name

    @property
    def strict(self) -> tuple[Any, ...]:
        return (self.parsed.op, *self.loose)

    @property
    def loose(self) -> tuple[Any, ...]:
        return self.parsed.output, self.shape, self.dtype


def _is_op(loaded: LoadedDump) -> np.ndarray:
    """Per row of ``loaded``: whether it is an op record (kind "op")."""
    return pc.fill_null(pc.equal(loaded.table.column("kind"), "op"), False).to_numpy(zero_copy_only=False)


def _same_keys(base: LoadedDump, rows_base: np.ndarray, other: LoadedDump, rows_other: np.ndarray) -> bool:
    """Whether both runs have the same op records in the same order (the common case: nothing to align)."""
    if len(rows_base) != len(rows_other) or not (np.array_equal(base.rank[rows_base], other.rank[rows_other])
                                                 and np.array_equal(base.step[rows_base], other.step[rows_other])):
        return False
    at_base, at_other = pa.array(rows_base, pa.int64()), pa.array(rows_other, pa.int64())
    return all(base.table.column(name).take(at_base).equals(other.table.column(name).take(at_other))
               for name in ("phase", "name"))


def _ops(loaded: LoadedDump, rows: np.ndarray) -> list[_Op]:
    part = loaded.table.select(["phase", "name", "shape", "dtype"]).take(pa.array(rows, pa.int64()))
    found = []
    for row, rank, step, seq, phase, name, shape, dtype in zip(
            rows.tolist(), loaded.rank[rows].tolist(), loaded.step[rows].tolist(), loaded.seq[rows].tolist(),
            *(part.column(column).to_pylist() for column in ("phase", "name", "shape", "dtype"))):
        parsed = op_name(name)
        if parsed is not None:
            found.append(_Op(row, rank, step, phase, seq, name, parsed, None if shape is None else tuple(shape), dtype))
    return found


def _ordered(ops: list[_Op], phase: str) -> list[_Op]:
    return sorted((op for op in ops if op.phase == phase), key=lambda op: op.seq)


def _describe(op: _Op) -> str:
    return f"output {op.parsed.output}, shape {list(op.shape) if op.shape is not None else None} {op.dtype}"


def _aligned(base: list[_Op], other: list[_Op]) -> list[tuple[_Op, _Op, float, str]]:
    """(base op, other op, confidence, reason) of the pairs of two sequences of one module call and phase."""
    found: list[tuple[_Op, _Op, float, str]] = []
    matcher = SequenceMatcher(None, [op.strict for op in base], [op.strict for op in other], autojunk=False)
    for tag, b1, b2, o1, o2 in matcher.get_opcodes():
        if tag == "equal":
            found += [(b, o, 1.0, f"the same operation at the same place of the module call's operations "
                                  f"({b.parsed.op}, {_describe(b)})") for b, o in zip(base[b1:b2], other[o1:o2])]
        elif tag == "replace":
            found += _decomposed(base[b1:b2], other[o1:o2])
    return found


def _decomposed(base: list[_Op], other: list[_Op]) -> list[tuple[_Op, _Op, float, str]]:
    """Pairs between two common runs: a name both runs have there as it is, the rest by output, shape, dtype."""
    kept = {op.name for op in base} & {op.name for op in other}  # compared as they are: no pair to make
    found: list[tuple[_Op, _Op, float, str]] = []
    for in_base, in_other, confidence, counts in _matched_groups(
            [op for op in base if op.name not in kept], [op for op in other if op.name not in kept],
            lambda op: op.loose, CLASS_CHANGED_FACTOR):
        confidence = round(confidence, 3)
        if confidence < MIN_CONFIDENCE:
            continue
        for ordinal, (b, o) in enumerate(zip(in_base, in_other), 1):
            how = b.parsed.op if b.parsed.op == o.parsed.op else f"{o.parsed.op} as {b.parsed.op}"
            found.append((b, o, confidence, f"{how}, {_describe(b)}; #{ordinal} of {counts} such between the "
                                            "same operations of both runs"))
    return found


def align_operations(base: LoadedDump, other: LoadedDump) -> list[Rename]:
    """Pairs the op records of module calls where the two runs' op records differ (module docstring), renames
    ``other``'s paired records to their BASE names, and returns the pairs whose names differ, in BASE's execution
    order (each pair once, whatever the steps and ranks it holds in)."""
    rows_base, rows_other = np.flatnonzero(_is_op(base)), np.flatnonzero(_is_op(other))
    if not len(rows_base) or not len(rows_other) or _same_keys(base, rows_base, other, rows_other):
        return []
    ops_base, ops_other = _ops(base, rows_base), _ops(other, rows_other)
    keys_base, keys_other = {op.key for op in ops_base}, {op.key for op in ops_other}
    if keys_base == keys_other:
        return []
    touched = {(op.rank, op.step, *op.parsed.site) for ops, keys in ((ops_base, keys_other), (ops_other, keys_base))
               for op in ops if op.key not in keys}
    calls: tuple[dict[tuple[int, int, str, int], list[_Op]], ...] = ({}, {})
    for ops, by_call in zip((ops_base, ops_other), calls):
        for op in ops:
            by_call.setdefault((op.rank, op.step, *op.parsed.site), []).append(op)
    renames: dict[tuple[str | None, str, str], tuple[tuple[int, int, int, int], Rename]] = {}
    new_names: dict[int, str] = {}  # other row -> its BASE name
    for call in sorted(touched):
        in_base, in_other = calls[0].get(call, []), calls[1].get(call, [])
        both = {op.phase for op in in_base} & {op.phase for op in in_other}
        for phase in [_FORWARD] if _FORWARD in both else sorted(both):
            mapping = {o.name: (b.name, confidence, reason) for b, o, confidence, reason
                       in _aligned(_ordered(in_base, phase), _ordered(in_other, phase)) if b.name != o.name}
            targets = {target for target, _, _ in mapping.values()}
            for op in in_other:
                if op.phase != phase and phase != _FORWARD:
                    continue
                if op.name in mapping:
                    new_names[op.row] = mapping[op.name][0]
                elif op.name in targets:  # left unpaired, its name taken by a paired record: a key holds one record
                    new_names[op.row] = op.name + UNPAIRED
            seq_of = {op.name: op for op in _ordered(in_base, phase)}
            for name, (target, confidence, reason) in mapping.items():
                at = seq_of[target]
                key = (None if phase == _FORWARD else phase, name, target)
                order = execution_order(at.step, at.phase, at.seq, at.rank)
                if key not in renames or order < renames[key][0]:
                    renames[key] = (order, Rename(key[0], name, target, "op", confidence, reason))
    if new_names:
        other.rename(new_names)
    return [rename for _, rename in sorted(renames.values(), key=lambda item: item[0])]


_UNNAMED = "a parameter, a constant or a tensor made outside the recorded modules"  # an input named ""
_UNRECORDED = "not recorded, or not compared"
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
        self._base_rows = pairs[0]
        # Records whose mask fills set their magnitude (reading._unfilled gave them a smaller scale than their
        # rms): a difference relative to that magnitude says nothing, so they are weighed by ratio alone.
        table = base.table
        with np.errstate(invalid="ignore"):
            self._filled = table.column("scale").to_numpy(zero_copy_only=False) < rms(
                *(table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
                  for name in ("numel", "mean", "std")))
        self.rows: dict[tuple[int, int, str, str], _Row] = {}
        self._metrics: dict[int, tuple[str, float]] = {}
        renamed = self._renamed(other, steps)
        at = np.flatnonzero(base.in_steps(steps, pairs[0]))  # matched pairs; records of one run only: ``alone``
        for pair, found, fallback in zip(at.tolist(), self._gather(base, pairs[0][at]),
                                         other.column("inputs", pairs[1][at])):
            if found.inputs is None and fallback is not None:  # BASE recorded no provenance (compiled)
                found = replace(found, inputs=_mapped(found, fallback, renamed))
            self._add(replace(found, pair=pair))
        for side, loaded, rows in (("base", base, alone[0]), ("other", other, alone[1])):
            for found in self._gather(loaded, rows[loaded.in_steps(steps, rows)]):
                self._add(replace(found, side=side, inputs=_mapped(found, found.inputs, renamed) if side == "other"
                                  else found.inputs))

    @staticmethod
    def _renamed(other: LoadedDump, steps: set[tuple[int, int]]) -> dict[tuple[int, int, str], str]:
        """(rank, step, OTHER's original name) -> the BASE name it is compared under, in ``steps``."""
        rows = np.flatnonzero(other.table.column("renamed_from").is_valid().to_numpy(zero_copy_only=False))
        rows = rows[other.in_steps(steps, rows)]
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
        rel_error = self.rel_error(row)
        if not self.diverged(row):
            return Check(name, phase, AGREES, ratio=float(self.records.ratio[row.pair]), rel_error=rel_error)
        metric, ratio = self.metric(row)
        return Check(name, phase, DIFFERS, metric, ratio, "" if row.side == "both" else f"only in {row.side}",
                     rel_error)

    def rel_error(self, row: _Row) -> float | None:
        """The record's difference relative to its magnitude (None: in one run only, or mask fills set the
        magnitude)."""
        if row.pair is None or self._filled[self._base_rows[row.pair]]:
            return None
        return float(self.records.rel_error[row.pair])


def _mapped(row: _Row, inputs: list[str] | None, renamed: dict[tuple[int, int, str], str]) -> list[str] | None:
    """OTHER's ``inputs`` of ``row`` in BASE's names."""
    return None if inputs is None else [renamed.get((row.rank, row.step, name), name) for name in inputs]


def _inside(module: str, outer: str) -> bool:
    """Whether ``module`` is ``outer`` or a module inside it."""
    return outer == ROOT_NAME or module == outer or module.startswith(outer + ".")


def find_operations(base: LoadedDump, other: LoadedDump, pairs: tuple[np.ndarray, np.ndarray], records: RecordDiffs,
                    alone: tuple[np.ndarray, np.ndarray], first: Divergence | None) -> Operations | None:
    """The op findings of one comparison; ``pairs``: the matched (base rows, other rows), in the order of
    ``records``; ``alone``: the rows of each run in one run only, in steps both runs finished (divergences);
    ``first``: the first divergence. None when neither run has op records."""
    is_op, other_op = _is_op(base), _is_op(other)
    if not is_op.any() and not other_op.any():
        return None
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
    phase = _FORWARD if row.phase in GRADIENT_PHASES else row.phase  # a gradient's inputs: the forward values
    inputs = tuple(found.check(row.rank, row.step, phase, name) for name in row.inputs or ())
    gradients: tuple[Check, ...] = ()
    if row.phase in GRADIENT_PHASES:
        gradients = tuple(found.check(row.rank, row.step, row.phase, name)
                          for _, name in sorted(consumers.get((row.rank, row.step, row.name), [])))
    return OpFinding(row.rank, row.step, row.phase, row.name, row.seq, metric, float(ratio), inputs, gradients,
                     reads_nothing=row.inputs is not None and not row.inputs, rel_error=found.rel_error(row))


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
    module = site[0]

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