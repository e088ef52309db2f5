"""The matched records of a comparison as arrays (RecordDiffs): verdicts for all, RecordDiff objects on demand.

    records.diverged.sum(); records.ratio.max()          # numpy arrays, one entry per matched record
    records[0]; records.take([3, 7]); records.worst(10)   # RecordDiff objects, built when read
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from .results import CellView, RecordDiff

__all__ = ["RecordDiffs"]


def _concatenated(pieces: list[np.ndarray]) -> np.ndarray:
    """The pieces one after the other, integers as int32 where they fit (keys and codes), each piece let go
    once copied: joining ten million records never holds them twice."""
    narrow = all(piece.dtype.kind == "i" and (not piece.size or (piece.min() >= -(1 << 31) and piece.max() < 1 << 31))
                 for piece in pieces)
    dtype = np.int32 if narrow else np.result_type(*pieces) if pieces else np.float64
    out = np.empty((sum(len(piece) for piece in pieces), *(pieces[0].shape[1:] if pieces else ())), dtype)
    start = 0
    while pieces:
        piece = pieces.pop(0)
        out[start:start + len(piece)] = piece
        start += len(piece)
    return out


def _handed_over(part: "RecordDiffs", name: str) -> np.ndarray:
    """A part's array, which the part gives up (``joined`` consumes its parts)."""
    values = getattr(part, name)
    setattr(part, name, None)
    return values


def _cleared(items: list[Any], index: int) -> Any:
    value, items[index] = items[index], None
    return value


def _unbuildable(rows: np.ndarray) -> list[RecordDiff]:
    raise LookupError("a detached window's records are built in the window (RecordDiffs.detached)")


class RecordDiffs(Sequence[RecordDiff]):
    """The matched records of a comparison, in execution order: the verdict of each as arrays, each
    RecordDiff built only when asked for (a comparison of a million records builds the few a report shows).

        records.diverged.sum(); records.ratio.max()          # numpy arrays, one entry per matched record
        records[0]; records.take([3, 7]); list(records)       # RecordDiff objects
    """

    def __init__(self, *, rank: np.ndarray, step: np.ndarray, seq: np.ndarray, phase: np.ndarray, name: np.ndarray,
                 labels: tuple[Sequence[str], Sequence[str]], ratio: np.ndarray, diverged: np.ndarray,
                 rel_error: np.ndarray, build: Callable[[np.ndarray], list[RecordDiff]],
                 worst: tuple[Sequence[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
                 moments: Mapping[tuple[str, str], np.ndarray] | None = None) -> None:
        self.rank, self.step, self.seq = rank, step, seq
        # (metric names, per record the code of its worst metric, its base and other values, and whether each
        # is None); code 1 means a structure field or count, 0 nothing compared. None: only RecordDiffs know.
        self._worst = worst
        self.moments = moments  # ("base" | "other", moment) -> per record the value, nan where absent
        self.phase, self.name = phase, name  # codes into labels[0] (phases) and labels[1] (names)
        self.labels = labels
        self.ratio, self.diverged, self.rel_error = ratio, diverged, rel_error
        self._build = build
        self._built: dict[int, RecordDiff] = {}

    @classmethod
    def of(cls, records: Sequence[RecordDiff]) -> "RecordDiffs":
        """Arrays for RecordDiff objects already built (a report made by hand)."""
        phases = sorted({r.phase for r in records})
        names = sorted({r.name for r in records})
        phase_code, name_code = {p: i for i, p in enumerate(phases)}, {n: i for i, n in enumerate(names)}
        kept = list(records)
        return cls(rank=np.array([r.rank for r in kept], np.int64), step=np.array([r.step for r in kept], np.int64),
                   seq=np.array([r.seq for r in kept], np.int64),
                   phase=np.array([phase_code[r.phase] for r in kept], np.int64),
                   name=np.array([name_code[r.name] for r in kept], np.int64), labels=(phases, names),
                   ratio=np.array([r.ratio for r in kept], np.float64),
                   diverged=np.array([r.diverged for r in kept], bool),
                   rel_error=np.array([r.rel_error for r in kept], np.float64),
                   build=lambda rows: [kept[row] for row in rows.tolist()])

    _ARRAYS = ("rank", "step", "seq", "ratio", "diverged", "rel_error")

    def detached(self, rows: np.ndarray) -> "RecordDiffs":
        """The same arrays, with the RecordDiffs of ``rows`` built and no link to the dumps (it pickles):
        what one window of a comparison hands on. ``moments`` are left out (``joined`` takes them apart)."""
        self.take(rows)
        part = RecordDiffs(**{name: getattr(self, name) for name in self._ARRAYS}, phase=self.phase, name=self.name,
                           labels=(list(self.labels[0]), list(self.labels[1])), build=_unbuildable,
                           worst=None if self._worst is None else (list(self._worst[0]), *self._worst[1:]))
        part._built = {row: self._built[row] for row in np.unique(rows).tolist()}
        return part

    @classmethod
    def joined(cls, parts: Sequence["RecordDiffs"], build: Callable[[np.ndarray], list[RecordDiff]],
               moments: Mapping[tuple[str, str], Any] | None,
               worst_values: tuple[Any, Any] | None = None) -> "RecordDiffs":
        """The records of ``parts`` one after the other (``detached`` windows, in execution order); records not
        built in a part are built by ``build`` (rows of the whole); the parts are consumed. ``worst_values``: the worst metric's base and
        other values of every record, read by rows (``views``), where the parts no longer hold them. Keys and
        codes are int32 where they fit: a comparison of ten million records keeps these arrays."""
        labels: tuple[dict[str, int], dict[str, int]] = ({}, {})
        codes: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        for part in parts:
            for which, (found, part_codes) in enumerate(zip(part.labels, (part.phase, part.name))):
                lookup = np.array([labels[which].setdefault(label, len(labels[which])) for label in found], np.int64)
                codes[which].append(lookup[part_codes] if len(part_codes) else np.zeros(0, np.int64))
        sizes = [len(part) for part in parts]
        arrays = {name: _concatenated([_handed_over(part, name) for part in parts]) for name in cls._ARRAYS}
        worst = None
        if all(part._worst is not None for part in parts):
            metrics = parts[0]._worst[0]  # type: ignore[index]
            worsts = [list(part._worst) for part in parts]  # type: ignore[arg-type]
            for part in parts:
                part._worst = None
            worst = (metrics, *(worst_values[i - 2] if worst_values is not None and i in (2, 3) else
                                _concatenated([_cleared(item, i) for item in worsts])
                                for i in range(1, 5)))
        joined = cls(**arrays, phase=_concatenated(codes[0]), name=_concatenated(codes[1]),
                     labels=(list(labels[0]), list(labels[1])), build=build, worst=worst,  # type: ignore[arg-type]
                     moments=moments)
        offset = 0
        for part, size in zip(parts, sizes):
            joined._built.update((row + offset, record) for row, record in part._built.items())
            offset += size
        return joined

    def __len__(self) -> int:
        return len(self.ratio)

    @overload
    def __getitem__(self, index: int) -> RecordDiff: ...

    @overload
    def __getitem__(self, index: slice) -> list[RecordDiff]: ...

    def __getitem__(self, index: int | slice) -> RecordDiff | list[RecordDiff]:
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("record index out of range")
        return self.take([index])[0]

    def __iter__(self) -> Iterator[RecordDiff]:
        for start in range(0, len(self), 4096):
            yield from self.take(np.arange(start, min(start + 4096, len(self))))

    def take(self, rows: Sequence[int] | np.ndarray) -> list[RecordDiff]:
        """The RecordDiff objects of ``rows`` (built once, then kept)."""
        rows = [int(row) for row in rows]
        missing = np.array(sorted({row for row in rows if row not in self._built}), np.int64)
        if len(missing):
            self._built.update(zip(missing.tolist(), self._build(missing)))
        return [self._built[row] for row in rows]

    def select(self, mask: np.ndarray) -> list[RecordDiff]:
        return self.take(np.flatnonzero(mask))

    def views(self, rows: Sequence[int] | np.ndarray) -> list[CellView]:
        """What plots show of ``rows``, from the arrays where they say it (records are built for the rest)."""
        rows = np.asarray(rows, np.int64)
        if self._worst is None:
            return [CellView.of(record) for record in self.take(rows)]
        names, codes, base, other, nulls = self._worst
        built = dict(zip(rows[codes[rows] == 1].tolist(), map(CellView.of, self.take(rows[codes[rows] == 1]))))
        values = zip(base[rows].tolist(), other[rows].tolist())  # arrays, or a window's spilled columns
        return [built[row] if row in built else
                CellView(float(self.rel_error[row]), bool(self.diverged[row]), float(self.ratio[row]),
                         names[codes[row]] or None, None if nulls[row, 0] else value_b,
                         None if nulls[row, 1] else value_o)
                for row, (value_b, value_o) in zip(rows.tolist(), values)]

    def value(self, rows: np.ndarray, run: str, metric: str) -> list[Any]:
        """A moment's base ("base") or other ("other") value of ``rows`` (None where it was not compared)."""
        if self.moments is None:
            return [record.value(run, metric) for record in self.take(rows)]
        values = self.moments[(run, metric)][rows]
        return [None if math.isnan(value) else value for value in values.tolist()]

    def phase_name(self, row: int) -> tuple[str, str]:
        return self.labels[0][int(self.phase[row])], self.labels[1][int(self.name[row])]

    def where(self, *, rank: int, step: int, phase: str) -> np.ndarray:
        """The mask of the records of one rank, step and phase."""
        phases = list(self.labels[0])
        code = phases.index(phase) if phase in phases else -1
        return (self.rank == rank) & (self.step == step) & (self.phase == code)

    def worst(self, count: int) -> list[RecordDiff]:
        """The ``count`` records with the largest ratio above 0, largest first (ties: execution order)."""
        rows = np.flatnonzero(self.ratio > 0)
        return self.take(rows[np.argsort(-self.ratio[rows], kind="stable")][:count])

