"""Records as statistics rows: what the training thread hands the writer, turned into Arrow on the writer thread.

    block = RowBlock(step=3, rank=0, sample_count=32, parts=[rows], ready=None, entries=entries)
    table = block.to_table()       # the dump's Arrow table (probes.dump.columns.SCHEMA), no per-record dict

A row is a float64 vector: the registry's accumulated statistics (``probes.dump.statistics``), in its
order, then up to ``sample_count`` samples, then (``hashed``) the tensor's 64-bit hash as int64 bits
(``probes.stats.hashing``; the record's ``hash``); for an integer tensor, min, max and the samples hold
int64 bit patterns. An entry says what names one record and where its row is:
``(names, phase, seq, described, part, row, step)``:

- ``names``: ``RecordNames(name, tensor_index, module, module_class, kind, depth, legacy_name, inputs)``, held
  once per site (``inputs``: None but for an op record);
- ``described``: ``Described``, what the record says of its tensor (shape, dtype, ...), held once per kind
  of tensor;
- ``part``, ``row``: the row's host array in ``parts`` and its index; ``part`` is None for a record without
  statistics (``described.unsupported`` says why);
- ``step``: the record's step (the block's).

``ready`` (None, or a callable) is waited for before ``parts`` are read: the copy from the device may
still be in flight (a CUDA event).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, is_, itemgetter
from typing import Any, Callable, NamedTuple

import numpy as np
import pyarrow as pa

from .columns import SCHEMA
from .statistics import ACCUMULATED, DERIVED

__all__ = ["ACCUMULATED_WIDTH", "NAME_FIELDS", "Described", "Entry", "EntryColumns", "RecordNames", "RowBlock"]

ACCUMULATED_WIDTH = len(ACCUMULATED)
_DESCRIBING = ("shape", "dtype", "layout", "stats_of", "unsupported")


class RecordNames(NamedTuple):
    """What names one record: made once per site (or parameter) and shared by the entries of every step."""

    name: str  # the record's name, e.g. "blocks.0.fc.output.0"
    tensor_index: int
    module: str  # the module's qualified name ("<root>" for the root), or the inspect name
    module_class: str
    kind: str  # the site's kind ("output", "input", "inspect", "op"), or "param"
    depth: int
    legacy_name: str  # the original ORT hooks' name for it
    inputs: list[str] | None  # an op record's inputs, by record name (None: not an op record)


NAME_FIELDS = RecordNames._fields  # the record columns an entry's names fill, in order


class Described(NamedTuple):
    """What a record says of its tensor; ``present`` lists the keys it has (a None value is "null")."""

    present: tuple[str, ...]  # of _DESCRIBING, in that order
    shape: list[int | None] | None = None
    dtype: str | None = None
    layout: str | None = None
    stats_of: str | None = None
    unsupported: str | None = None
    integer: bool = False  # min, max and samples are int64 bit patterns (an integer or bool tensor)
    numel: int = 0  # of what the statistics read: how many samples the row has
    hashed: bool = True  # in a hashed block, its row ends with a hash (False: a row merged from shards has none)


class Entry(NamedTuple):
    """One record of a step in the making: what names it, and where its statistics row is."""

    names: RecordNames
    phase: str
    seq: int
    described: Described
    part: int | None  # which buffer holds its row (None: no row, the record says why)
    row: int | None  # the row in that buffer
    step: int


@dataclass(eq=False)
class RowBlock:
    """Some records of one step of one rank, as rows (see the module docstring)."""

    step: int
    rank: int
    sample_count: int
    parts: list[Any]  # host float64 arrays (numpy, or anything np.asarray reads: CPU tensors)
    entries: list[Entry]
    ready: Callable[[], None] | None = None
    indices: Callable[[int], list[int]] = field(default=lambda numel: [])  # sample indices for a numel
    hashed: bool = False  # each row ends with the tensor's hash

    def to_table(self, reuse: EntryColumns | None = None) -> pa.Table:
        """The records as one table of ``SCHEMA``, built column by column from the rows.

        ``reuse``: what the previous block of the same stream built from its entries' names, phases and
        descriptions (the writer keeps one per step stream); taken again while this block's entries hold the
        same objects in the same order, rebuilt (and kept) otherwise. The table is the same either way.

        It runs on the writer thread holding the GIL, which the training thread waits for: every pass over the
        entries is a C-level ``map`` or a numpy call, none a Python loop per record.
        """
        if self.ready is not None:
            self.ready()
        entries = self.entries
        count = len(entries)
        names, phases = list(map(_NAMES, entries)), list(map(_PHASE, entries))
        described = list(map(_DESCRIBED, entries))
        built = reuse.find(names, phases, described) if reuse is not None else None
        if built is None:
            built = _Built(names, phases, described)
            if reuse is not None:
                reuse.keep(built)
        columns: dict[str, Any] = dict(built.columns)
        columns["step"] = pa.array(np.full(count, self.step, dtype=np.int64))
        columns["rank"] = pa.array(np.full(count, self.rank, dtype=np.int64))
        columns["seq"] = list(map(_SEQ, entries))
        nulls = list(built.nulls)  # a copy: _statistics replaces the rows that gain a null statistic
        self._statistics(columns, nulls, built)
        columns["nulls"] = nulls
        arrays = []
        for schema_field in SCHEMA:
            values = columns.get(schema_field.name)
            if values is None:
                arrays.append(built.null_column(schema_field))
            elif isinstance(values, pa.Array):
                arrays.append(values)
            else:
                arrays.append(pa.array(values, type=schema_field.type))
        return pa.Table.from_arrays(arrays, schema=SCHEMA)

    def _sample_indices(self, numels: np.ndarray) -> np.ndarray:
        """The sample indices of records of these sizes, one after the other (each size's made once)."""
        sizes, which = np.unique(numels, return_inverse=True)
        runs = [np.asarray(self.indices(size), dtype=np.int64) for size in sizes.tolist()]
        lengths = np.array([len(run) for run in runs], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        pool = np.concatenate(runs) if runs else np.empty(0, np.int64)
        return _gather_runs(pool, starts[which], lengths[which])

    def _statistics(self, columns: dict[str, Any], nulls: list[list[str] | None], built: _Built) -> None:
        """The statistics and samples columns of the records that have rows."""
        entries = self.entries
        count = len(entries)
        part = _positions(list(map(_PART, entries)))
        with_rows = part >= 0
        if not with_rows.any():
            return
        without_rows = ~with_rows
        row_of = _positions(list(map(_ROW, entries)))
        width = ACCUMULATED_WIDTH + self.sample_count
        # Each record's row, gathered from the parts (the hash, when there is one, in the last column).
        rows = np.zeros((count, width + 1 if self.hashed else width))
        for part_index, host in enumerate(self.parts):
            at = np.flatnonzero(part == part_index)
            if len(at):
                rows[at] = np.asarray(host, dtype=np.float64)[row_of[at], :rows.shape[1]]
        integer = built.integer & with_rows
        stats = rows[:, :ACCUMULATED_WIDTH]
        finite = stats[:, [stat.name for stat in ACCUMULATED].index("finite")]
        merged: dict[str, np.ndarray] = {}
        null: list[np.ndarray] = []  # per statistic, in registry order: the records that have it as None
        for slot, stat in enumerate(ACCUMULATED):
            values = stats[:, slot]
            valid = with_rows & ((finite > 0) if stat.finite_only else True)
            if stat.column == "int":
                merged[stat.name] = values
                columns[stat.name] = pa.array(values.astype(np.int64), mask=without_rows)
            elif stat.column == "float":
                merged[stat.name] = np.where(valid, values, np.nan)
                columns[stat.name] = pa.array(values, mask=~valid)
            else:  # "number": a float, or an exact integer in the "<name>_int" twin
                exact = values.view(np.int64)
                as_float = np.where(integer, exact.astype(np.float64), values)
                columns[stat.name] = pa.array(as_float, mask=~valid)
                columns[f"{stat.name}_int"] = pa.array(exact, mask=~(valid & integer))
            null.append(with_rows & ~valid)
        for stat in DERIVED:
            values = np.asarray(stat.derive(merged), dtype=np.float64)
            valid = with_rows & ~np.isnan(values)
            columns[stat.name] = pa.array(values, mask=~valid)
            null.append(with_rows & ~valid)
        # One search for them all; row by row, in registry order (as the record lists its keys).
        for row, slot in zip(*map(np.ndarray.tolist, np.nonzero(np.column_stack(null)))):
            _add_null(nulls, row, _STATISTIC_NAMES[slot])
        # Samples as list columns built from one flat array each (no list per record).
        numel = built.numel
        taken = np.where(with_rows, np.minimum(numel, self.sample_count), 0)
        kept = np.arange(self.sample_count)[None, :] < taken[:, None]
        values = rows[:, ACCUMULATED_WIDTH:width]
        exact = values.view(np.int64)
        as_float = np.where(integer[:, None], exact.astype(np.float64), values)
        columns["samples"] = _lists(taken, pa.array(as_float[kept]), without_rows)
        taken_int = np.where(integer, taken, 0)
        columns["samples_int"] = _lists(taken_int, pa.array(exact[kept & integer[:, None]]), ~integer)
        key = (with_rows.tobytes(), self.sample_count, self.indices)
        columns["sample_indices"] = built.sample_indices(key, lambda: _lists(
            taken, pa.array(self._sample_indices(numel[with_rows])), without_rows))
        if self.hashed:
            hashes = np.ascontiguousarray(rows[:, width])
            columns["hash"] = pa.array(hashes.view(np.int64), mask=without_rows | built.unhashed)


_NAMES, _PHASE, _SEQ, _DESCRIBED, _PART, _ROW = map(itemgetter, range(6))  # an Entry's fields, read in C
_INTEGER, _NUMEL, _HASHED = attrgetter("integer"), attrgetter("numel"), attrgetter("hashed")
_STATISTIC_NAMES = [stat.name for stat in (*ACCUMULATED, *DERIVED)]  # in the order _statistics checks them
_TYPE = {schema_field.name: schema_field.type for schema_field in SCHEMA}


class EntryColumns:
    """What the last block built from its entries' names, phases and descriptions, for the next one.

        reuse = EntryColumns()               # one per stream of blocks (a writer's steps)
        table = block.to_table(reuse)        # the same table as block.to_table()

    Step after step a training run's entries name the same sites, phases and kinds of tensor: the same Python
    objects, made once per site and kind. While a block's entries hold, position by position, the very objects
    of the last one built (by identity: the references kept here mean no id is reused), its columns are taken
    again; any other block (a changed model, selection or shape) rebuilds them.
    """

    def __init__(self) -> None:
        self._built: _Built | None = None

    def find(self, names: list[tuple], phases: list[str], described: list[Described]) -> _Built | None:
        """The columns built for these objects, or None."""
        built = self._built
        if built is None or not (_same(built.names, names) and _same(built.phases, phases)
                                 and _same(built.described, described)):
            return None
        return built

    def keep(self, built: _Built) -> None:
        self._built = built


def _same(kept: list[Any], objects: list[Any]) -> bool:
    """Whether both lists hold the same objects in the same order (identity, compared in C)."""
    return len(kept) == len(objects) and all(map(is_, kept, objects))


class _Built:
    """The columns of a block that depend only on its entries' names, phases and descriptions."""

    def __init__(self, names: list[tuple], phases: list[str], described: list[Described]) -> None:
        self.names, self.phases, self.described = names, phases, described  # held: their ids stay theirs
        count = len(names)
        columns: dict[str, pa.Array] = {}
        # Names are shared by a site's records, descriptions by a kind of tensor's, phases by all: each distinct
        # one is converted once, then taken by code.
        sites, codes = _codes(names)
        for position, key in enumerate(NAME_FIELDS):
            columns[key] = pa.array([site[position] for site in sites], type=_TYPE[key]).take(codes)
        distinct, codes = _codes(phases)
        columns["phase"] = pa.array(distinct, type=_TYPE["phase"]).take(codes)
        kinds, codes = _codes(described)
        for key in _DESCRIBING:
            values = [getattr(info, key) if key in info.present else None for info in kinds]
            columns[key] = pa.array(values, type=_TYPE[key]).take(codes)
        self.columns = columns
        absent = [[key for key in _DESCRIBING if key in info.present and getattr(info, key) is None] or None
                  for info in kinds]
        self.nulls: list[list[str] | None] = list(map(absent.__getitem__, codes.to_numpy()))
        self.integer = np.fromiter(map(_INTEGER, described), dtype=bool, count=count)
        self.numel = np.fromiter(map(_NUMEL, described), dtype=np.int64, count=count)
        self.unhashed = ~np.fromiter(map(_HASHED, described), dtype=bool, count=count)
        self._nulls: dict[str, pa.Array] = {}
        self._sample_indices: tuple[tuple, pa.Array] | None = None

    def null_column(self, schema_field: pa.Field) -> pa.Array:
        """A column of this many nulls."""
        column = self._nulls.get(schema_field.name)
        if column is None:
            column = self._nulls[schema_field.name] = pa.nulls(len(self.names), schema_field.type)
        return column

    def sample_indices(self, key: tuple[bytes, int, Callable[[int], list[int]]],
                       build: Callable[[], pa.Array]) -> pa.Array:
        """The sample_indices column (``build``), made again unless ``key`` is the last one's: which records have
        rows, the sample count, the ``indices`` callable (compared by identity: held, so its id stays its)."""
        kept = self._sample_indices
        if kept is None or kept[0][:2] != key[:2] or kept[0][2] is not key[2]:
            self._sample_indices = key, build()
        return self._sample_indices[1]


def _codes(objects: list[Any]) -> tuple[list[Any], pa.Array]:
    """The distinct objects of ``objects`` (by identity, in first-seen order) and each object's index among them."""
    distinct = list(dict(zip(map(id, objects), objects)).values())
    code_of = {id(value): code for code, value in enumerate(distinct)}
    return distinct, pa.array(np.fromiter(map(code_of.__getitem__, map(id, objects)), dtype=np.int64,
                                          count=len(objects)))


def _positions(values: list[int | None]) -> np.ndarray:
    """The values as int64, -1 for None (numpy reads None as nan)."""
    positions = np.array(values, dtype=np.float64)
    positions[np.isnan(positions)] = -1
    return positions.astype(np.int64)


def _gather_runs(pool: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``pool[starts[0]:starts[0] + lengths[0]]``, then the next run, ... as one array (no loop per run)."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=pool.dtype)
    ends = np.cumsum(lengths)
    # Position k of the output belongs to run r: pool index starts[r] + (k - first output position of r).
    offsets = np.repeat(starts - (ends - lengths), lengths)
    return pool[offsets + np.arange(total)]


def _lists(lengths: np.ndarray, values: pa.Array, null: np.ndarray) -> pa.ListArray:
    """A list column: row i holds the next ``lengths[i]`` of ``values``; null where ``null``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(null))


def _add_null(nulls: list[list[str] | None], row: int, key: str) -> None:
    """Notes that the record at ``row`` has ``key`` with the value None."""
    listed = nulls[row]
    nulls[row] = [key] if listed is None else [*listed, key]  # a new list: rows of a kind share theirs
