"""The matched records of a comparison as arrays (RecordDiffs): verdicts for all, RecordDiff objects on demand.

    records.diverged.sum(); records.ratio.max()          # numpy arrays, one entry per matched record
    records[0]; records.take([3, 7]); records.worst(10)   # RecordDiff objects, built when read
    for offset, chunk in records.chunks(): ...           # the arrays a part at a time (what reports read)

A comparison read in windows keeps its arrays on disk, a file per window and array (SpilledRecordDiffs): the
report's tables and plots read them a window at a time (``chunks``), so memory does not grow with the dumps.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from .results import CellView, RecordDiff

__all__ = ["RecordDiffs", "SpilledRecordDiffs", "spill"]


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

    def built(self, rows: np.ndarray) -> dict[int, RecordDiff]:
        """The RecordDiff objects of ``rows`` by row (built now where they were not): what a window hands on."""
        rows = np.unique(np.asarray(rows, np.int64))
        return dict(zip(rows.tolist(), self.take(rows)))

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

    def chunks(self) -> Iterator[tuple[int, "RecordDiffs"]]:
        """(row of its first record, the records) of each part the arrays are read in, in order: here the whole."""
        yield 0, self

    def diverged_rows(self) -> np.ndarray:
        """The rows of the diverged records, in execution order."""
        return np.concatenate([offset + np.flatnonzero(chunk.diverged) for offset, chunk in self.chunks()] or
                              [np.zeros(0, np.int64)]).astype(np.int64)

    def rows_where(self, *, rank: int, step: int, phase: str) -> np.ndarray:
        """The rows of the records of one rank, step and phase."""
        return np.concatenate([offset + np.flatnonzero(chunk.where(rank=rank, step=step, phase=phase))
                               for offset, chunk in self.chunks()] or [np.zeros(0, np.int64)]).astype(np.int64)

    def worst(self, count: int) -> list[RecordDiff]:
        """The ``count`` records with the largest ratio above 0, largest first (ties: execution order)."""
        rows, ratios = [], []
        for offset, chunk in self.chunks():  # each part's best, then the best of those: the same records
            positive = np.flatnonzero(chunk.ratio > 0)
            best = positive[np.argsort(-chunk.ratio[positive], kind="stable")][:count]
            rows.append(offset + best)
            ratios.append(np.asarray(chunk.ratio[best], np.float64))
        if not rows:
            return []
        found, ratio = np.concatenate(rows).astype(np.int64), np.concatenate(ratios)
        return self.take(found[np.argsort(-ratio, kind="stable")][:count])


_ARRAY_FILES = RecordDiffs._ARRAYS + ("phase", "name")
_WORST_FILES = ("worst_code", "worst_base", "worst_other", "worst_null")


def spill(records: RecordDiffs, directory: str | Path, prefix: str) -> None:
    """Writes the arrays of ``records`` (verdicts, codes, the worst metrics, the moments) to ``directory``, a
    ``.npy`` file each named ``<prefix>.<array>``: what ``SpilledRecordDiffs`` reads back."""
    directory = Path(directory)
    arrays = {name: getattr(records, name) for name in _ARRAY_FILES}
    if records._worst is not None:
        arrays.update(zip(_WORST_FILES, records._worst[1:]))
    for (run, moment), values in (records.moments or {}).items():
        arrays[f"moment.{run}.{moment}"] = values
    for name, values in arrays.items():
        if values.dtype.kind == "i" and values.dtype.itemsize > 4 and (not values.size or (
                values.min() >= -(1 << 31) and values.max() < 1 << 31)):
            values = values.astype(np.int32)  # keys and codes: half the bytes to write and read back
        np.save(directory / f"{prefix}.{name}.npy", np.ascontiguousarray(values), allow_pickle=False)


class SpilledRecordDiffs(RecordDiffs):
    """The RecordDiffs of several windows, their arrays in ``.npy`` files (``spill``), read a window at a time.

        records = SpilledRecordDiffs(directory, parts, build)  # parts: (prefix, count, labels, worst metric names,
                                                               #         moments, built RecordDiffs by row)
        for offset, chunk in records.chunks(): chunk.ratio.max()

    The array attributes (``ratio``, ``step``, ...) read every window into one array: for small comparisons;
    reports read ``chunks``. ``directory`` (a TemporaryDirectory) is removed with this object.
    """

    def __init__(self, directory: tempfile.TemporaryDirectory, parts: Sequence[tuple[str, int, tuple[Sequence[str],
                 Sequence[str]], Sequence[str] | None, Sequence[tuple[str, str]], Mapping[int, RecordDiff]]],
                 build: Callable[[np.ndarray], list[RecordDiff]]) -> None:
        self._directory = directory
        labels: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._parts: list[tuple[str, int, np.ndarray, np.ndarray, Sequence[str] | None, tuple[tuple[str, str], ...]]] = []
        self._built: dict[int, RecordDiff] = {}
        offset = 0
        for prefix, count, part_labels, worst_names, moments, built in parts:
            lookups = [np.array([labels[which].setdefault(label, len(labels[which])) for label in found], np.int32)
                       for which, found in enumerate(part_labels)]
            self._parts.append((prefix, count, lookups[0], lookups[1], worst_names, tuple(moments)))
            self._built.update((row + offset, record) for row, record in built.items())
            offset += count
        self._count = offset
        self.labels = (list(labels[0]), list(labels[1]))
        self._build = build
        self._worst = None  # read per chunk
        self.moments = None
        self._diverged: np.ndarray | None = None

    def __len__(self) -> int:
        return self._count

    def chunks(self) -> Iterator[tuple[int, RecordDiffs]]:
        offset = 0
        for prefix, count, phases, names, worst_names, moments in self._parts:
            yield offset, self._chunk(prefix, count, phases, names, worst_names, moments, offset)
            offset += count

    def _chunk(self, prefix: str, count: int, phases: np.ndarray, names: np.ndarray, worst_names: Sequence[str] | None,
               moments: Sequence[tuple[str, str]], offset: int) -> RecordDiffs:
        return _Chunk(Path(self._directory.name), prefix, (phases, names), worst_names, moments, self.labels,
                      lambda rows: self.take(np.asarray(rows, np.int64) + offset))

    def diverged_rows(self) -> np.ndarray:
        if self._diverged is None:  # read by the counts, the JSON and the tables: once
            self._diverged = super().diverged_rows()
        return self._diverged

    def _joined(self, name: str) -> np.ndarray:
        parts = [getattr(chunk, name) for _, chunk in self.chunks()]
        return np.concatenate(parts) if parts else np.zeros(0)

    rank = property(lambda self: self._joined("rank"))  # type: ignore[assignment]
    step = property(lambda self: self._joined("step"))
    seq = property(lambda self: self._joined("seq"))
    phase = property(lambda self: self._joined("phase"))
    name = property(lambda self: self._joined("name"))
    ratio = property(lambda self: self._joined("ratio"))
    diverged = property(lambda self: self._joined("diverged"))
    rel_error = property(lambda self: self._joined("rel_error"))



class _Chunk(RecordDiffs):
    """One window's RecordDiffs, each array read from its file when first used (a pass reads only its arrays);
    phase and name codes turned into the joined ones."""

    def __init__(self, directory: Path, prefix: str, lookups: tuple[np.ndarray, np.ndarray],
                 worst_names: Sequence[str] | None, moments: Sequence[tuple[str, str]],
                 labels: tuple[Sequence[str], Sequence[str]], build: Callable[[np.ndarray], list[RecordDiff]]) -> None:
        self._files = (directory, prefix)
        self._lookups, self._worst_names, self._moment_keys = lookups, worst_names, moments
        self.labels = labels
        self._build = build
        self._built = {}

    def _load(self, name: str) -> np.ndarray:
        directory, prefix = self._files
        return np.load(directory / f"{prefix}.{name}.npy", allow_pickle=False)

    def __getattr__(self, name: str) -> Any:
        if name in RecordDiffs._ARRAYS:
            value: Any = self._load(name)
        elif name in ("phase", "name"):
            codes = self._load(name)
            lookup = self._lookups[0 if name == "phase" else 1]
            value = lookup[codes] if len(codes) else np.zeros(0, np.int32)
        elif name == "_worst":
            value = None if self._worst_names is None else (list(self._worst_names),
                                                            *(self._load(item) for item in _WORST_FILES))
        elif name == "moments":
            value = {key: self._load(f"moment.{key[0]}.{key[1]}") for key in self._moment_keys} or None
        else:
            raise AttributeError(name)
        setattr(self, name, value)
        return value
