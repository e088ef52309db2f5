"""The matched record pairs of two dumps, both sides as arrays (``Values``), and the rules on their values.

    rows = match(base, other)                      # (base rows, other rows) with the same key
    pairs, shown = from_columns(base, other, rows) # ``shown``: pairs a plot shows through their RecordDiff
    difference(b, o, pairs.equal); distance(b, o)  # |other - base| of single values, of samples

Every value is read from its columns exactly (an integer from its ``*_int`` twin), the few kept in ``extra`` (of
no column's type) decoded into the same arrays. Samples pair by position where the index lists are equal,
else at the common indices (``_by_index``). docs/compare.md states the rules in words.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .options import COUNTS, MOMENTS
from .reading import LoadedDump, one_key

__all__ = ["SCALARS", "Pairs", "SampleBlock", "Values", "both_ints", "difference", "differs", "distance",
           "exact_distance", "from_columns", "match", "numbers", "same"]

SCALARS = ("numel", *COUNTS, *MOMENTS)  # compared as single values (shape and dtype only for equality)
_TWINS = {"min": "min_int", "max": "max_int", "numel": "numel", **{name: name for name in COUNTS}}  # exact ints
_COMPARED = ("shape", "dtype", *SCALARS, "samples", "sample_indices", "extra", "min_int", "max_int", "samples_int",
             "phase", "precision", "scale", "scale_floor")
_DECODED = frozenset(("shape", "dtype", *SCALARS, "samples", "sample_indices"))  # read from ``extra`` too


class Values(NamedTuple):
    """Values of one side (a statistic of every pair, or samples) as arrays, exactly: ``floats`` (float64, a bool
    as 0 or 1, nan where no number), and where a value is something else: None (``null``), an integer (``ints``
    where ``is_int``, which None means everywhere; int64, or Python ints where one is beyond int64), or of no
    number type (``odd``: -1 a bool, subtracted as 0 or 1 but no number; k > 0 ``Pairs.objects[k - 1]``)."""

    floats: np.ndarray
    null: np.ndarray | None = None
    ints: np.ndarray | None = None
    is_int: np.ndarray | None = None
    odd: np.ndarray | None = None

    def take(self, which: Any) -> "Values":
        return Values(*(None if part is None else part[which] for part in self))

    def value(self, at: Any, objects: list[Any]) -> Any:
        """The value at ``at`` as the record holds it."""
        if self.null is not None and self.null[at]:
            return None
        odd = 0 if self.odd is None else int(self.odd[at])
        if odd > 0:
            return objects[odd - 1]
        if odd < 0:
            return bool(self.floats[at])
        if self.ints is not None and (self.is_int is None or self.is_int[at]):
            return int(self.ints[at])
        return float(self.floats[at])


def both_ints(base: Values, other: Values) -> np.ndarray | bool:
    """Per value: both sides hold an integer (False: none does; True: all do)."""
    if base.ints is None or other.ints is None:
        return False
    return (True if base.is_int is None else base.is_int) & (True if other.is_int is None else other.is_int)


def numbers(values: Values) -> np.ndarray:
    """Per value: a finite number (an int or a float; a bool is none)."""
    found = np.isfinite(values.floats)
    if values.null is not None:
        found &= ~values.null
    return found if values.odd is None else found & (values.odd == 0)


def same(base: Values, other: Values, equal: np.ndarray | None, nan_equal: bool = True) -> np.ndarray:
    """Per pair: Python's ``base == other`` (``nan_equal``: nan equals nan); ``equal``: the equality of the
    values of no number type (``Pairs.equal``)."""
    found = base.floats == other.floats
    if nan_equal:
        found |= np.isnan(base.floats) & np.isnan(other.floats)
    both = both_ints(base, other)
    if both is not False:
        found = np.where(both, base.ints == other.ints, found).astype(bool)
    if base.odd is not None or other.odd is not None:
        odd_b = np.zeros(found.shape, np.int64) if base.odd is None else np.maximum(base.odd, 0)
        odd_o = np.zeros(found.shape, np.int64) if other.odd is None else np.maximum(other.odd, 0)
        found = np.where((odd_b > 0) | (odd_o > 0), equal[odd_b, odd_o] if equal is not None else False, found)
    if base.null is None and other.null is None:
        return found
    null_b = np.zeros(found.shape, bool) if base.null is None else base.null
    null_o = np.zeros(found.shape, bool) if other.null is None else other.null
    return np.where(null_b | null_o, null_b & null_o, found)


def exact_distance(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """|other - base| of integers, exact: uint64 for int64 values (it fits), Python ints for Python ints. As
    float64 it is rounded as Python's float() rounds the exact integer."""
    if base.dtype == object or other.dtype == object:
        return np.abs(other.astype(object) - base.astype(object))
    with np.errstate(over="ignore"):
        base_bits, other_bits = base.view(np.uint64), other.view(np.uint64)
        return np.where(other >= base, other_bits - base_bits, base_bits - other_bits)


def difference(base: Values, other: Values, equal: np.ndarray | None) -> np.ndarray:
    """|other - base| of two finite numbers (integers exactly, then as a float); otherwise 0 when both are the
    same value (None only equals None), else inf."""
    both = numbers(base) & numbers(other)
    diff = np.where(same(base, other, equal), 0.0, np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        diff[both] = np.abs(other.floats[both] - base.floats[both])
    ints = both_ints(base, other)
    if ints is not False:
        exact = both & ints
        diff[exact] = exact_distance(base.ints[exact], other.ints[exact]).astype(np.float64)
    return diff


def distance(base: Values, other: Values) -> np.ndarray:
    """|other - base| of samples as Python subtracts them (a bool is a number here; None or no number: inf)."""
    ints = both_ints(base, other)
    if ints is True:
        return exact_distance(base.ints, other.ints).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        found = other.floats - base.floats
    found = np.abs(found, out=found)  # in place: a second temporary of a large block costs more than the pass
    if ints is not False:
        found[ints] = exact_distance(base.ints[ints], other.ints[ints]).astype(np.float64)
    for side in (base, other):
        if side.null is not None:
            found[side.null] = np.inf
        if side.odd is not None:
            found[side.odd > 0] = np.inf
    return found


@dataclass
class SampleBlock:
    """Paired samples of some pairs: row i of each array belongs to pair ``rows[i]``, ``valid`` masks padding,
    ``positions``: each sample's position in the base record's lists. ``base`` and ``other``: float64, or int64
    where that side's samples are integers; ``exact``: both sides as ``Values`` where an array alone does not say
    them (samples paired by index, or decoded from ``extra``)."""

    rows: np.ndarray
    positions: np.ndarray
    base: np.ndarray
    other: np.ndarray
    valid: np.ndarray
    exact: tuple[Values, Values] | None = None

    def sides(self) -> tuple[Values, Values]:
        if self.exact is not None:
            return self.exact
        return tuple(Values(side) if side.dtype.kind == "f" else Values(side.astype(np.float64), ints=side)
                     for side in (self.base, self.other))  # type: ignore[return-value]

    def take(self, which: Any) -> "SampleBlock":
        return SampleBlock(*(part[which] for part in (self.rows, self.positions, self.base, self.other, self.valid)),
                           None if self.exact is None else (self.exact[0].take(which), self.exact[1].take(which)))


@dataclass
class Pairs:
    """``count`` matched pairs: which structure fields and counts differ, the single values of both sides
    (``Values``), and the samples paired where shapes match."""

    count: int
    unequal: dict[str, np.ndarray]  # STRUCTURE and COUNTS -> the two values differ
    base: dict[str, Values]  # SCALARS -> values
    other: dict[str, Values]
    samples: list[SampleBlock]
    shifted: np.ndarray  # the index lists differ: only the common indices were paired (a note)
    precision: np.ndarray  # the precision each pair is compared at (names: config.PRECISIONS, "exact")
    scale: np.ndarray  # the base tensor's scale: its rms, without mask fills (reading._unfilled)
    floor: np.ndarray  # the scale floor of each pair's default tolerance (0: none)
    phase: np.ndarray  # each pair's phase (its moments' tolerance depends on it)
    integer: np.ndarray  # an integer in an *_int column on either side: its RecordDiff shows it
    objects: list[Any] = field(default_factory=list)  # the values of no number type (Values.odd)
    equal: np.ndarray | None = None  # (objects + 1) x (objects + 1): Python's == of two of them (0: none)
    sides: tuple[_Columns, ...] = ()  # base's, other's: a record's value of a key (``_Columns.python``)


class _Columns:
    """The compared columns of one side's matched rows as numpy arrays (nulls as a mask)."""

    def __init__(self, loaded: LoadedDump, rows: np.ndarray) -> None:
        table = loaded.table.select(list(_COMPARED))
        if not (len(rows) == table.num_rows and np.array_equal(rows, np.arange(len(rows)))):
            table = table.take(pa.array(rows, pa.int64()))
        self.table = table
        extra = table.column("extra")
        self.extra: dict[str, dict[int, Any]] = {}  # key -> row -> value, of the compared keys
        if extra.null_count < len(extra):
            at = np.flatnonzero(pc.is_valid(extra).to_numpy(zero_copy_only=False))
            for row, text in zip(at.tolist(), extra.take(pa.array(at, pa.int64())).to_pylist()):
                for key, value in json.loads(text).items():
                    if key in _DECODED:
                        self.extra.setdefault(key, {})[row] = value

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

    def python(self, key: str, row: int) -> Any:
        """A row's value of ``key`` as its record holds it."""
        found = self.extra.get(key, {})
        return found[row] if row in found else self.table.column(key)[row].as_py()

    def values(self, name: str, objects: list[Any]) -> Values:
        """A statistic's ``Values``, those kept in ``extra`` decoded into them."""
        twin = _TWINS.get(name)
        found = Values(*self.floats(name), *((self.ints(twin), self.present(twin)) if twin else (None, None)))
        decoded = self.extra.get(name)
        if not decoded:
            return found
        part = _decoded(list(decoded.values()), objects)
        fields = []
        for mine, theirs in zip(found, part):
            fields.append(np.zeros(len(found.floats), theirs.dtype) if mine is None else
                          mine.astype(np.result_type(mine, theirs)))
            fields[-1][list(decoded)] = theirs
        return Values(*fields)

    def lists(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat values, start offset per row, length per row; -1 for a null list)."""
        column = self.table.column(name)
        # read_dump's one chunk as it is (samples are tens of MB); several are joined
        lists = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        offsets = lists.offsets.to_numpy()  # they index the whole child array
        lengths = np.where(lists.is_null().to_numpy(zero_copy_only=False), -1, np.diff(offsets))
        return (lists.values.to_numpy(zero_copy_only=False), offsets[:-1].astype(np.int64, copy=False),
                lengths.astype(np.int64, copy=False))


def _decoded(items: list[Any], objects: list[Any]) -> Values:
    """Python values (from ``extra``) as ``Values``; a value of no number type is appended to ``objects``."""
    count = len(items)
    floats, null, is_int = np.full(count, np.nan), np.zeros(count, bool), np.zeros(count, bool)
    odd = np.zeros(count, np.int64)
    ints: list[int] = [0] * count
    for at, value in enumerate(items):
        if value is None:
            null[at] = True
        elif isinstance(value, (bool, int)):
            floats[at], ints[at], is_int[at] = float(value), int(value), True
            odd[at] = -1 if isinstance(value, bool) else 0
        elif isinstance(value, float):
            floats[at] = value
        else:
            objects.append(value)
            odd[at] = len(objects)
    wide = any(not -(1 << 63) <= value < 1 << 63 for value in ints)
    exact = np.empty(count, object) if wide else np.zeros(count, np.int64)
    exact[:] = ints
    return Values(floats, null, exact, is_int, odd)


def _isnan(values: np.ndarray) -> np.ndarray:
    return np.isnan(values) if values.dtype.kind == "f" else np.zeros(values.shape, dtype=bool)


def _same_lists(a: tuple, b: tuple) -> np.ndarray:
    """Per row: the two lists are equal (both null counts as equal; a null element equals a null element)."""
    values_a, starts_a, lengths_a = a
    values_b, starts_b, lengths_b = b
    same_rows = lengths_a == lengths_b
    if same_rows.all() and len(values_a) == len(values_b) and np.array_equal(starts_a, starts_b):
        if not len(values_a) or np.array_equal(values_a, values_b):
            return same_rows
        # One layout on both sides: compare the flat values once, then per row.
        unequal = ~((values_a == values_b) | (_isnan(values_a) & _isnan(values_b)))
        running = np.concatenate([[0], np.cumsum(unequal)])
        return running[starts_a + np.maximum(lengths_a, 0)] == running[starts_a]
    for length in np.unique(lengths_a[same_rows & (lengths_a > 0)]):
        rows = np.flatnonzero(same_rows & (lengths_a == length))
        block_a = values_a[starts_a[rows, None] + np.arange(length)]
        block_b = values_b[starts_b[rows, None] + np.arange(length)]
        same_rows[rows] = ((block_a == block_b) | (_isnan(block_a) & _isnan(block_b))).all(axis=1)
    return same_rows


def _rows_of(lists: tuple[np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray, length: int) -> np.ndarray:
    """The ``rows``' lists, each of ``length`` values, as a (rows, length) array (a view when they are stored
    back to back, as a step file stores them)."""
    values, starts, _ = lists
    if len(rows) and starts[rows[0]] + len(rows) * length <= len(values) \
            and np.array_equal(starts[rows], starts[rows[0]] + np.arange(len(rows)) * length):
        return values[starts[rows[0]]:starts[rows[0]] + len(rows) * length].reshape(len(rows), length)
    return values[starts[rows, None] + np.arange(length)]


def _spread(lists: tuple[np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``rows``' lists one after the other: (values, start per row, length per row; a null list: empty)."""
    values, starts, lengths = lists
    count = np.maximum(lengths[rows], 0)
    first = np.cumsum(count) - count
    return values[np.repeat(starts[rows] - first, count) + np.arange(int(count.sum()))], first, count


def _flat_side(side: _Columns, rows: np.ndarray, objects: list[Any]
               ) -> tuple[Values, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The samples of ``rows`` (as Values, start and length per row) and their indices (the same), from the
    columns, or decoded from ``extra`` where kept there (after the others; indices of no int64 as floats)."""
    floats, start, length = _spread(side.lists("samples"), rows)
    exact = side.lists("samples_int")
    is_int = np.repeat(exact[2][rows] >= 0, length)
    ints = np.zeros(len(floats), np.int64)
    ints[is_int] = _spread(exact, rows)[0]
    parts = [Values(floats.astype(np.float64), np.zeros(len(floats), bool), ints, is_int,
                    np.zeros(len(floats), np.int64))]
    indices, index_start, index_length = _spread(side.lists("sample_indices"), rows)
    index_parts = [indices]
    where = {value: at for at, value in enumerate(rows.tolist())}
    for key, found, starts, lengths in (("samples", parts, start, length),
                                         ("sample_indices", index_parts, index_start, index_length)):
        end = len(found[0][0] if key == "samples" else found[0])
        for row, value in side.extra.get(key, {}).items():
            if row in where:
                decoded = _decoded(value, objects if key == "samples" else [])
                found.append(decoded if key == "samples" else decoded.floats)
                starts[where[row]], lengths[where[row]] = end, len(value)
                end += len(value)
    return (Values(*(np.concatenate([part[k] for part in parts]) for k in range(5))), start, length,
            np.concatenate(index_parts), index_start, index_length)


def _entries(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, position in the row) of every entry of rows of ``lengths`` entries, row by row."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    return rows, np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _by_index(b: _Columns, o: _Columns, rows: np.ndarray, equal_lists: np.ndarray, objects: list[Any]
              ) -> SampleBlock | None:
    """The samples of ``rows`` paired as ``zip`` and a dict of the other record's pair them: by position where
    the index lists are equal (``equal_lists``), else at the base's indices that the other has (its last sample
    at an index). None: no pair."""
    values_b, start_b, length_b, index_b, istart_b, ilength_b = _flat_side(b, rows, objects)
    values_o, start_o, length_o, index_o, istart_o, ilength_o = _flat_side(o, rows, objects)
    usable_b, usable_o = np.minimum(length_b, ilength_b), np.minimum(length_o, ilength_o)  # what zip pairs
    (row_b, j_b), (row_o, j_o) = _entries(usable_b), _entries(usable_o)
    codes = np.unique(np.concatenate([index_b[istart_b[row_b] + j_b], index_o[istart_o[row_o] + j_o]]),
                      return_inverse=True)[1].reshape(-1)
    key_b, key_o = row_b * (len(codes) + 1) + codes[:len(row_b)], row_o * (len(codes) + 1) + codes[len(row_b):]
    order = np.lexsort((j_o, key_o))  # the other's (row, index) -> its last position: a dict of its samples
    key_o, j_o = key_o[order], j_o[order]
    last = np.ones(len(order), bool)
    last[:-1] = key_o[1:] != key_o[:-1]
    known, position = key_o[last], j_o[last]
    at = np.minimum(np.searchsorted(known, key_b), max(len(known) - 1, 0))
    hit = known[at] == key_b if len(known) else np.zeros(len(key_b), bool)
    j_o = position[at] if len(known) else j_b
    equal = equal_lists[row_b]
    hit, j_o = np.where(equal, j_b < usable_o[row_b], hit), np.where(equal, j_b, j_o)
    row_b, j_b, j_o = row_b[hit], j_b[hit], j_o[hit]
    if not len(row_b):
        return None
    paired, per_row = np.unique(row_b, return_counts=True)
    line, column = _entries(per_row)
    shape = (len(paired), int(per_row.max()))

    def placed(values: np.ndarray, at: np.ndarray, fill: Any) -> np.ndarray:
        found = np.full(shape, fill, dtype=values.dtype)
        found[line, column] = values[at]
        return found

    fills = (0.0, True, 0, False, 0)
    base = Values(*(placed(part, start_b[row_b] + j_b, fill) for part, fill in zip(values_b, fills)))
    other = Values(*(placed(part, start_o[row_b] + j_o, fill) for part, fill in zip(values_o, fills)))
    return SampleBlock(rows[paired], placed(j_b, np.arange(len(j_b)), 0), base.floats, other.floats,
                       placed(np.ones(len(row_b), bool), np.arange(len(row_b)), False), (base, other))


def from_columns(base: LoadedDump, other: LoadedDump, rows: tuple[np.ndarray, np.ndarray]
                 ) -> tuple[Pairs, np.ndarray]:
    """The pairs ``rows`` (base rows, other rows) on their columns, and the mask of those whose values or sample
    pairing only their RecordDiff shows (values kept in ``extra``, samples paired by index)."""
    b, o = _Columns(base, rows[0]), _Columns(other, rows[1])
    count = len(rows[0])
    objects: list[Any] = []
    shown = b.present("extra") | o.present("extra")
    twins = ("min_int", "max_int", "samples_int")
    integer = np.logical_or.reduce([side.present(name) for side in (b, o) for name in twins])
    values = {name: (b.values(name, objects), o.values(name, objects)) for name in SCALARS}
    unequal = {"shape": ~_same_lists(b.lists("shape"), o.lists("shape")),
               "dtype": differs(b.table.column("dtype"), o.table.column("dtype"))}
    for name in ("numel", *COUNTS):
        unequal[name] = ~same(*values[name], None, nan_equal=False)
    samples_b, samples_o = b.lists("samples"), o.lists("samples")
    indices_b, indices_o = b.lists("sample_indices"), o.lists("sample_indices")
    same_indices = _same_lists(indices_b, indices_o)
    lengths = [lists[2].copy() for lists in (samples_b, indices_b, samples_o, indices_o)]
    for key in ("shape", "dtype", "numel", *COUNTS, "samples", "sample_indices"):  # kept in ``extra``: by == and len
        for row in sorted({*b.extra.get(key, {}), *o.extra.get(key, {})}):
            pair = [side.python(key, row) for side in (b, o)]
            if key in unequal:
                unequal[key][row] = pair[0] != pair[1]
                continue
            if key == "sample_indices":
                same_indices[row] = pair[0] == pair[1]
            for side, value in enumerate(pair):
                lengths[2 * side + (key == "sample_indices")][row] = len(value) if isinstance(value, list) else -1
    have = (np.minimum.reduce(lengths) >= 0) & ~unequal["shape"]
    by_position = have & same_indices & (lengths[0] == lengths[2]) & (lengths[0] == lengths[1])
    general = have & (~by_position | shown)
    shown |= general
    paired = by_position & ~general & (lengths[0] > 0)
    ints_b, ints_o = b.present("samples_int"), o.present("samples_int")
    lists = {(0, False): samples_b, (0, True): b.lists("samples_int"), (1, False): samples_o,
             (1, True): o.lists("samples_int")}
    blocks = []
    for kind_b, kind_o in ((False, False), (True, True), (True, False), (False, True)):
        kind = paired & (ints_b == kind_b) & (ints_o == kind_o)
        for length in np.unique(lengths[0][kind]):
            found = np.flatnonzero(kind & (lengths[0] == length))
            sides = [_rows_of(lists[side, exact], found, length) for side, exact in ((0, kind_b), (1, kind_o))]
            blocks.append(SampleBlock(found, np.broadcast_to(np.arange(length), sides[0].shape), *sides,
                                      np.ones(sides[0].shape, dtype=bool)))
    shifted = general & ~same_indices
    if general.any():
        block = _by_index(b, o, np.flatnonzero(general), same_indices[general], objects)
        blocks += [block] if block is not None else []
    equal = np.array([[False] * (len(objects) + 1)] + [[False] + [bool(first == second) for second in objects]
                                                      for first in objects]) if objects else None
    pairs = Pairs(count, unequal, {name: pair[0] for name, pair in values.items()},
                  {name: pair[1] for name, pair in values.items()}, blocks, shifted, b.labels("precision"),
                  b.floats("scale")[0], b.floats("scale_floor")[0], b.labels("phase"), integer, objects, equal, (b, o))
    return pairs, shown


def differs(first: pa.ChunkedArray, second: pa.ChunkedArray) -> np.ndarray:
    """Per row: the two columns' values differ (None equals only None)."""
    unequal = pc.fill_null(pc.not_equal(first, second), False)
    return pc.or_(unequal, pc.not_equal(pc.is_null(first), pc.is_null(second))).to_numpy(zero_copy_only=False)


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
        same_key = ordered[1:] == ordered[:-1]
    else:
        order = np.lexsort((side, *reversed(columns)))
        same_key = np.ones(len(order) - 1, dtype=bool)
        for column in columns:
            ordered = column[order]
            same_key &= ordered[1:] == ordered[:-1]
    first = np.flatnonzero(same_key)  # a key in both: base's row, then other's (side sorts last)
    base_rows, other_rows = row[order[first]], row[order[first + 1]]
    by_base = np.argsort(base_rows, kind="stable")
    return base_rows[by_base], other_rows[by_base]
