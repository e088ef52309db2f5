"""Records as statistics rows: what the training thread hands the writer, turned into Arrow on the writer thread.

    block = RowBlock(step=3, rank=0, sample_count=32, parts=[rows], ready=None, entries=entries)
    table = block.to_table()       # the dump's Arrow table (probes.dump.columns.SCHEMA), no per-record dict

A row is a float64 vector: the registry's accumulated statistics (``probes.dump.statistics``), in its
order, then up to ``sample_count`` samples, then (``hashed``) the tensor's 64-bit hash as int64 bits
(``probes.stats.hashing``; the record's ``hash``); for an integer tensor, min, max and the samples hold
int64 bit patterns. An entry says what names one record and where its row is:
``(names, phase, seq, described, part, row, step)``:

- ``names``: ``(name, tensor_index, module, module_class, kind, depth, legacy_name, inputs)``, held once per
  site (``inputs``: None but for an op record);
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
from typing import Any, Callable, NamedTuple

import numpy as np
import pyarrow as pa

from .columns import SCHEMA
from .statistics import ACCUMULATED, DERIVED

__all__ = ["ACCUMULATED_WIDTH", "NAME_FIELDS", "Described", "Entry", "RowBlock"]

ACCUMULATED_WIDTH = len(ACCUMULATED)
NAME_FIELDS = ("name", "tensor_index", "module", "module_class", "kind", "depth", "legacy_name",  # an entry's names
               "inputs")
_DESCRIBING = ("shape", "dtype", "layout", "stats_of", "unsupported")


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

    names: tuple  # the NAME_FIELDS values, made once per site
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

    def to_table(self) -> pa.Table:
        """The records as one table of ``SCHEMA``, built column by column from the rows."""
        if self.ready is not None:
            self.ready()
        entries = self.entries
        count = len(entries)
        columns: dict[str, Any] = {}
        names = list(zip(*(entry.names for entry in entries))) if entries else [()] * len(NAME_FIELDS)
        for position, key in enumerate(NAME_FIELDS):
            columns[key] = list(names[position])
        columns["step"] = [self.step] * count
        columns["rank"] = [self.rank] * count
        columns["phase"] = [entry.phase for entry in entries]
        columns["seq"] = [entry.seq for entry in entries]
        described = [entry.described for entry in entries]
        # Descriptions are shared by the records of a kind of tensor: each is spelled out once.
        spelled: dict[int, tuple[tuple[Any, ...], list[str] | None]] = {}
        for info in described:
            if id(info) not in spelled:
                absent = [key for key in _DESCRIBING if key in info.present and getattr(info, key) is None]
                spelled[id(info)] = (tuple(getattr(info, key) if key in info.present else None for key in _DESCRIBING),
                                     absent or None)
        forms = [spelled[id(info)] for info in described]
        for position, key in enumerate(_DESCRIBING):
            columns[key] = [form[0][position] for form in forms]
        nulls: list[list[str] | None] = [None if form[1] is None else list(form[1]) for form in forms]
        self._statistics(columns, nulls)
        columns["nulls"] = nulls
        arrays = {}
        for schema_field in SCHEMA:
            values = columns.get(schema_field.name)
            if values is None:
                arrays[schema_field.name] = pa.nulls(count, schema_field.type)
            elif isinstance(values, pa.Array):
                arrays[schema_field.name] = values
            else:
                arrays[schema_field.name] = pa.array(values, type=schema_field.type)
        return pa.table(arrays, schema=SCHEMA)

    def _sample_indices(self, numels: np.ndarray) -> np.ndarray:
        """The sample indices of records of these sizes, one after the other (each size's made once)."""
        sizes, which = np.unique(numels, return_inverse=True)
        runs = [np.asarray(self.indices(size), dtype=np.int64) for size in sizes.tolist()]
        lengths = np.array([len(run) for run in runs], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        pool = np.concatenate(runs) if runs else np.empty(0, np.int64)
        return _gather_runs(pool, starts[which], lengths[which])

    def _statistics(self, columns: dict[str, Any], nulls: list[list[str] | None]) -> None:
        """The statistics and samples columns of the records that have rows."""
        entries = self.entries
        count = len(entries)
        with_rows = np.fromiter((entry.part is not None for entry in entries), dtype=bool, count=count)
        if not with_rows.any():
            return
        width = ACCUMULATED_WIDTH + self.sample_count
        # Each record's row, gathered from the parts (the hash, when there is one, in the last column).
        rows = np.zeros((count, width + 1 if self.hashed else width))
        for part_index, part in enumerate(self.parts):
            picked = [(position, entry.row) for position, entry in enumerate(entries) if entry.part == part_index]
            if picked:
                at, row = zip(*picked)
                rows[list(at)] = np.asarray(part, dtype=np.float64)[list(row), :rows.shape[1]]
        integer = np.fromiter((entry.described.integer for entry in entries), dtype=bool, count=count) & with_rows
        stats = rows[:, :ACCUMULATED_WIDTH]
        finite = stats[:, [stat.name for stat in ACCUMULATED].index("finite")]
        merged: dict[str, np.ndarray] = {}
        for slot, stat in enumerate(ACCUMULATED):
            values = stats[:, slot]
            valid = with_rows & ((finite > 0) if stat.finite_only else True)
            if stat.column == "int":
                merged[stat.name] = values
                columns[stat.name] = pa.array(values.astype(np.int64), mask=~with_rows)
            elif stat.column == "float":
                merged[stat.name] = np.where(valid, values, np.nan)
                columns[stat.name] = pa.array(values, mask=~valid)
            else:  # "number": a float, or an exact integer in the "<name>_int" twin
                exact = values.view(np.int64)
                as_float = np.where(integer, exact.astype(np.float64), values)
                columns[stat.name] = pa.array(as_float, mask=~valid)
                columns[f"{stat.name}_int"] = pa.array(exact, mask=~(valid & integer))
            for row in np.flatnonzero(with_rows & ~valid):
                _add_null(nulls, row, stat.name)
        for stat in DERIVED:
            values = np.asarray(stat.derive(merged), dtype=np.float64)
            valid = with_rows & ~np.isnan(values)
            columns[stat.name] = pa.array(values, mask=~valid)
            for row in np.flatnonzero(with_rows & ~valid):
                _add_null(nulls, row, stat.name)
        # Samples as list columns built from one flat array each (no list per record).
        numel = np.fromiter((entry.described.numel for entry in entries), dtype=np.int64, count=count)
        taken = np.where(with_rows, np.minimum(numel, self.sample_count), 0)
        kept = np.arange(self.sample_count)[None, :] < taken[:, None]
        values = rows[:, ACCUMULATED_WIDTH:width]
        exact = values.view(np.int64)
        as_float = np.where(integer[:, None], exact.astype(np.float64), values)
        columns["samples"] = _lists(taken, pa.array(as_float[kept]), ~with_rows)
        taken_int = np.where(integer, taken, 0)
        columns["samples_int"] = _lists(taken_int, pa.array(exact[kept & integer[:, None]]), ~integer)
        columns["sample_indices"] = _lists(taken, pa.array(self._sample_indices(numel[with_rows])), ~with_rows)
        if self.hashed:
            hashes = np.ascontiguousarray(rows[:, width])
            unhashed = np.array([not entry.described.hashed for entry in entries], dtype=bool)
            columns["hash"] = pa.array(hashes.view(np.int64), mask=~with_rows | unhashed)


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
    if listed is None:
        nulls[row] = [key]
    else:
        listed.append(key)
