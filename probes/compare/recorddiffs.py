"""The matched records of a comparison as arrays (RecordDiffs): verdicts for all, RecordDiff objects on demand.

    records.diverged.sum(); records.ratio.max()          # numpy arrays, one entry per matched record
    records[0]; records.at([3, 7]); records.worst(10)     # RecordDiff objects, built when read
    for offset, chunk in records.chunks(): ...           # the arrays a part at a time (what reports read)
    spill(records, "3.arrow")                            # a window's arrays as one Arrow IPC file

A comparison read in windows keeps its arrays on disk (SpilledRecordDiffs, memory-mapped): the report reads
them a window at a time (``chunks``), so memory does not grow with the dumps.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, overload

import numpy as np
import pyarrow as pa

from .results import CellView, RecordDiff

__all__ = ["RecordDiffs", "SpilledRecordDiffs", "Summary", "WorstMetric", "spill"]

TOP = 32  # per part, the records of the largest ratio a Summary keeps (``worst`` of up to as many reads them)
Row = tuple[int, str, str]  # rank, phase, name: a row of the heatmap, a line of the trajectories


@dataclass
class Summary:
    """What the report's tables and plots read of every record of a part of them (a window), computed once where
    the part's arrays are in memory (``RecordDiffs.summary``) and merged part by part, in execution order. Rows
    (rank, phase, name) of the part are numbered in the order of ``rows``; ``RecordDiffs.row_of`` gives each
    record's."""

    steps: np.ndarray  # distinct steps, sorted
    matched: np.ndarray  # per step: records
    diverged: np.ndarray  # per step: diverged records
    drifted: np.ndarray  # per step: drift records (beyond their tolerance, not diverged: docs/compare.md, Drift)
    worst_rows: np.ndarray  # per step: the first record (execution order) of the largest ratio
    worst_ratios: np.ndarray
    top_rows: np.ndarray  # the TOP records of the largest ratio above 0, largest first (ties: execution order)
    top_ratios: np.ndarray
    diverged_rows: np.ndarray
    rows: list[Row]
    row_first: np.ndarray  # per row: (step, seq) of its first record
    row_max: np.ndarray  # per row: its largest ratio (nan when one is nan, as np.maximum keeps it)
    drift_rows: np.ndarray  # the drift records


def _summarised(records: "RecordDiffs") -> tuple[Summary, np.ndarray]:
    """(the Summary of ``records``, per record its row)."""
    step, ratio, diverged = np.asarray(records.step), np.asarray(records.ratio), np.asarray(records.diverged, bool)
    steps, counts = np.unique(step, return_counts=True)
    # Per step the first record (execution order) of the largest ratio, as max() over the records would pick.
    by_step = np.lexsort((np.arange(len(step)), -ratio, step))
    worst = by_step[np.unique(step[by_step], return_index=True)[1]]
    bad = np.bincount(np.searchsorted(steps, step), weights=diverged, minlength=len(steps)).astype(np.int64)
    grown = ~np.isnan(np.asarray(records.drift, np.float64))
    drifted = np.bincount(np.searchsorted(steps, step), weights=grown, minlength=len(steps)).astype(np.int64)
    positive = np.flatnonzero(ratio > 0)
    top = positive[np.argsort(-ratio[positive], kind="stable")][:TOP]
    first, row_of = _rows_of(records)
    row_max = np.zeros(len(first))
    np.maximum.at(row_max, row_of, ratio)
    phases, names = records.labels
    rows = [(int(records.rank[index]), phases[records.phase[index]], names[records.name[index]])
            for index in first.tolist()]
    row_first = np.stack([step[first], np.asarray(records.seq)[first]], axis=1).astype(np.int64)
    return Summary(steps, counts, bad, drifted, worst, ratio[worst], top, ratio[top], np.flatnonzero(diverged), rows,
                   row_first, row_max, np.flatnonzero(grown)), row_of.astype(np.int32)


def _rows_of(records: RecordDiffs) -> tuple[np.ndarray, np.ndarray]:
    """(the first record of each (rank, phase, name), in that key's order; per record its key's index): what
    ``np.unique(keys, return_index=True, return_inverse=True)`` gives, with a table of every possible key where
    there are few (ranks x phases x names), so ten million records take no sort and no copies of the keys."""
    count = len(records.rank)
    ranks = records.rank.astype(np.int64)
    low = int(ranks.min()) if count else 0
    phases, names = max(1, len(records.labels[0])), max(1, len(records.labels[1]))
    size = (int(ranks.max()) - low + 1) * phases * names if count else 0
    key = ((ranks - low) * phases + records.phase) * names + records.name
    if size > 4 * count + (1 << 16):  # sparse keys: sort them
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    first_at = np.full(size, count, np.int64)
    first_at[key[::-1]] = np.arange(count - 1, -1, -1)  # repeated keys: the last assignment, the earliest record
    present = np.flatnonzero(first_at < count)
    index_of = np.zeros(size, np.int32)
    index_of[present] = np.arange(len(present))
    return first_at[present], index_of[key]


_ARRAYS = ("rank", "step", "seq", "ratio", "diverged", "rel_error", "drift")  # what every RecordDiffs holds per record


class WorstMetric(NamedTuple):
    """Per record the metric of its largest ratio, ``names[code]`` (0: nothing compared; 1: a structure field,
    a count or the hash, which only its RecordDiff shows), with its base and other values and whether each is None."""

    names: Sequence[str]
    code: np.ndarray
    base: np.ndarray  # nan where the value is None
    other: np.ndarray
    null: np.ndarray  # (records, 2) bool: the base / the other value is None


class RecordDiffs(Sequence[RecordDiff]):
    """The matched records of a comparison, in execution order: the verdict of each as arrays, each
    RecordDiff built only when asked for (a comparison of a million records builds the few a report shows)."""

    def __init__(self, *, rank: np.ndarray, step: np.ndarray, seq: np.ndarray, phase: np.ndarray, name: np.ndarray,
                 labels: tuple[Sequence[str], Sequence[str]], ratio: np.ndarray, diverged: np.ndarray,
                 rel_error: np.ndarray, build: Callable[[np.ndarray], list[RecordDiff]],
                 worst_metric: WorstMetric | None = None,
                 moments: Mapping[tuple[str, str], np.ndarray] | None = None,
                 summary: tuple[Summary, np.ndarray] | None = None, drift: np.ndarray | None = None) -> None:
        self.rank, self.step, self.seq = rank, step, seq
        self.worst_metric = worst_metric  # None: only the RecordDiffs know
        self.moments = moments  # ("base" | "other", moment) -> per record the value, nan where absent
        self.phase, self.name = phase, name  # codes into labels[0] (phases) and labels[1] (names)
        self.labels = labels
        self.ratio, self.diverged, self.rel_error = ratio, diverged, rel_error
        # per record the largest ratio of the step before where it is drift, nan where not (RecordDiff.drift)
        self.drift = np.full(len(ratio), np.nan) if drift is None else drift
        self._build = build
        self._built: dict[int, RecordDiff] = {}
        self._summary = summary  # (the Summary, per record its row), computed when first asked for

    def built(self, rows: np.ndarray) -> dict[int, RecordDiff]:
        """The RecordDiff objects of ``rows`` by row (built now where they were not): what a window hands on."""
        rows = np.unique(np.asarray(rows, np.int64))
        return dict(zip(rows.tolist(), self.at(rows)))

    def __len__(self) -> int:
        return len(self.ratio)

    @overload
    def __getitem__(self, index: int) -> RecordDiff: ...

    @overload
    def __getitem__(self, index: slice) -> list[RecordDiff]: ...

    def __getitem__(self, index: int | slice) -> RecordDiff | list[RecordDiff]:
        if isinstance(index, slice):
            return self.at(np.arange(len(self))[index])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("record index out of range")
        return self.at([index])[0]

    def __iter__(self) -> Iterator[RecordDiff]:
        for start in range(0, len(self), 4096):
            yield from self.at(np.arange(start, min(start + 4096, len(self))))

    def at(self, rows: Sequence[int] | np.ndarray) -> list[RecordDiff]:
        """The RecordDiff objects of ``rows`` (built once, then kept)."""
        rows = [int(row) for row in rows]
        missing = np.array(sorted({row for row in rows if row not in self._built}), np.int64)
        if len(missing):
            self._built.update(zip(missing.tolist(), self._build(missing)))
        return [self._built[row] for row in rows]

    def views(self, rows: Sequence[int] | np.ndarray) -> list[CellView]:
        """What plots show of ``rows``, from the arrays where they say it (records are built for the rest)."""
        rows = np.asarray(rows, np.int64)
        if self.worst_metric is None:
            return [CellView.of(record) for record in self.at(rows)]
        names, codes, base, other, nulls = self.worst_metric
        built = dict(zip(rows[codes[rows] == 1].tolist(), map(CellView.of, self.at(rows[codes[rows] == 1]))))
        values = zip(base[rows].tolist(), other[rows].tolist())  # arrays, or a window's spilled columns
        return [built[row] if row in built else
                CellView(float(self.rel_error[row]), bool(self.diverged[row]), float(self.ratio[row]),
                         names[codes[row]] or None, None if nulls[row, 0] else value_b,
                         None if nulls[row, 1] else value_o)
                for row, (value_b, value_o) in zip(rows.tolist(), values)]

    def worst_metric_names(self, rows: Sequence[int]) -> list[str | None]:
        """The metric of the largest ratio of ``rows`` where the arrays say it (a moment, the samples); None where
        only the RecordDiff does (a structure field, a count, the hash; or no arrays)."""
        if self.worst_metric is None:
            return [None] * len(rows)
        names, codes = self.worst_metric.names, self.worst_metric.code
        return [names[code] if code > 1 else None for code in codes[np.asarray(rows, np.int64)].tolist()]

    def value(self, rows: np.ndarray, run: str, metric: str) -> list[Any]:
        """A moment's base ("base") or other ("other") value of ``rows`` (None where it was not compared)."""
        if self.moments is None:
            return [record.value(run, metric) for record in self.at(rows)]
        values = self.moments[(run, metric)][rows]
        return [None if math.isnan(value) else value for value in values.tolist()]

    def phase_name(self, row: int) -> tuple[str, str]:
        return self.labels[0][int(self.phase[row])], self.labels[1][int(self.name[row])]

    def where(self, *, rank: int, step: int, phase: str) -> np.ndarray:
        """The mask of the records of one rank, step and phase."""
        phases = list(self.labels[0])
        code = phases.index(phase) if phase in phases else -1
        return (self.rank == rank) & (self.step == step) & (self.phase == code)

    def summary(self) -> Summary:
        """What the report reads of every record (``Summary``), computed once."""
        if self._summary is None:
            self._summary = _summarised(self)
        return self._summary[0]

    @property
    def row_of(self) -> np.ndarray:
        """Per record the index of its row in ``summary().rows``."""
        self.summary()
        return self._summary[1]  # type: ignore[index]

    def chunks(self) -> Iterator[tuple[int, "RecordDiffs"]]:
        """(row of its first record, the records) of each part the arrays are read in, in order: here the whole."""
        yield 0, self

    def diverged_rows(self) -> np.ndarray:
        """The rows of the diverged records, in execution order."""
        return np.concatenate([offset + chunk.summary().diverged_rows for offset, chunk in self.chunks()] or
                              [np.zeros(0, np.int64)]).astype(np.int64)

    def drift_rows(self) -> np.ndarray:
        """The rows of the drift records, in execution order."""
        return np.concatenate([offset + chunk.summary().drift_rows for offset, chunk in self.chunks()] or
                              [np.zeros(0, np.int64)]).astype(np.int64)

    def rows_where(self, *, rank: int, step: int, phase: str) -> np.ndarray:
        """The rows of the records of one rank, step and phase."""
        return np.concatenate([offset + np.flatnonzero(chunk.where(rank=rank, step=step, phase=phase))
                               for offset, chunk in self.chunks() if step in chunk.summary().steps]
                              or [np.zeros(0, np.int64)]).astype(np.int64)

    def worst(self, count: int) -> list[RecordDiff]:
        """The ``count`` records with the largest ratio above 0, largest first (ties: execution order)."""
        rows, ratios = [], []
        for offset, chunk in self.chunks():  # each part's best, then the best of those: the same records
            if count <= TOP:
                summary = chunk.summary()
                best, ratio = summary.top_rows[:count], summary.top_ratios[:count]
            else:
                positive = np.flatnonzero(chunk.ratio > 0)
                best = positive[np.argsort(-chunk.ratio[positive], kind="stable")][:count]
                ratio = chunk.ratio[best]
            rows.append(offset + best)
            ratios.append(np.asarray(ratio, np.float64))
        if not rows:
            return []
        found, ratio = np.concatenate(rows).astype(np.int64), np.concatenate(ratios)
        return self.at(found[np.argsort(-ratio, kind="stable")][:count])


def spill(records: RecordDiffs, path: str | Path) -> None:
    """Writes the arrays of ``records`` (verdicts, keys, each record's summary row, the worst metrics, the
    moments) to ``path``, one Arrow IPC file: what ``SpilledRecordDiffs`` reads back."""
    columns: dict[str, Any] = {name: _narrowed(getattr(records, name)) for name in _ARRAYS}
    for which, name in enumerate(("phase", "name")):
        columns[name] = pa.DictionaryArray.from_arrays(pa.array(getattr(records, name), pa.int32()),
                                                       pa.array(list(records.labels[which]), pa.string()))
    columns["row"] = records.row_of
    metadata = {}
    worst = records.worst_metric
    if worst is not None:
        columns.update(worst_code=worst.code, worst_base=worst.base, worst_other=worst.other,
                       worst_null_base=worst.null[:, 0], worst_null_other=worst.null[:, 1])
        metadata["worst_names"] = json.dumps(list(worst.names))
    for (run, moment), values in (records.moments or {}).items():
        columns[f"moment.{run}.{moment}"] = values
    table = pa.table(columns, metadata=metadata)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


def _narrowed(values: np.ndarray) -> np.ndarray:
    """Keys as int32 where they fit: half the bytes to write and read back."""
    if values.dtype.kind == "i" and values.dtype.itemsize > 4 and (not values.size or (
            values.min() >= -(1 << 31) and values.max() < 1 << 31)):
        return values.astype(np.int32)
    return values


def _read_spilled(path: str | Path) -> pa.Table:
    """A window's spill file, memory-mapped: its number columns are read without a copy."""
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def _labels(table: pa.Table, name: str) -> list[str]:
    chunks = table.column(name).chunks
    return chunks[0].dictionary.to_pylist() if chunks else []


def _codes(table: pa.Table, name: str) -> np.ndarray:
    """A dictionary column's indices (empty: none)."""
    chunks = table.column(name).chunks
    return chunks[0].indices.to_numpy(zero_copy_only=False) if chunks else np.zeros(0, np.int32)


def _array(table: pa.Table, name: str) -> np.ndarray:
    column = table.column(name)
    if not column.num_chunks:
        return np.zeros(0, column.type.to_pandas_dtype())
    return column.chunk(0).to_numpy(zero_copy_only=False)


class SpilledRecordDiffs(RecordDiffs):
    """The RecordDiffs of several windows, each window's arrays in an Arrow IPC file (``spill``), read a window
    at a time.

        records = SpilledRecordDiffs(directory, [(path, built RecordDiffs by row, summary), ...], build)
        for offset, window in records.chunks(): window.ratio.max()

    The array attributes (``ratio``, ``step``, ...) read every window into one array: for small comparisons;
    reports read ``chunks``. ``directory`` (a TemporaryDirectory) is removed with this object.
    """

    def __init__(self, directory: tempfile.TemporaryDirectory,
                 parts: Sequence[tuple[Path, Mapping[int, RecordDiff], Summary]],
                 build: Callable[[np.ndarray], list[RecordDiff]]) -> None:
        self._directory = directory
        labels: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._parts: list[tuple[Path, np.ndarray, np.ndarray, Summary]] = []
        self.counts: list[int] = []  # per window its records
        self._built: dict[int, RecordDiff] = {}
        offset = 0
        for path, built, summary in parts:
            table = _read_spilled(path)
            lookups = [np.array([labels[which].setdefault(label, len(labels[which]))
                                 for label in _labels(table, name)], np.int32)
                       for which, name in enumerate(("phase", "name"))]
            self._parts.append((path, lookups[0], lookups[1], summary))
            self._built.update((row + offset, record) for row, record in built.items())
            self.counts.append(table.num_rows)
            offset += table.num_rows
        self._count = offset
        self.labels = (list(labels[0]), list(labels[1]))
        self._build = build
        self.worst_metric = None  # read per window
        self.moments = None
        self._diverged: np.ndarray | None = None

    def __len__(self) -> int:
        return self._count

    def chunks(self) -> Iterator[tuple[int, RecordDiffs]]:
        offset = 0
        for part, count in zip(self._parts, self.counts):
            yield offset, self._window(*part, offset)
            offset += count

    def _window(self, path: Path, phases: np.ndarray, names: np.ndarray, summary: Summary, offset: int
                ) -> RecordDiffs:
        return _SpilledWindow(_read_spilled(path), (phases, names), self.labels, summary,
                              lambda rows: self.at(np.asarray(rows, np.int64) + offset))

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
    drift = property(lambda self: self._joined("drift"))


class _SpilledWindow(RecordDiffs):
    """One window's RecordDiffs on its memory-mapped spill file: each array read when first used (a pass over
    the windows touches only the pages of its arrays), phase and name codes turned into the joined ones."""

    def __init__(self, table: pa.Table, lookups: tuple[np.ndarray, np.ndarray],
                 labels: tuple[Sequence[str], Sequence[str]], summary: Summary,
                 build: Callable[[np.ndarray], list[RecordDiff]]) -> None:
        self._table, self._lookups, self.labels, self._build = table, lookups, labels, build
        self._built = {}
        self._summary = (summary, _array(table, "row"))

    def _column(self, name: str) -> np.ndarray:
        return _array(self._table, name)

    rank = functools.cached_property(lambda self: self._column("rank"))  # type: ignore[assignment]
    step = functools.cached_property(lambda self: self._column("step"))
    seq = functools.cached_property(lambda self: self._column("seq"))
    ratio = functools.cached_property(lambda self: self._column("ratio"))
    diverged = functools.cached_property(lambda self: self._column("diverged"))
    rel_error = functools.cached_property(lambda self: self._column("rel_error"))
    drift = functools.cached_property(lambda self: self._column("drift"))
    phase = functools.cached_property(lambda self: self._lookups[0][_codes(self._table, "phase")])
    name = functools.cached_property(lambda self: self._lookups[1][_codes(self._table, "name")])

    @functools.cached_property
    def worst_metric(self) -> WorstMetric | None:  # type: ignore[override]
        table = self._table
        if "worst_code" not in table.column_names:
            return None
        return WorstMetric(json.loads(table.schema.metadata[b"worst_names"]), self._column("worst_code"),
                           self._column("worst_base"), self._column("worst_other"),
                           np.stack([self._column("worst_null_base"), self._column("worst_null_other")], axis=1))

    @functools.cached_property
    def moments(self) -> dict[tuple[str, str], np.ndarray] | None:  # type: ignore[override]
        return {tuple(column.split(".")[1:]): self._column(column) for column in self._table.column_names
                if column.startswith("moment.")} or None
