"""Aligning the records of two runs whose names differ: renamed modules (fuzzy alignment) and operations whose
decompositions differ (op alignment). Both give OTHER's records the BASE names they are compared under.

    renames = fuzzy_renames(loaded_base, loaded_other)     # [Rename(phase, other, base, "fuzzy", confidence, why)]
    apply_renames(loaded_other, renames)                    # OTHER's records now carry BASE's names
    probes compare eager_out refactored_out --fuzzy
    pairs = align_operations(loaded_base, loaded_other)   # [Rename(None, other, base, "op", confidence, why)]
    # loaded_other's op records now carry the BASE names they are compared under (original: ``renamed_from``)

**Fuzzy alignment** pairs the records of two runs whose module names changed (a renamed module, a refactored
block), by module class, shape and execution order. Pairs are decided once per phase and name, on one
reference step (the first step both runs finished, on their lowest common rank), and then hold for every
step and rank. In each run the records of the
phase are taken in execution order; names both runs have are anchors, and each other record belongs
to the segment after the anchor that precedes it. Within a segment, the records of BASE found only in
BASE and those of OTHER found only in OTHER are grouped by signature, and the i-th of a group in BASE is
paired with the i-th of the same group in OTHER:

1. signature (module class, input/output, tensor index, shape, dtype): confidence = min(nb, no) / max(nb, no),
   nb and no being the group's sizes in the two runs (1.0 when the segment was a pure rename);
2. what is left, by signature without the module class (a refactor that renamed the class too):
   confidence = 0.75 * min(nb, no) / max(nb, no).

Pairs below ``min_confidence`` (0.5 by default) are not made: those records stay "only in one run".
Each pair says why it was made (``Rename.reason``).

**Op alignment** pairs the operations of two runs whose decompositions differ: an ``einsum`` in one run where
the other calls ``matmul``, an extra cast (``to``) in one of them. An op record's name counts the calls of its
op in its module call (``attn/einsum:1``), so one operation more or less in one run shifts the names of the
later calls of that op: the second einsum of one run is the first of the other. Matching by name alone would
then compare different operations. So, in each module call (rank, step, module, call) where some op record is in
one run only, the two runs' op records are aligned as sequences, in execution order:

1. the longest common runs of (op, output, shape, dtype) are paired in order (difflib's matching blocks): the
   same operation at the same place of the sequence, whatever its call index; confidence 1;
2. between them, where both runs have records the other lacks, a record is compared as it is if the other run
   has its name there (a shape that changed is a divergence, not another operation), and the rest are paired
   by (output, shape, dtype) in order, whatever the op: a decomposition (``einsum`` as ``matmul``), confidence
   ``0.75 * min(nb, no) / max(nb, no)`` (nb, no: how many such records each run has there), made at 0.5 or
   more (``DEFAULT_MIN_CONFIDENCE``; the factor is fuzzy alignment's for a changed class).

Pairs are decided on the forward records of the module call and hold for its backward records too (they carry
the same names); a module call with op records in one phase only is aligned on that phase. Records left unpaired
stay in one run only; one of OTHER whose name a paired record takes (an extra ``linear`` shifts the later ones'
names) is listed as ``<name> (unpaired)`` (``results.UNPAIRED``). Pairs whose two names are the same are no rename
and not listed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..dump import Record
from ..dump.record import RecordKey, execution_order
from ..utils.phases import phase_rank
from .results import UNPAIRED, OpName, Rename, op_name
from .reading import LoadedDump

__all__ = ["CLASS_CHANGED_FACTOR", "DEFAULT_MIN_CONFIDENCE", "align_operations", "apply_renames", "fuzzy_renames",
           "op_rows"]

DEFAULT_MIN_CONFIDENCE = 0.5
CLASS_CHANGED_FACTOR = 0.75

Signature = tuple[Any, ...]


def _strict(record: Record) -> Signature:
    return (record.get("module_class"), *_loose(record))


def _loose(record: Record) -> Signature:
    shape = record.get("shape")
    return (record.get("kind"), record.get("tensor_index"), tuple(shape) if isinstance(shape, list) else shape,
            record.get("dtype"))


def _reference(base: LoadedDump, other: LoadedDump) -> tuple[int, int] | None:
    """(rank, step): the lowest common rank's first step both runs finished."""
    for rank in sorted(set(base.steps_by_rank) & set(other.steps_by_rank)):
        common = sorted(set(base.steps_by_rank[rank]) & set(other.steps_by_rank[rank]))
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
    groups_base: dict[Signature, list[Record]] = {}
    groups_other: dict[Signature, list[Record]] = {}
    for records, groups in ((base, groups_base), (other, groups_other)):
        for record in records:
            groups.setdefault(signature(record), []).append(record)
    paired: set[int] = set()
    for key, in_base in groups_base.items():
        in_other = groups_other.get(key, [])
        if not in_other:
            continue
        confidence = factor * min(len(in_base), len(in_other)) / max(len(in_base), len(in_other))
        for ordinal, (b, o) in enumerate(zip(in_base, in_other), 1):
            found.append(Rename(phase, o["name"], b["name"], "fuzzy", round(confidence, 3),
                                _reason(b, o, ordinal, len(in_base), len(in_other), anchor)))
            paired.update((id(b), id(o)))
    return [r for r in base if id(r) not in paired], [r for r in other if id(r) not in paired]


def _reason(base: Record, other: Record, ordinal: int, count_base: int, count_other: int, anchor: str | None) -> str:
    classes = (f"class {base.get('module_class')}" if base.get("module_class") == other.get("module_class")
               else f"class {other.get('module_class')} as {base.get('module_class')}")
    counts = f"{count_base}" if count_base == count_other else f"{count_base} in base, {count_other} in other"
    return (f"{classes}, {base.get('kind')} {base.get('tensor_index')}, shape {base.get('shape')} {base.get('dtype')}; "
            f"#{ordinal} of {counts} such after {anchor if anchor else 'the start'}")


def fuzzy_renames(base: LoadedDump, other: LoadedDump, *,
                  min_confidence: float = DEFAULT_MIN_CONFIDENCE) -> list[Rename]:
    """The pairs of names found in one run only that stand for the same tensor (see the module docstring)."""
    reference = _reference(base, other)
    if reference is None:
        return []
    at_base, at_other = base.step_records(*reference), other.step_records(*reference)
    phases = sorted({key[2] for key in at_base})
    found: list[Rename] = []
    for phase in phases:
        base_sequence, other_sequence = _sequence(at_base, phase), _sequence(at_other, phase)
        anchors = {r["name"] for r in base_sequence} & {r["name"] for r in other_sequence}
        segments_base, segments_other = _segments(base_sequence, anchors), _segments(other_sequence, anchors)
        for anchor, in_base in segments_base.items():
            in_other = segments_other.get(anchor, [])
            in_base, in_other = _pair(in_base, in_other, _strict, 1.0, anchor, phase, found)
            _pair(in_base, in_other, _loose, CLASS_CHANGED_FACTOR, anchor, phase, found)
    order = {(r["phase"], r["name"]): r.get("seq", 0) for r in at_base.values()}
    kept = [rename for rename in found if rename.confidence >= min_confidence]
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


_FORWARD = "forward"


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
    def strict(self) -> tuple[Any, ...]:
        return (self.parsed.op, *self.loose)

    @property
    def loose(self) -> tuple[Any, ...]:
        return self.parsed.output, self.shape, self.dtype


def op_rows(loaded: LoadedDump) -> np.ndarray:
    """The rows of ``loaded`` that are op records (kind "op"), in row order."""
    kind = loaded.table.column("kind")
    return np.flatnonzero(pc.fill_null(pc.equal(kind, "op"), False).to_numpy(zero_copy_only=False))


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


def _calls(ops: Iterable[_Op]) -> dict[tuple[int, int, str, int], list[_Op]]:
    calls: dict[tuple[int, int, str, int], list[_Op]] = {}
    for op in ops:
        calls.setdefault((op.rank, op.step, *op.parsed.site), []).append(op)
    return calls


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
    groups_base: dict[tuple[Any, ...], list[_Op]] = {}
    groups_other: dict[tuple[Any, ...], list[_Op]] = {}
    for ops, groups in ((base, groups_base), (other, groups_other)):
        for op in ops:
            if op.name not in kept:
                groups.setdefault(op.loose, []).append(op)
    found: list[tuple[_Op, _Op, float, str]] = []
    for key, in_base in groups_base.items():
        in_other = groups_other.get(key, [])
        if not in_other:
            continue
        confidence = round(CLASS_CHANGED_FACTOR * min(len(in_base), len(in_other)) / max(len(in_base), len(in_other)),
                           3)
        if confidence < DEFAULT_MIN_CONFIDENCE:
            continue
        counts = f"{len(in_base)}" if len(in_base) == len(in_other) else f"{len(in_base)} in base, {len(in_other)} in other"
        for ordinal, (b, o) in enumerate(zip(in_base, in_other), 1):
            how = b.parsed.op if b.parsed.op == o.parsed.op else f"{o.parsed.op} as {b.parsed.op}"
            found.append((b, o, confidence, f"{how}, {_describe(b)}; #{ordinal} of {counts} such between the "
                                            "same operations of both runs"))
    return found


def _unpaired(mapping: dict[str, tuple[str, float, str]], names: set[str]) -> set[str]:
    """OTHER's names (of ``names``, those of the module call in one phase) left unpaired whose name a paired
    record takes: they are kept under ``results.UNPAIRED`` names (a key holds one record)."""
    targets = {target for target, _, _ in mapping.values()}
    return {name for name in names if name not in mapping and name in targets}


def align_operations(base: LoadedDump, other: LoadedDump) -> list[Rename]:
    """Pairs the op records of module calls where the two runs' op records differ (module docstring), renames
    ``other``'s paired records to their BASE names, and returns the pairs whose names differ, in BASE's execution
    order (each pair once, whatever the steps and ranks it holds in)."""
    rows_base, rows_other = op_rows(base), op_rows(other)
    if not len(rows_base) or not len(rows_other) or _same_keys(base, rows_base, other, rows_other):
        return []
    ops_base, ops_other = _ops(base, rows_base), _ops(other, rows_other)
    keys_base = {(op.rank, op.step, op.phase, op.name) for op in ops_base}
    keys_other = {(op.rank, op.step, op.phase, op.name) for op in ops_other}
    if keys_base == keys_other:
        return []
    touched = {(op.rank, op.step, *op.parsed.site) for op in ops_base if (op.rank, op.step, op.phase, op.name)
               not in keys_other}
    touched |= {(op.rank, op.step, *op.parsed.site) for op in ops_other if (op.rank, op.step, op.phase, op.name)
                not in keys_base}
    calls_base, calls_other = _calls(ops_base), _calls(ops_other)
    renames: dict[tuple[str | None, str, str], tuple[tuple[int, int, int, int], Rename]] = {}
    new_names: dict[int, str] = {}  # other row -> its BASE name
    for call in sorted(touched):
        in_base, in_other = calls_base.get(call, []), calls_other.get(call, [])
        both = {op.phase for op in in_base} & {op.phase for op in in_other}
        decided = [_FORWARD] if _FORWARD in both else sorted(both)
        for phase in decided:
            mapping = {o.name: (b.name, confidence, reason) for b, o, confidence, reason
                       in _aligned(_ordered(in_base, phase), _ordered(in_other, phase)) if b.name != o.name}
            scope = [op for op in in_other if op.phase == phase or phase == _FORWARD]
            moved = {listed: _unpaired(mapping, {op.name for op in scope if op.phase == listed})
                     for listed in {op.phase for op in scope}}
            seq_of = {op.name: op for op in _ordered(in_base, phase)}
            for op in scope:
                if op.name in mapping:
                    new_names[op.row] = mapping[op.name][0]
                elif op.name in moved[op.phase]:
                    new_names[op.row] = op.name + UNPAIRED
            for name, (target, confidence, reason) in mapping.items():
                at = seq_of[target]
                key = (None if phase == _FORWARD else phase, name, target)
                order = execution_order(at.step, at.phase, at.seq, at.rank)
                if key not in renames or order < renames[key][0]:
                    renames[key] = (order, Rename(key[0], name, target, "op", confidence, reason))
    if new_names:
        other.rename(new_names)
    return [rename for _, rename in sorted(renames.values(), key=lambda item: item[0])]
