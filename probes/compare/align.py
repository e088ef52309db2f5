"""Fuzzy alignment: pairing the records of two runs whose module names changed (a renamed module, a
refactored block), by module class, shape and execution order.

    renames = fuzzy_renames(loaded_base, loaded_other)     # [Rename(phase, other, base, "fuzzy", confidence, why)]
    apply_renames(loaded_other, renames)                    # OTHER's records now carry BASE's names
    probes compare eager_out refactored_out --fuzzy

Pairs are decided once per phase and name, on one reference step (the first step both runs finished,
on their lowest common rank), and then hold for every step and rank. In each run the records of the
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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..dump import Record
from ..dump.record import RecordKey
from ..utils.phases import phase_rank
from .results import Rename
from .reading import LoadedDump

__all__ = ["CLASS_CHANGED_FACTOR", "DEFAULT_MIN_CONFIDENCE", "apply_renames", "fuzzy_renames"]

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
