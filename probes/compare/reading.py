"""Reading a dump for comparison: one Arrow table of its records after the filters, keyed by (rank, step, phase, name).

    loaded = read_dump("pt_out", CompareConfig(steps=frozenset({3})), progress=True)
    loaded = read_dump("refactored_out", name_map=load_name_map("names.yaml"))   # names as BASE writes them
    loaded.table; loaded.steps_by_rank; loaded.unfinished; loaded.records_at([0, 1])  # rows, and records of rows
    base, other = rank_pairs(read_dump("ddp_out"))     # rank 0's records once per other rank, and those ranks'

Parsing, completeness and live writers are ``probes.dump.DumpReader``'s; here what comparing adds, on whole
columns: filters, key types, no duplicate keys, the steps each rank finished, a name map's names (the original in
``renamed_from``), execution order, and what a default tolerance depends on beyond the record (``precision``,
``scale_floor``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..dump import DumpFormatError, DumpReader, Record
from ..dump.reader import StepFile
from ..dump.record import RecordKey
from ..dump.columns import records_to_table, table_to_records
from ..utils.names import ROOT_NAME
from ..utils.phases import PARAMETER_PHASES, phase_rank
from .options import (COUNTS, EXACT, MOMENTS, PRECISIONS, CompareConfig, NameMap, NameMapError, coarseness,
                      precision_of)
from .results import Damaged


__all__ = ["COLUMNS", "LoadedDump", "MissingHashes", "check_hashes", "rank_pairs", "rank_steps", "read_dump", "rms"]


class MissingHashes(ValueError):
    """A bit-exact comparison of a dump whose records have no ``hash``."""

# What comparing reads of a record: the key, what is compared, what reports and fuzzy alignment show, and
# what keeps the rest exact (the *_int twins, nulls, extra), an op record's inputs. Not legacy_name, depth, finite,
# m2, neg, pos.
COLUMNS = ("step", "rank", "name", "phase", "seq", "tensor_index", "module", "module_class", "kind", "inputs", "shape",
           "dtype", "layout", "stats_of", "unsupported", "numel", *dict.fromkeys((*MOMENTS, *COUNTS, "zero")),
           "samples", "sample_indices", "min_int", "max_int", "samples_int", "nulls", "extra", "hash")


@dataclass
class LoadedDump:
    """The records of one dump after the config's filters: ``table`` (one row per record, file order)."""

    path: Path
    table: pa.Table  # the columns of probes.dump.columns.SCHEMA, plus "renamed_from", "precision", "scale_floor"
    steps_by_rank: dict[int, list[int]]  # rank -> finished steps read
    unfinished: dict[int, list[int]]  # rank -> unfinished steps (not read)
    renamed: dict[str, str] = field(default_factory=dict)  # original name -> name after the map, those it changed
    files: list[Path] = field(default_factory=list)  # row i comes from files[file_of[i]], line line_of[i]
    file_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    line_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    damaged: list[Damaged] = field(default_factory=list)  # step files left out (skip_damaged)
    _codes: dict[str, tuple[pa.Table, tuple[np.ndarray, pa.Array]]] = field(default_factory=dict, init=False,
                                                                            repr=False, compare=False)

    @classmethod
    def of_records(cls, records: Sequence[Mapping[str, Any]]) -> "LoadedDump":
        """Records at hand as a dump (``engine.compare_records``): their columns, and the context of their default
        tolerance taken from these records alone."""
        table = records_to_table(records).select(list(COLUMNS))
        loaded = cls(Path("."), table.append_column("renamed_from", pa.nulls(table.num_rows, pa.string())), {}, {})
        _add_context(loaded)
        return loaded

    def __len__(self) -> int:
        return self.table.num_rows

    @cached_property
    def rank(self) -> np.ndarray:
        return _ints(self.table, "rank")

    @cached_property
    def step(self) -> np.ndarray:
        return _ints(self.table, "step")

    @cached_property
    def seq(self) -> np.ndarray:
        return _ints(self.table, "seq")

    def codes(self, column: str, values: pa.Array | None = None) -> tuple[np.ndarray, pa.Array]:
        """(per row, the index of its value in ``values``; ``values``): a string column as integers. ``values``
        default to the column's distinct values (kept while the table is the same one); pass two dumps' common ones
        to compare codes."""
        if values is not None:
            return self._codes_of(column, values)
        table, found = self._codes.get(column, (None, None))
        if table is not self.table or found is None:
            found = self._codes_of(column, pc.unique(self.table.column(column)))
            self._codes[column] = (self.table, found)
        return found

    def _codes_of(self, column: str, values: pa.Array) -> tuple[np.ndarray, pa.Array]:
        codes = pc.index_in(self.table.column(column), value_set=values).to_numpy(zero_copy_only=False)
        return codes.astype(np.int64, copy=False), values

    def matches(self, column: str, wants: Callable[[Any], bool]) -> np.ndarray:
        """Per row: whether ``wants`` takes its value of the string ``column`` (asked once per distinct value)."""
        codes, values = self.codes(column)
        wanted = np.array([wants(value) for value in values.to_pylist()], dtype=bool)
        return wanted[codes] if len(wanted) else np.zeros(len(self), dtype=bool)

    @cached_property
    def order(self) -> np.ndarray:
        """Row indices in execution order: step, phase (``phase_rank``), seq, rank (``execution_order``)."""
        codes, phases = self.codes("phase")
        ranks = np.array([phase_rank(phase) for phase in phases.to_pylist()], np.int64)
        by_phase = ranks[codes] if len(self) else np.zeros(0, np.int64)
        return np.lexsort((self.rank, self.seq, by_phase, self.step))

    def column(self, name: str, rows: np.ndarray | None = None) -> list:
        """A column's values (of ``rows``) as Python objects."""
        data = self.table.column(name)
        return (data if rows is None else data.take(pa.array(rows, pa.int64()))).to_pylist()

    def records_at(self, rows: np.ndarray | list[int]) -> list[Record]:
        """The records of ``rows``, as the dump holds them (with ``renamed_from`` when a name map renamed them)."""
        rows = np.asarray(rows, dtype=np.int64)
        part = self.table.take(rows)
        records = table_to_records(part.select([name for name in part.column_names if name != "renamed_from"]))
        for record, original in zip(records, part.column("renamed_from").to_pylist()):
            if original is not None:
                record["renamed_from"] = original  # type: ignore[typeddict-unknown-key]
        return records

    def rename(self, new_names: Mapping[int, str]) -> None:
        """Gives the rows of ``new_names`` (row -> name) their new names; a row's first name is kept as
        ``renamed_from``."""
        if not new_names:
            return
        names = self.column("name")
        renamed_from = self.column("renamed_from")
        for row, name in new_names.items():
            renamed_from[row] = renamed_from[row] or names[row]
            names[row] = name
        table = self.table
        table = table.set_column(table.schema.get_field_index("name"), "name", pa.array(names, pa.string()))
        self.table = table.set_column(table.schema.get_field_index("renamed_from"), "renamed_from",
                                      pa.array(renamed_from, pa.string()))

    def key(self, row: int) -> RecordKey:
        phase, name = (self.table.column(column)[row].as_py() for column in ("phase", "name"))
        return int(self.rank[row]), int(self.step[row]), phase, name

    def keys(self, rows: np.ndarray) -> list[RecordKey]:
        return list(zip(self.rank[rows].tolist(), self.step[rows].tolist(), self.column("phase", rows),
                        self.column("name", rows)))

    def step_records(self, rank: int, step: int) -> dict[RecordKey, Record]:
        """The records of one rank and step, by key."""
        rows = np.flatnonzero((self.rank == rank) & (self.step == step))
        return dict(zip(self.keys(rows), self.records_at(rows)))

    @property
    def records(self) -> dict[RecordKey, Record]:
        """Every record by key, in file order. Materialises the whole dump: for small dumps and tests."""
        rows = np.arange(len(self))
        return dict(zip(self.keys(rows), self.records_at(rows)))

    def where(self, row: int) -> tuple[Path, int]:
        """(file, 1-based line or row) of a row, for messages."""
        return self.files[int(self.file_of[row])], int(self.line_of[row])

    def in_steps(self, steps: Iterable[tuple[int | None, int]], rows: np.ndarray | None = None) -> np.ndarray:
        """Per row (of ``rows``; all by default): whether its (rank, step) is one of ``steps``."""
        rank, step = (self.rank, self.step) if rows is None else (self.rank[rows], self.step[rows])
        wanted = np.array([r * (1 << 32) + s for r, s in steps if r is not None], np.int64)
        return np.isin(rank * (1 << 32) + step, wanted)


def one_key(columns: list[np.ndarray]) -> np.ndarray | None:
    """Integer columns (of the same length) packed into one int64 per row, ordered as the columns are
    (lexicographically), when they are >= 0 and fit; None when they do not."""
    if not len(columns[0]):
        return np.zeros(0, np.int64)
    bits = [int(column.max()).bit_length() for column in columns]
    if min(int(column.min()) for column in columns) < 0 or sum(bits) > 62:
        return None
    key = np.zeros(len(columns[0]), np.int64)
    for column, width in zip(columns, bits):
        key = (key << width) | column
    return key


def _ints(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def read_dump(path: str | Path | DumpReader, config: CompareConfig = CompareConfig(), *,
              progress: bool | TextIO = True, name_map: NameMap | None = None,
              skip_damaged: bool = False) -> LoadedDump:
    """Loads and validates a dump for comparison, keeping only the steps, names and phases ``config`` selects.

    Raises DumpFormatError (naming file and line) for invalid, duplicated or truncated records, OSError for
    unreadable paths, NameMapError when ``name_map`` makes two records of a step one. ``progress``: False, True
    (stderr) or a stream. A live writer of this process into ``path`` is waited for first, so every step it finished
    is read. ``skip_damaged``: damaged step files are left out and listed in ``damaged`` (else DamagedSteps names
    them all). ``path`` may be an open DumpReader (a window's), which is not listed again.
    """
    reader = path if isinstance(path, DumpReader) else DumpReader(path)
    unfinished: dict[int, list[int]] = {}
    if reader.path.is_file():
        files = reader.step_files()
        if not files[0].finished:
            raise ValueError(f"{reader.path} is an unfinished step; load it with include_partial=True "
                             "(show: --include-partial)")
    else:
        for rank, by_state in reader.steps().items():
            if rank is not None and by_state["unfinished"]:
                unfinished[rank] = by_state["unfinished"]
        files = [step_file for step_file in reader.step_files()
                 if step_file.rank is not None and config.wants_step(step_file.step)]
    # One chunk per column: taking rows (matching, building the records a report shows) is slow across chunks.
    known = len(reader.damaged)  # an open reader may have left out files before: only this read's count
    table = reader.concat_tables(files, columns=COLUMNS, progress=progress, skip_damaged=skip_damaged).combine_chunks()
    damaged = reader.damaged[known:]
    if damaged:
        left_out = {id(step_file) for step_file, _ in damaged}
        files = [step_file for step_file in files if id(step_file) not in left_out]
    sizes = _rows_per_file(table, files)
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    loaded = LoadedDump(reader.path, table.append_column("renamed_from", pa.nulls(table.num_rows, pa.string())),
                        {}, unfinished, files=[step_file.path for step_file in files],
                        file_of=np.repeat(np.arange(len(files), dtype=np.int64), sizes),
                        line_of=np.arange(table.num_rows, dtype=np.int64) - starts + 1)
    _check_keys(loaded)
    _fill_seq(loaded)
    _add_context(loaded)
    keep = np.ones(len(loaded), dtype=bool) if config.steps is None else \
        np.isin(loaded.step, np.fromiter(config.steps, dtype=np.int64, count=len(config.steps)))
    loaded.steps_by_rank = _steps_by_rank(loaded, files, keep)
    if name_map is not None:
        _rename(loaded, name_map)
    if config.names:
        keep &= loaded.matches("name", config.wants_name)
    if config.phases is not None:
        keep &= loaded.matches("phase", config.wants_phase)
    if not keep.all():
        _keep(loaded, keep)
    _check_unique(loaded, name_map)
    loaded.damaged = [Damaged(str(f.path), f.rank, f.step, error.line, error.problem) for f, error in damaged]
    return loaded


def check_hashes(loaded: LoadedDump) -> None:
    """Raises MissingHashes unless every record with statistics carries a hash (``hash=True``)."""
    table = loaded.table
    missing = pc.and_(pc.is_null(table.column("hash")), pc.is_null(table.column("unsupported"))).to_numpy(
        zero_copy_only=False)
    if missing.any():
        row = int(np.argmax(missing))
        rank, step, phase, name = loaded.key(row)
        raise MissingHashes(
            f"{loaded.path} has records without a hash ({int(missing.sum())}, e.g. rank {rank} step {step} {phase} "
            f"{name!r}): a bit-exact comparison needs both runs recorded with StatisticsSubscriber(..., hash=True)")


def rank_pairs(loaded: LoadedDump) -> tuple[LoadedDump, LoadedDump]:
    """(rank 0's records once per other rank, labelled with that rank; the other ranks' records): two dumps
    whose matching pairs every rank's record with rank 0's. Raises ValueError for a dump with one rank."""
    ranks = sorted(set(loaded.steps_by_rank) | set(np.unique(loaded.rank).tolist()))
    if len(ranks) < 2 or ranks[0] != 0:
        found = ", ".join(map(str, ranks)) or "none"
        raise ValueError(f"{loaded.path}: comparing ranks needs rank 0 and at least one more rank, found rank(s) "
                         f"{found}; give the dump directory of a multi-process run")
    zero = np.flatnonzero(loaded.rank == 0)
    others = np.flatnonzero(loaded.rank != 0)
    part = loaded.table.take(zero)
    copies = [part.set_column(part.schema.get_field_index("rank"), "rank", pa.array(np.full(len(zero), rank, np.int64)))
              for rank in ranks[1:]]
    base = replace(loaded, table=pa.concat_tables(copies).combine_chunks() if copies else loaded.table.slice(0, 0),
                   steps_by_rank={rank: list(loaded.steps_by_rank.get(0, [])) for rank in ranks[1:]},
                   unfinished={rank: list(loaded.unfinished[0]) for rank in ranks[1:] if loaded.unfinished.get(0)},
                   file_of=np.tile(loaded.file_of[zero], len(ranks) - 1),
                   line_of=np.tile(loaded.line_of[zero], len(ranks) - 1))
    other = replace(loaded, table=loaded.table.take(others),
                    steps_by_rank={rank: steps for rank, steps in loaded.steps_by_rank.items() if rank != 0},
                    unfinished={rank: steps for rank, steps in loaded.unfinished.items() if rank != 0},
                    file_of=loaded.file_of[others], line_of=loaded.line_of[others])
    return base, other


def drop_steps(loaded: LoadedDump, steps: set[tuple[int | None, int]]) -> None:
    """Leaves the records and steps of these (rank, step) out of ``loaded`` (damaged in another run)."""
    if not steps:
        return
    keep = ~loaded.in_steps(steps)
    if not keep.all():
        _keep(loaded, keep)
    for rank, step in steps:
        if rank in loaded.steps_by_rank and step in loaded.steps_by_rank[rank]:
            loaded.steps_by_rank[rank].remove(step)


def _add_context(loaded: LoadedDump) -> None:
    """What the default tolerance of each record depends on beyond the record itself (docs/compare.md, Tolerance),
    from every record of its step before any filter, so that selecting records does not change it: ``precision``
    (``_precisions``: the least precise floating-point dtype of its rank and step) and ``scale_floor``
    (``_scale_floors``: for a parameter's grad, param or optim record, the largest root mean square of the
    same records of its module: a bias gradient that is zero in exact arithmetic is rounding noise of the size
    of its module's weight gradient). The dump's statistics columns are read as float64."""
    codes, dtypes = loaded.codes("dtype")
    names, index = _precisions(dtypes.to_pylist(), codes, _groups([loaded.rank, loaded.step]))
    table = loaded.table
    floats = [table.column(name).to_numpy(zero_copy_only=False).astype(np.float64) for name in ("numel", "mean", "std")]
    phase_codes, phases = loaded.codes("phase")
    phase_names = phases.to_pylist()
    of_parameters = np.isin(phase_codes, [i for i, phase in enumerate(phase_names) if phase in PARAMETER_PHASES])
    parameter_groups = np.full(len(loaded), -1, np.int64)
    rows = np.flatnonzero(of_parameters)
    if len(rows):
        taken = pa.array(rows, pa.int64())
        modules, record_names = (pc.dictionary_encode(table.column(name).take(taken)).combine_chunks()
                                 for name in ("module", "name"))
        # An optimizer state's records group by state (every exp_avg of a module), the others by module alone.
        states = pc.dictionary_encode(pa.array([name.rsplit(".", 1)[-1] for name in
                                                record_names.dictionary.to_pylist()], pa.string()))
        state = states.indices.to_numpy(zero_copy_only=False)[record_names.indices.to_numpy(zero_copy_only=False)]
        optim = phase_names.index("optim") if "optim" in phase_names else -1
        state = np.where(phase_codes[rows] == optim, state + 1, 0)
        parameter_groups[rows] = _groups([loaded.rank[rows], loaded.step[rows], phase_codes[rows],
                                          modules.indices.fill_null(-1).to_numpy(zero_copy_only=False) + 1, state])
    scales = _unfilled(table, rms(*floats), floats[0])
    floors = np.where(of_parameters, _scale_floors(scales, parameter_groups), 0.0)
    backward = phase_codes == (phase_names.index("backward") if "backward" in phase_names else -1)
    floors = np.maximum(floors, _entering(loaded, scales, backward))
    column = pa.DictionaryArray.from_arrays(pa.array(index, pa.int32()), pa.array(names, pa.string()))
    loaded.table = table.append_column("precision", column).append_column(
        "scale", pa.array(scales, pa.float64())).append_column("scale_floor", pa.array(floors, pa.float64()))


# The share of the samples' squares that repeated extremes must hold to be mask fills (docs/compare.md, Scale).
FILL_SHARE = 0.99


def _unfilled(table: pa.Table, scales: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Per row the scale of its tensor without its mask fills: ``scales`` (the rms), or where the record's samples
    hold its min or max exactly at two positions or more and those values hold ``FILL_SHARE`` of the samples'
    squares (``torch.finfo(dtype).min``, -1e4, -1e9 written by ``masked_fill``/``where``), the rms of the other
    finite samples when that is smaller. A nan or inf sample counts as a fill (the moments leave them out)."""
    samples = table.column("samples").combine_chunks()
    if not len(samples) or samples.null_count == len(samples):
        return scales
    samples = samples.fill_null([])  # type: ignore[arg-type]
    lengths = pc.list_value_length(samples).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(samples).cast(pa.float64()).to_numpy(zero_copy_only=False)
    if not len(values):
        return scales
    row = np.repeat(np.arange(len(lengths)), lengths)
    count = len(lengths)
    finite = np.isfinite(values)
    fills = ~finite
    for name in ("min", "max"):
        extreme = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)[row]
        at = finite & (values == extreme)
        fills |= at & (np.bincount(row, at, minlength=count)[row] >= 2)
    with np.errstate(over="ignore", invalid="ignore"):
        squares = np.where(finite, np.square(values), 0.0)
        filled = np.bincount(row, np.where(fills, squares, 0.0), minlength=count)
        rest = np.bincount(row, np.where(fills, 0.0, squares), minlength=count)
        kept = np.bincount(row, ~fills, minlength=count)
        dominated = (kept > 0) & (filled > 0) & (rest <= (1 - FILL_SHARE) / FILL_SHARE * filled)
        unfilled = np.sqrt(rest / np.maximum(kept, 1))
    return np.where(dominated & (unfilled < scales), unfilled, scales)


def _entering(loaded: LoadedDump, scales: np.ndarray, backward: np.ndarray) -> np.ndarray:
    """Per row the scale of the gradient entering its module call, for the backward records (0 elsewhere): the
    largest scale among the output backward records of the same shape of the modules around it (its module's own
    for an op record), same rank and step: a gradient that cancels to almost nothing in exact arithmetic (an
    attention's scores under tiny weights) rounds on the scale of the terms it is computed from."""
    floors = np.zeros(len(loaded))
    rows = np.flatnonzero(backward)
    if not len(rows):
        return floors
    taken = pa.array(rows, pa.int64())
    part = loaded.table.select(["module", "kind", "shape"]).take(taken)
    modules, kinds = part.column("module").to_pylist(), part.column("kind").to_pylist()
    shapes = [None if shape is None else tuple(shape) for shape in part.column("shape").to_pylist()]
    ranks, steps = loaded.rank[rows].tolist(), loaded.step[rows].tolist()
    entering: dict[tuple, float] = {}
    for at, rank, step, module, kind, shape in zip(rows.tolist(), ranks, steps, modules, kinds, shapes):
        if kind == "output" and module is not None:
            key = (rank, step, module, shape)
            entering[key] = max(entering.get(key, 0.0), float(scales[at]))
    for at, rank, step, module, kind, shape in zip(rows.tolist(), ranks, steps, modules, kinds, shapes):
        if module is None or kind not in ("output", "input", "op"):
            continue
        around = _around(module, own=kind == "op")
        floors[at] = max((entering.get((rank, step, outer, shape), 0.0) for outer in around), default=0.0)
    return floors


def _around(module: str, own: bool) -> list[str]:
    """The modules around ``module`` (the root's records name it ``<root>``), and ``module`` itself with ``own``."""
    found = [module] if own else []
    if module == ROOT_NAME:
        return found
    parts = module.split(".")
    return found + [".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1)] + [ROOT_NAME]


def _precisions(dtypes: list[str | None], codes: np.ndarray, groups: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(precision names, per row the index of its precision): a floating-point record is compared at the least
    precise of its own dtype and every floating-point dtype of its group (its rank and step: a float32 tensor
    computed from bfloat16 ones carries their rounding); an integer or bool one exactly.

    ``dtypes``: the distinct dtype names; ``codes``: per row the index of its dtype in them; ``groups``: per
    row its group, 0 to n - 1."""
    names = [EXACT.name, *sorted(PRECISIONS, key=lambda name: coarseness(PRECISIONS[name]))]
    level = np.array([names.index(precision_of(dtype).name) for dtype in dtypes] or [0], np.int64)[codes]
    coarsest = np.zeros(int(groups.max(initial=-1)) + 1, np.int64)
    np.maximum.at(coarsest, groups, level)
    return names, np.where(level == 0, 0, np.maximum(level, coarsest[groups]))


def rms(numel: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """A tensor's root mean square from its statistics (float64 arrays): sqrt(mean^2 + std^2 (numel - 1) / numel),
    without overflow; a mean or std that is no finite number counts as 0, a numel that is none as 1."""
    count = np.where(np.isfinite(numel) & (numel > 0), numel, 1.0)
    mean, std = (np.where(np.isfinite(values), values, 0.0) for values in (mean, std))
    return np.hypot(mean, std * np.sqrt((count - 1) / count))


def _scale_floors(scales: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Per row the largest of ``scales`` in its group (``groups``: 0 to n - 1; -1: a group of its own)."""
    grouped = groups >= 0
    largest = np.zeros(int(groups.max(initial=-1)) + 1)
    np.maximum.at(largest, groups[grouped], scales[grouped])
    return np.where(grouped, largest[np.maximum(groups, 0)] if len(largest) else 0.0, scales)


def _groups(columns: list[np.ndarray]) -> np.ndarray:
    """Per row the number of its distinct combination of these integer columns (0 to n - 1)."""
    key = one_key(columns)
    if key is None:
        return np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)[1].reshape(-1)
    return np.unique(key, return_inverse=True)[1].reshape(-1)


def _rows_per_file(table: pa.Table, files: list[StepFile]) -> np.ndarray:
    """How many rows of ``table`` (the files' rows, in order) each file gave."""
    if len(files) <= 1:
        return np.array([table.num_rows] * len(files), dtype=np.int64)
    ranks, steps = _ints(table, "rank"), _ints(table, "step")
    starts = np.flatnonzero(np.concatenate([[True], (ranks[1:] != ranks[:-1]) | (steps[1:] != steps[:-1])]))
    found = dict(zip(zip(ranks[starts].tolist(), steps[starts].tolist()),
                     np.diff(np.append(starts, table.num_rows)).tolist()))
    return np.array([found.get((f.rank, f.step), 0) for f in files], dtype=np.int64)


def _check_keys(loaded: LoadedDump) -> None:
    """The key fields have the types matching and ordering rely on (the dump reader checks they exist)."""
    table = loaded.table
    for column, problem in (("phase", "has no 'phase' string"), ("name", "")):
        missing = pc.is_null(table.column(column)).to_numpy(zero_copy_only=False)
        if missing.any():
            row = int(np.argmax(missing))
            (record,) = loaded.records_at([row])
            path, line = loaded.where(row)
            text = (f"record {record.get('name')!r} {problem}" if column == "phase"
                    else f"the record's 'name' is not a string: {record.get('name')!r}")
            raise DumpFormatError(path, line, text)


def _fill_seq(loaded: LoadedDump) -> None:
    seq = loaded.table.column("seq")
    if seq.null_count:  # a record without "seq": its line in the file stands for it
        filled = pc.coalesce(seq, pa.array(loaded.line_of - 1, pa.int64()))
        loaded.table = loaded.table.set_column(loaded.table.schema.get_field_index("seq"), "seq", filled)


def _steps_by_rank(loaded: LoadedDump, files: list[StepFile], keep: np.ndarray) -> dict[int, list[int]]:
    """Rank -> the finished steps read; a step whose records were all filtered out is still a step."""
    ranks, found = loaded.rank[keep], loaded.step[keep]
    if len(ranks) and found.min() >= 0 and ranks.min() >= 0 and found.max() < (1 << 32):
        packed = np.unique((ranks << 32) | found)  # one sort of one int64 column
        pairs = zip((packed >> 32).tolist(), (packed & 0xFFFFFFFF).tolist())
    else:
        pairs = set(zip(ranks.tolist(), found.tolist()))
    return rank_steps([*pairs, *((f.rank, f.step) for f in files if f.rank is not None)])


def rank_steps(pairs: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    """(rank, step) pairs as rank -> its steps, both in order."""
    steps: dict[int, set[int]] = {}
    for rank, step in pairs:
        steps.setdefault(rank, set()).add(step)
    return {rank: sorted(found) for rank, found in sorted(steps.items())}


def _rename(loaded: LoadedDump, name_map: NameMap) -> None:
    codes, unique = loaded.codes("name")
    originals = unique.to_pylist()
    mapped = [name_map.apply(name) for name in originals]
    changed = np.array([new != old for new, old in zip(mapped, originals)], dtype=bool)
    if not changed.any():
        return
    loaded.renamed.update({old: new for old, new, differs in zip(originals, mapped, changed) if differs})
    table = loaded.table
    renamed_from = pc.if_else(pa.array(changed[codes]), table.column("name"), pa.scalar(None, pa.string()))
    table = table.set_column(table.schema.get_field_index("name"), "name",
                             pa.array(mapped, pa.string()).take(pa.array(codes)))
    loaded.table = table.set_column(table.schema.get_field_index("renamed_from"), "renamed_from", renamed_from)


def _keep(loaded: LoadedDump, keep: np.ndarray) -> None:
    rows = np.flatnonzero(keep)
    loaded.table = loaded.table.take(rows)
    loaded.file_of, loaded.line_of = loaded.file_of[rows], loaded.line_of[rows]
    for cached in ("rank", "step", "seq", "order"):
        loaded.__dict__.pop(cached, None)


def _check_unique(loaded: LoadedDump, name_map: NameMap | None) -> None:
    """No two records share (rank, step, phase, name); the first repeat in file order is the error."""
    if len(loaded) < 2:
        return
    columns = [loaded.rank, loaded.step, loaded.codes("phase")[0], loaded.codes("name")[0]]
    key = one_key(columns)
    if key is not None:  # the common case, no repeat, told by one sort of one column
        key.sort()
        if not (key[1:] == key[:-1]).any():
            return
    group = _groups(columns)
    first_of = np.unique(group, return_index=True)[1]  # the first row of each key
    repeats = np.flatnonzero(first_of[group] != np.arange(len(loaded)))
    if not len(repeats):
        return
    row = int(repeats[0])  # the earliest row that repeats a key
    first = int(first_of[group[row]])
    rank, step, phase, name = loaded.key(row)
    originals = loaded.table.column("renamed_from").take(pa.array([first, row])).to_pylist()
    if name_map is not None and any(original is not None for original in originals):
        first_name, second_name = (original or name for original in originals)
        raise NameMapError(f"{name_map.source}: maps {first_name!r} and {second_name!r} of {loaded.path} both to "
                           f"{name!r} (rank {rank} step {step} {phase}); make the patterns tell them apart")
    path, line = loaded.where(row)
    raise DumpFormatError(path, line, f"duplicate record: rank {rank} step {step} {phase} {name!r} appears twice")
