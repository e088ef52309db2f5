"""The matched record pairs of two dumps, both sides as arrays: what the rules (``rules``) are applied to.

    rows = match(base, other)                        # (base rows, other rows) with the same key
    pairs, odd = from_columns(base, other, rows)     # from the columns; ``odd``: the pairs they cannot hold,
    pairs = from_records(base.records_at(rows[0][odd]), other.records_at(rows[1][odd]))  # as Python values

Every pair is read from its columns: float64 values, and an integer tensor's exact values from the ``*_int``
columns as int64 (``Pairs.ints``, and int64 sample blocks), compared exactly. A pair goes to ``from_records``
only when a value of it is kept in ``extra`` (a value of no column's type: only Python holds it) or when its
samples need ``rules.pair_samples`` to pair them (index lists that differ, lists of other lengths); every
other pair has equal index lists as long as both sample lists, which ``pair_samples`` pairs by position.
``from_records`` also serves the RecordDiffs, which show the values as the records hold them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .options import COUNTS, MOMENTS, STRUCTURE, precision_of
from .reading import LoadedDump, one_key
from .rules import pair_samples

__all__ = ["CONTEXT", "SCALARS", "Pairs", "SampleBlock", "context_of", "from_columns", "from_records", "match"]

SCALARS = ("numel", *COUNTS, *MOMENTS)  # compared as single values (shape and dtype only for equality)
CONTEXT = ("precision", "scale_floor")  # what a default tolerance depends on beyond the record (reading)
_INTS = ("min_int", "max_int", "samples_int")  # an integer tensor's exact values
_COMPARED = ("shape", "dtype", *SCALARS, "samples", "sample_indices", "extra", *_INTS, "phase", *CONTEXT)


@dataclass
class SampleBlock:
    """Paired samples of some pairs: row i of each array belongs to pair ``rows[i]``, ``valid`` masks padding."""

    rows: np.ndarray
    indices: np.ndarray
    base: np.ndarray
    other: np.ndarray
    valid: np.ndarray


@dataclass
class Pairs:
    """``count`` matched pairs: which structure fields and counts differ, the single values of both sides
    (float64 with a null mask, or object arrays holding None), and the samples paired where shapes match."""

    count: int
    unequal: dict[str, np.ndarray]  # STRUCTURE and COUNTS -> the two values differ
    base: dict[str, tuple[np.ndarray, np.ndarray]]  # SCALARS -> (values, null)
    other: dict[str, tuple[np.ndarray, np.ndarray]]
    samples: list[SampleBlock]
    shifted: np.ndarray  # the index lists differ: only the common indices were paired (a note)
    precision: np.ndarray  # the precision each pair is compared at (names: config.PRECISIONS, "exact")
    floor: np.ndarray  # the scale floor of each pair's default tolerance (0: none)
    phase: np.ndarray  # each pair's phase (its moments' tolerance depends on it)
    # min, max -> (base values, other values, both sides hold an integer): integer tensors' exact values (int64)
    ints: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    integer: np.ndarray | None = None  # an integer in an *_int column on either side: its RecordDiff shows it


class _Columns:
    """The compared columns of one side's matched rows as numpy arrays (nulls as a mask)."""

    def __init__(self, loaded: LoadedDump, rows: np.ndarray) -> None:
        table = loaded.table.select(list(_COMPARED))
        if not (len(rows) == table.num_rows and np.array_equal(rows, np.arange(len(rows)))):
            table = table.take(pa.array(rows, pa.int64()))
        self.table = table

    def floats(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        column = self.table.column(name)
        values = column.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        return values, pc.is_null(column).to_numpy(zero_copy_only=False)

    def labels(self, name: str) -> np.ndarray:
        """A string column as an object array, through its dictionary (a few distinct values, many rows)."""
        encoded = pc.dictionary_encode(self.table.column(name)).unify_dictionaries().combine_chunks()
        return np.array(encoded.dictionary.to_pylist() + [None], dtype=object)[
            encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False)]

    def present(self, name: str) -> np.ndarray:
        return pc.is_valid(self.table.column(name)).to_numpy(zero_copy_only=False)

    def ints(self, name: str) -> np.ndarray:
        """An integer column as int64 (0 where null: read with ``present``)."""
        return self.table.column(name).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)

    def differs(self, name: str, other: "_Columns") -> np.ndarray:
        """Per row: this side's value of a string column is not the other's (None equals only None)."""
        mine, theirs = self.table.column(name), other.table.column(name)
        unequal = pc.fill_null(pc.not_equal(mine, theirs), False)
        return pc.or_(unequal, pc.not_equal(pc.is_null(mine), pc.is_null(theirs))).to_numpy(zero_copy_only=False)

    def lists(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat values, start offset per row, length per row; -1 for a null list), over every chunk."""
        values, starts, lengths = [], [], []
        base = 0
        for chunk in self.table.column(name).chunks:
            offsets = chunk.offsets.to_numpy()  # they index the chunk's whole child array
            child = chunk.values.to_numpy(zero_copy_only=False)
            values.append(child)
            starts.append(offsets[:-1] + base)
            lengths.append(np.where(chunk.is_null().to_numpy(zero_copy_only=False), -1, np.diff(offsets)))
            base += len(child)
        if not values:
            return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)
        if len(values) == 1:  # read_dump's one chunk: its values as they are (samples are tens of MB)
            return values[0], starts[0].astype(np.int64, copy=False), lengths[0].astype(np.int64, copy=False)
        return (np.concatenate(values), np.concatenate(starts).astype(np.int64, copy=False),
                np.concatenate(lengths).astype(np.int64, copy=False))


def _isnan(values: np.ndarray) -> np.ndarray:
    return np.isnan(values) if values.dtype.kind == "f" else np.zeros(values.shape, dtype=bool)


def _same_lists(a: tuple, b: tuple) -> np.ndarray:
    """Per row: the two lists are equal (both null counts as equal; a null element equals a null element)."""
    values_a, starts_a, lengths_a = a
    values_b, starts_b, lengths_b = b
    same = lengths_a == lengths_b
    if same.all() and len(values_a) == len(values_b) and np.array_equal(starts_a, starts_b):
        if not len(values_a) or np.array_equal(values_a, values_b):
            return same
        # One layout on both sides: compare the flat values once, then per row.
        unequal = ~((values_a == values_b) | (_isnan(values_a) & _isnan(values_b)))
        running = np.concatenate([[0], np.cumsum(unequal)])
        return running[starts_a + np.maximum(lengths_a, 0)] == running[starts_a]
    for length in np.unique(lengths_a[same & (lengths_a > 0)]):
        rows = np.flatnonzero(same & (lengths_a == length))
        block_a = values_a[starts_a[rows, None] + np.arange(length)]
        block_b = values_b[starts_b[rows, None] + np.arange(length)]
        equal = (block_a == block_b) | (_isnan(block_a) & _isnan(block_b))
        same[rows] = equal.all(axis=1)
    return same


def _rows_of(lists: tuple[np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray, length: int) -> np.ndarray:
    """The ``rows``' lists, each of ``length`` values, as a (rows, length) array (a view when they are stored
    back to back, as a step file stores them)."""
    values, starts, _ = lists
    if len(rows) and starts[rows[0]] + len(rows) * length <= len(values) \
            and np.array_equal(starts[rows], starts[rows[0]] + np.arange(len(rows)) * length):
        return values[starts[rows[0]]:starts[rows[0]] + len(rows) * length].reshape(len(rows), length)
    return values[starts[rows, None] + np.arange(length)]


def from_columns(base: LoadedDump, other: LoadedDump, rows: tuple[np.ndarray, np.ndarray]
                 ) -> tuple[Pairs, np.ndarray]:
    """The pairs ``rows`` (base rows, other rows) on their columns, and the mask of those that go to
    ``from_records`` instead (their entries here are not to be used)."""
    b, o = _Columns(base, rows[0]), _Columns(other, rows[1])
    count = len(rows[0])
    odd = b.present("extra") | o.present("extra")
    integer = np.zeros(count, dtype=bool)
    for side in (b, o):
        for name in _INTS:
            integer |= side.present(name)
    unequal = {"shape": ~_same_lists(b.lists("shape"), o.lists("shape")),
               "dtype": b.differs("dtype", o)}
    values = {name: (b.floats(name), o.floats(name)) for name in SCALARS}
    for name in ("numel", *COUNTS):  # integers: compared as such
        null_b, null_o = ~b.present(name), ~o.present(name)
        unequal[name] = (null_b != null_o) | (~null_b & ~null_o & (b.ints(name) != o.ints(name)))
    ints = {name: (b.ints(f"{name}_int"), o.ints(f"{name}_int"),
                   b.present(f"{name}_int") & o.present(f"{name}_int")) for name in ("min", "max")}
    samples_b, samples_o = b.lists("samples"), o.lists("samples")
    indices_b, indices_o = b.lists("sample_indices"), o.lists("sample_indices")
    have = (samples_b[2] >= 0) & (samples_o[2] >= 0) & (indices_b[2] >= 0) & (indices_o[2] >= 0) & ~unequal["shape"]
    by_position = have & _same_lists(indices_b, indices_o) & (samples_b[2] == samples_o[2]) \
        & (samples_b[2] == indices_b[2])
    odd |= have & ~by_position
    whole = b.present("samples_int") & o.present("samples_int")  # both integers: their exact values
    paired = by_position & ~odd & (samples_b[2] > 0)
    blocks = []
    for integers, (sides_b, sides_o) in ((False, (samples_b, samples_o)),
                                         (True, (b.lists("samples_int"), o.lists("samples_int")))):
        for length in np.unique(samples_b[2][paired & (whole == integers)]):
            found = np.flatnonzero(paired & (whole == integers) & (samples_b[2] == length))
            blocks.append(SampleBlock(found, _rows_of(indices_b, found, length), _rows_of(sides_b, found, length),
                                      _rows_of(sides_o, found, length), np.ones((len(found), length), dtype=bool)))
    pairs = Pairs(count, unequal, {name: pair[0] for name, pair in values.items()},
                  {name: pair[1] for name, pair in values.items()}, blocks, np.zeros(count, dtype=bool),
                  b.labels("precision"), b.floats("scale_floor")[0], b.labels("phase"), ints, integer)
    return pairs, odd


def match(base: LoadedDump, other: LoadedDump) -> tuple[np.ndarray, np.ndarray]:
    """(base rows, other rows) of the keys both dumps hold, in base row order; keys are unique per dump."""
    if not len(base) or not len(other):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if len(base) == len(other) and np.array_equal(base.rank, other.rank) and np.array_equal(base.step, other.step) \
            and all(base.table.column(name).equals(other.table.column(name)) for name in ("phase", "name")):
        return np.arange(len(base)), np.arange(len(base))  # the common case: the same keys in the same order
    side = np.concatenate([np.zeros(len(base), np.int64), np.ones(len(other), np.int64)])
    row = np.concatenate([np.arange(len(base)), np.arange(len(other))])
    columns = [np.concatenate([base.rank, other.rank]), np.concatenate([base.step, other.step])]
    for name in ("phase", "name"):
        values = pc.unique(pa.concat_arrays([base.table.column(name).combine_chunks(),
                                             other.table.column(name).combine_chunks()]))
        columns.append(np.concatenate([base.codes(name, values)[0], other.codes(name, values)[0]]))
    key = one_key(columns)
    if key is not None:  # one int64 key: a faster sort
        order = np.lexsort((side, key))
        ordered = key[order]
        same = ordered[1:] == ordered[:-1]
    else:
        order = np.lexsort((side, *reversed(columns)))
        same = np.ones(len(order) - 1, dtype=bool)
        for column in columns:
            ordered = column[order]
            same &= ordered[1:] == ordered[:-1]
    first = np.flatnonzero(same)  # a key in both: base's row, then other's (side sorts last)
    base_rows, other_rows = row[order[first]], row[order[first + 1]]
    by_base = np.argsort(base_rows, kind="stable")
    return base_rows[by_base], other_rows[by_base]


def _objects(items: Sequence[Any]) -> np.ndarray:
    found = np.empty(len(items), dtype=object)
    found[:] = list(items)  # element by element: a list value stays one element
    return found


def from_records(base: Sequence[Mapping[str, Any]], other: Sequence[Mapping[str, Any]],
                 context: tuple[Sequence[str], Sequence[float]] | None = None) -> Pairs:
    """The pairs of ``base[i]`` and ``other[i]``, every value as the record holds it (object arrays);
    ``context``: each pair's precision and scale floor (``CONTEXT``: the columns of its base row, ``context_of``;
    None: of the base record alone: the precision of its dtype, no floor)."""
    count = len(base)
    unequal = {key: np.array([b.get(key) != o.get(key) for b, o in zip(base, other)], dtype=bool)
               for key in (*STRUCTURE, *COUNTS)}

    def side(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        found = {}
        for name in SCALARS:
            values = _objects([record.get(name) for record in records])
            found[name] = (values, np.array([value is None for value in values], dtype=bool))
        return found

    paired = [pair_samples(b.get("sample_indices"), b.get("samples"), o.get("sample_indices"), o.get("samples"))
              if b.get("shape") == o.get("shape") else ([], False) for b, o in zip(base, other)]
    rows = np.array([row for row, (found, _) in enumerate(paired) if found], np.int64)
    blocks = []
    if len(rows):
        width = max(len(paired[row][0]) for row in rows.tolist())
        indices, base_values, other_values = (np.full((len(rows), width), None, dtype=object) for _ in range(3))
        valid = np.zeros((len(rows), width), dtype=bool)
        for i, row in enumerate(rows.tolist()):
            for j, (index, b, o) in enumerate(paired[row][0]):
                indices[i, j], base_values[i, j], other_values[i, j], valid[i, j] = index, b, o, True
        blocks.append(SampleBlock(rows, indices, base_values, other_values, valid))
    if context is None:
        context = ([precision_of(record.get("dtype")).name for record in base], [0.0] * count)
    return Pairs(count, unequal, side(base), side(other), blocks,
                 np.array([shifted for _, shifted in paired], dtype=bool), _objects(list(context[0])),
                 np.array(context[1], np.float64), _objects([record.get("phase") for record in base]))


def context_of(loaded: LoadedDump, rows: np.ndarray) -> tuple[list[str], list[float]]:
    """The ``context`` of ``from_records`` for the base rows ``rows``."""
    return loaded.column("precision", rows), loaded.column("scale_floor", rows)
