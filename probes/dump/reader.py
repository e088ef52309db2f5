"""Reading a dump: its step files, its steps by rank, its records, each step checked complete.

    reader = DumpReader("pt_out")              # waits for this process's live writers into pt_out, once
    reader.steps()                             # {0: {"finished": [0, 1], "unfinished": [2]}}
    for step_file in reader.step_files():      # finished steps, sorted by (rank, step)
        records = reader.read(step_file)
    for step_file, records in reader.read_each(files, progress=True):   # the same, with a progress bar
    records = load_dump("pt_out")              # = DumpReader("pt_out").records()
    table = load_table("pt_out")               # the same rows as one Arrow table (DumpReader.table())

A path may be a dump directory (all its ranks), one ``rank_<r>`` directory, or one step file. The
directory is listed once, when the reader is opened; a reader opened again sees what changed since.
Unfinished (``.partial``) steps are left out unless asked for; a finished file supersedes a leftover
``.partial`` of the same step. Records come in file order, each with its ``rank`` and ``step`` (taken
from the directory and file names when a record lacks them, an error when it says otherwise).

Step files are Parquet (``step_<N>.parquet``; unfinished: the journal ``step_<N>.parquet.partial/``, its
parts in order) or JSON Lines (``step_<N>.jsonl``, ``.jsonl.partial``); both read as records and as tables. A
finished step must be whole: a Parquet file that does not open, or holds fewer records than its footer says
(``probes.records``), a last line without its newline is a cut, and a step file with fewer records than its
``order.txt`` lists (JSON Lines, and Parquet steps of dumps written before the footer count) lost some (a copy
cut at a line boundary). In a ``.jsonl.partial`` file the unterminated last line is the write a crash
interrupted: skipped. Every problem is a DumpFormatError naming the file and line.

Damage stays with its step: a step file that is damaged (cut, flipped bytes caught by the Parquet page
checksums, zero bytes, a directory or anything else in its place) fails only the reads that need it.
Reading several files reads them all and then raises one ``DamagedSteps`` naming every damaged file, or,
with ``skip_damaged=True``, leaves them out and lists them in ``reader.damaged``.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO, TypeVar, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pa_dataset
import pyarrow.parquet as pq

from ..utils.flags import option
from ..utils.progress import progress_meter

from .layout import (FORMAT_NAME, MANIFEST_NAME, READABLE_VERSIONS, RANK_DIR_RE, STEP_FILE_RE, DumpFormatError,
                     DumpLayout, read_manifest)
from .columns import (PARQUET_FORMAT, SCHEMA, NotAStepFile, footer_records, read_parquet, records_to_table,
                      table_to_records)
from .live import flush_writers
from .record import Record

_Read = TypeVar("_Read")

__all__ = ["DamagedSteps", "DumpArgument", "DumpReader", "StepFile", "list_steps", "load_dump", "load_table"]


@dataclass(frozen=True, kw_only=True)
class DumpArgument:
    """The dump a command reads, declared once (``probes.utils.flags``): the first argument of ``export_dump``,
    ``write_tensorboard`` and of their commands and ``probes show``, ``DUMP`` on the command line."""

    dump: str | Path = option(positional=True, metavar="DUMP",
                              help="a dump directory, one of its rank_<r> directories, or a step file")


@dataclass(frozen=True)
class StepFile:
    """One step file of a dump."""

    path: Path
    rank: int | None  # None: a lone step file outside a rank_<r> directory
    step: int
    finished: bool

    @property
    def columnar(self) -> bool:
        """A Parquet step file or journal (else JSON Lines)."""
        return self.path.name.endswith((".parquet", ".parquet.partial"))


class DamagedSteps(DumpFormatError):
    """Step files that cannot be read, each with its DumpFormatError; the message names them all, in one line."""

    def __init__(self, damaged: Sequence[tuple[StepFile, DumpFormatError]]) -> None:
        self.damaged = list(damaged)
        count = len(self.damaged)
        listed = "; ".join(str(error) for _, error in self.damaged)
        ValueError.__init__(self, f"{count} damaged step file{'s' if count > 1 else ''}: {listed}")
        first = self.damaged[0][1]  # path, line and problem: the first damaged file's, as its own error says
        self.path, self.line, self.problem = first.path, first.line, first.problem


class DumpReader:
    """A dump opened for reading: this process's live writers into it are waited for once, when opened
    (``wait=False``: not waited for).

    Raises FileNotFoundError for a missing path and DumpFormatError for one that is not a dump.
    """

    path: Path  # as given

    def __init__(self, path: str | Path, *, wait: bool = True) -> None:
        if wait:  # False only on a writer's own thread (``on_step_written``), which would wait for itself
            flush_writers(path)
        self._list(Path(path))
        self.damaged: list[tuple[StepFile, DumpFormatError]] = []  # what reads with skip_damaged left out

    def _list(self, path: Path) -> None:
        self.path = path
        self._ranks, self._files = _scan(path)
        self._lone = path.is_file() or _is_journal(path)

    def with_finished_steps(self, steps: frozenset[int] | set[int]) -> "DumpReader":
        """The same dump listed with only the finished files of ``steps`` (and every unfinished one), not listed
        again: what one window of a comparison reads."""
        narrowed = object.__new__(DumpReader)
        narrowed.path, narrowed._lone, narrowed._ranks = self.path, self._lone, list(self._ranks)
        narrowed._files = [item for item in self._files if not item.finished or item.step in steps]
        narrowed.damaged = []
        return narrowed

    def step_files(self, *, include_partial: bool = False) -> list[StepFile]:
        """The step files, sorted by (rank, step); a lone step file is returned finished or not."""
        return [item for item in self._files if item.finished or include_partial or self._lone]

    def steps(self) -> dict[int | None, dict[str, list[int]]]:
        """``{rank: {"finished": [steps], "unfinished": [steps]}}``, steps sorted."""
        result: dict[int | None, dict[str, list[int]]] = {rank: {"finished": [], "unfinished": []}
                                                          for rank in self._ranks}
        for item in self._files:
            result[item.rank]["finished" if item.finished else "unfinished"].append(item.step)
        return result

    def read(self, step_file: StepFile) -> list[Record]:
        """The records of one step file, checked (see the module docstring)."""
        if step_file.columnar:
            return table_to_records(self.read_table(step_file))  # read_table placed the rank and step
        lines = _read_bytes(step_file).split(b"\n")
        tail = lines.pop()  # what follows the last newline: b"" unless the last line was cut short
        records = [_parse_line(step_file, number, raw) for number, raw in enumerate(lines, 1)]
        if step_file.finished:
            if tail:
                raise DumpFormatError(step_file.path, len(lines) + 1,
                                      "truncated last line (no newline at the end of a finished step file)")
            _check_complete(step_file, len(records))
        return records

    def read_table(self, step_file: StepFile, columns: Sequence[str] | None = None) -> pa.Table:
        """The records of one step file as a table of ``probes.dump.columns.SCHEMA`` (``columns``: only these),
        with its rank and step filled in; checked like ``read``. JSON Lines files are converted."""
        _check_columns(columns)
        if not step_file.columnar:
            return _select(records_to_table(self.read(step_file)), columns)
        wanted = None if columns is None else list(dict.fromkeys([*columns, "step", "rank"]))
        if step_file.finished or not step_file.path.is_dir():
            _check_regular(step_file)
            table = _read_parquet_file(step_file.path, wanted)
            if step_file.finished:
                _check_complete(step_file, table.num_rows, footer_records(table.schema.metadata))
        else:  # the journal of an unfinished step: its whole parts, in order
            parts = [_read_parquet_file(part, wanted) for part in sorted(step_file.path.glob("part_*.parquet"))]
            table = pa.concat_tables(parts) if parts else _select(SCHEMA.empty_table(), wanted)
        return _select(_placed(step_file, table.replace_schema_metadata(None)), columns)

    def tables(self, files: Sequence[StepFile], *, columns: Sequence[str] | None = None,
               progress: bool | TextIO = False, label: str | None = None) -> Iterator[tuple[StepFile, pa.Table]]:
        """(step file, its table) for each of ``files`` in turn; ``progress``: a bar after a second. Damaged files
        are read past, then raised together (``DamagedSteps``) once the others are done."""
        return self._each(files, lambda step_file: self.read_table(step_file, columns), progress, label)

    def concat_tables(self, files: Sequence[StepFile], *, columns: Sequence[str] | None = None,
                      progress: bool | TextIO = False, skip_damaged: bool = False) -> pa.Table:
        """The tables of ``files`` as one (see ``read_table``), rows in file order.

        Finished Parquet files in rank directories are read in one go by Arrow's own threads, then checked
        (ranks and steps, the order files' counts) on whole columns; anything else, or any problem, is read
        file by file, which names the file and what is wrong. Damaged files: see the module docstring.
        """
        _check_columns(columns)
        if files and all(f.columnar and f.finished and f.rank is not None for f in files):
            try:
                return _read_at_once(files, columns)
            except (pa.ArrowException, OSError, DumpFormatError, _NotPlaced):
                pass  # read file by file below, which says which file is wrong and how
        parts = self._undamaged(files, lambda step_file: self.read_table(step_file, columns), progress,
                                skip_damaged)
        return pa.concat_tables(parts) if parts else _select(SCHEMA.empty_table(), columns)

    def _undamaged(self, files: Sequence[StepFile], read: Callable[[StepFile], _Read], progress: bool | TextIO,
                   skip_damaged: bool) -> list[_Read]:
        """What ``read`` gives for each of ``files``; every damaged one is read past, then raised together
        (``DamagedSteps``) or, with ``skip_damaged``, left out and added to ``self.damaged``."""
        found: list[_Read] = []
        damaged: list[tuple[StepFile, DumpFormatError]] = []
        for step_file, result in self._each(files, _catching(read), progress, None):
            if isinstance(result, DumpFormatError):
                damaged.append((step_file, result))
            else:
                found.append(result)
        if damaged and not skip_damaged:
            raise DamagedSteps(damaged)
        self.damaged += damaged
        return found

    def table(self, *, include_partial: bool = False, columns: Sequence[str] | None = None,
              skip_damaged: bool = False) -> pa.Table:
        """Every record as one table (see ``read_table``), rows sorted like ``records()``."""
        if self._lone and not self._files[0].finished and not include_partial:
            raise ValueError(f"{self.path} is an unfinished step; load it with include_partial=True")
        return self.concat_tables(self.step_files(include_partial=include_partial), columns=columns,
                                  skip_damaged=skip_damaged)

    def read_each(self, files: Sequence[StepFile], *, progress: bool | TextIO = False,
                  label: str | None = None) -> Iterator[tuple[StepFile, list[Record]]]:
        """(step file, its records) for each of ``files`` in turn; ``progress``: a bar after a second. Damaged
        files are read past, then raised together (``DamagedSteps``) once the others are done."""
        return self._each(files, self.read, progress, label)

    def _each(self, files: Sequence[StepFile], read: Callable[[StepFile], _Read], progress: bool | TextIO,
              label: str | None) -> Iterator[tuple[StepFile, _Read]]:
        meter = progress_meter(label or f"reading {self.path}", len(files), progress)
        damaged: list[tuple[StepFile, DumpFormatError]] = []
        try:
            for done, step_file in enumerate(files, 1):
                try:
                    found = read(step_file)
                except DumpFormatError as error:  # read past it: the error names every damaged file
                    damaged.append((step_file, error))
                else:
                    yield step_file, found
                if meter:
                    meter.update(done)
        finally:
            if meter:
                meter.close()
        if damaged:
            raise DamagedSteps(damaged)

    def records(self, *, include_partial: bool = False, files: Sequence[StepFile] | None = None,
                skip_damaged: bool = False) -> list[Record]:
        """Every record (of ``files``), sorted by (rank, step, line in the file); unfinished steps only with
        ``include_partial``. Damaged files: see the module docstring.

        For a lone unfinished step file without ``include_partial``: ValueError.
        """
        if self._lone and not self._files[0].finished and not include_partial:
            raise ValueError(f"{self.path} is an unfinished step; load it with include_partial=True "
                             "(show: --include-partial)")
        if files is None:
            files = self.step_files(include_partial=include_partial)
        return [record for part in self._undamaged(files, self.read, False, skip_damaged) for record in part]


def _read_parquet_file(path: Path, columns: list[str] | None) -> pa.Table:
    try:
        return read_parquet(path, columns)
    except (pa.ArrowException, OSError) as error:
        raise DumpFormatError(path, None, f"not a readable Parquet step file (truncated or damaged?): {error}") from None
    except NotAStepFile as error:
        raise DumpFormatError(path, None, f"not a probes step file: {error}") from None


def _catching(read: Callable[[StepFile], _Read]) -> Callable[[StepFile], _Read | DumpFormatError]:
    def caught(step_file: StepFile) -> _Read | DumpFormatError:
        try:
            return read(step_file)
        except DumpFormatError as error:
            return error
    return caught


def _check_regular(step_file: StepFile) -> None:
    """A step file is a regular file with bytes in it (a lone step file may be an empty unfinished one)."""
    path = step_file.path
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "a broken link" if path.is_symlink() and not path.exists() \
            else "not a regular file"
        raise DumpFormatError(path, None, f"damaged step file: {kind} in place of the step file")
    if step_file.finished and path.stat().st_size == 0:
        raise DumpFormatError(path, None, "damaged step file: empty (zero bytes)")


def _read_bytes(step_file: StepFile) -> bytes:
    _check_regular(step_file)
    try:
        return step_file.path.read_bytes()
    except OSError as error:
        raise DumpFormatError(step_file.path, None, f"cannot read the step file: {error.strerror or error}") from None


def load_dump(path: str | Path, *, include_partial: bool = False) -> list[Record]:
    """Reads the records of a dump directory (all ranks), a rank_<r> directory or a single step file.

    Records come sorted by (rank, step, line in the file); each has 'rank' and 'step'. Unfinished
    (.partial) steps are skipped unless ``include_partial``, which loads their complete lines.
    Live writers of this process into ``path`` are waited for first (``flush_writers``).
    Raises DumpFormatError naming the file and line for invalid or truncated data.
    """
    return DumpReader(path).records(include_partial=include_partial)


def load_table(path: str | Path, *, include_partial: bool = False,
               columns: Sequence[str] | None = None) -> pa.Table:
    """The records of a dump as one Arrow table: one row per record, a column per record key.

        table = load_table("pt_out")                       # pyarrow.Table, columns of probes.dump.columns.SCHEMA
        frame = load_table("pt_out").to_pandas()           # pandas, if installed
        means = load_table("pt_out", columns=["step", "name", "phase", "mean"])

    The columnar view of ``load_dump`` (same rows, same order; dumps in JSON Lines are converted). An
    integer ``min``/``max``/``samples`` is also in ``min_int``/``max_int``/``samples_int``; a key written
    as None is listed in ``nulls``; keys without a column are in ``extra`` (JSON).
    """
    return DumpReader(path).table(include_partial=include_partial, columns=columns)


def list_steps(path: str | Path) -> dict[int | None, dict[str, list[int]]]:
    """``{rank: {"finished": [steps], "unfinished": [steps]}}`` for the dump at ``path``, steps sorted.

    Live writers of this process into ``path`` are waited for first (``flush_writers``).
    """
    return DumpReader(path).steps()


def _scan(path: Path) -> tuple[list[int | None], list[StepFile]]:
    """The ranks and step files under ``path`` (a dump dir, a rank dir or one step file), sorted."""
    if not os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, f"no probes dump at {path}", str(path))
    if path.is_file():
        match = STEP_FILE_RE.fullmatch(path.name)
        if match is None:
            expected = "expected step_<NNNNNN>.parquet, step_<NNNNNN>.jsonl or step_<NNNNNN>.jsonl.partial"
            raise DumpFormatError(path, None, f"not a step file ({expected})")
        return _lone(path, match)
    if _is_journal(path):
        return _lone(path, cast(re.Match[str], STEP_FILE_RE.fullmatch(path.name)))
    if os.path.lexists(path / MANIFEST_NAME):
        _check_manifest(path)
        rank_dirs = [
            (int(match[1]), child)
            for child in path.iterdir()
            if (match := RANK_DIR_RE.fullmatch(child.name)) and child.is_dir()
        ]
    elif match := RANK_DIR_RE.fullmatch(path.name):
        rank_dirs = [(int(match[1]), path)]
    else:
        raise DumpFormatError(path, None, f"not a probes dump: no {MANIFEST_NAME} and not a rank_<r> directory")
    rank_dirs.sort(key=lambda item: item[0])
    files: list[StepFile] = []
    for rank, directory in rank_dirs:
        found: dict[tuple[int, bool], Path] = {}
        for child in directory.iterdir():
            match = STEP_FILE_RE.fullmatch(child.name)
            if match and f"{int(match[1]):06d}" == match[1]:  # a directory in its place too: damaged, never skipped
                key = (int(match[1]), not match[3])
                if key in found and key[1]:
                    raise DumpFormatError(child, None, f"step {key[0]} of rank {rank} is finished twice "
                                                       f"({found[key].name} and {child.name}); remove one")
                found[key] = child
        for (step, finished), file_path in sorted(found.items()):
            if not finished and (step, True) in found:
                continue  # a finished file supersedes a leftover partial of the same step
            files.append(StepFile(file_path, rank, step, finished))
    return [rank for rank, _ in rank_dirs], files


def _is_journal(path: Path) -> bool:
    """Whether ``path`` is the journal of an unfinished Parquet step (a directory of parts)."""
    match = STEP_FILE_RE.fullmatch(path.name)
    return bool(match and match[2] == "parquet" and match[3]) and path.is_dir()


def _lone(path: Path, match: re.Match[str]) -> tuple[list[int | None], list[StepFile]]:
    """A lone step file (or journal) read on its own."""
    rank_match = RANK_DIR_RE.fullmatch(path.parent.name)
    rank = int(rank_match[1]) if rank_match else None
    return [rank], [StepFile(path, rank, int(match[1]), not match[3])]


def _check_manifest(root: Path) -> None:
    manifest = read_manifest(root)
    if manifest is None:
        raise DumpFormatError(root / MANIFEST_NAME, None,
                              f"not a probes dump manifest (expected format {FORMAT_NAME!r})")
    if manifest.get("version") not in READABLE_VERSIONS:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise DumpFormatError(root / MANIFEST_NAME, None, f"format version {manifest.get('version')!r}; this reader "
                                                          f"reads versions {readable} (a newer probes wrote it?)")


def _parse_line(step_file: StepFile, number: int, raw: bytes) -> Record:
    path = step_file.path
    if not raw.strip():
        raise DumpFormatError(path, number, "empty line")
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise DumpFormatError(path, number, f"not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise DumpFormatError(path, number, f"invalid JSON: {error.msg} at column {error.colno}") from None
    if not isinstance(record, dict):
        raise DumpFormatError(path, number, f"expected a JSON object, found {type(record).__name__}")
    if "name" not in record:
        raise DumpFormatError(path, number, "missing key 'name'")
    return _place(step_file, number, cast(Record, record))


def _place(step_file: StepFile, number: int, record: Record) -> Record:
    """Gives ``record`` the rank and step of its file, or raises when it says others."""
    path = step_file.path
    for key, expected in (("step", step_file.step), ("rank", step_file.rank)):
        if expected is None:
            if key not in record:
                problem = f"missing key {key!r} (and the file is not inside a rank_<r> directory)"
                raise DumpFormatError(path, number, problem)
        elif key not in record:
            record[key] = expected
        elif record[key] != expected:
            problem = f"the record says {key} {record[key]!r} but the file belongs to {key} {expected}"
            raise DumpFormatError(path, number, problem)
    return record


def _placed(step_file: StepFile, table: pa.Table) -> pa.Table:
    """``_place`` for a whole table: null ranks and steps filled in, others raise (naming the row)."""
    for key, expected in (("step", step_file.step), ("rank", step_file.rank)):
        column = table.column(key)
        if expected is None:
            if column.null_count:
                problem = f"missing {key} (and the file is not inside a rank_<r> directory)"
                raise DumpFormatError(step_file.path, None, problem)
            continue
        if column.null_count:
            column = pc.fill_null(column, expected)
            table = table.set_column(table.schema.get_field_index(key), key, column)
        wrong = pc.not_equal(column, expected)
        if pc.any(wrong).as_py():
            row = pc.index(wrong, True).as_py()
            problem = f"row {row + 1} says {key} {column[row].as_py()!r} but the file belongs to {key} {expected}"
            raise DumpFormatError(step_file.path, None, problem)
    return table


def _check_columns(columns: Sequence[str] | None) -> None:
    unknown = [name for name in columns or () if name not in SCHEMA.names]
    if unknown:
        raise ValueError(f"no column {', '.join(map(repr, unknown))} in a probes dump; the columns are "
                         f"{', '.join(SCHEMA.names)}")


def _select(table: pa.Table, columns: Sequence[str] | None) -> pa.Table:
    return table if columns is None else table.select(list(columns))


class _NotPlaced(Exception):
    """What ``_read_at_once`` cannot vouch for: the file-by-file read says what is wrong."""


def _read_at_once(files: Sequence[StepFile], columns: Sequence[str] | None) -> pa.Table:
    wanted = list(dict.fromkeys([*(columns if columns is not None else SCHEMA.names), "step", "rank"]))
    dataset = pa_dataset.dataset([str(f.path) for f in files], format=PARQUET_FORMAT,
                                 schema=pa.schema([SCHEMA.field(name) for name in wanted]))
    footers = [fragment.metadata for fragment in dataset.get_fragments()]
    counts = np.array([footer.num_rows for footer in footers], np.int64)
    for step_file, count, footer in zip(files, counts.tolist(), footers):
        _check_complete(step_file, count, footer_records(footer.metadata))
    table = dataset.to_table(columns=wanted)
    if table.num_rows != int(counts.sum()):
        raise _NotPlaced()
    for key in ("step", "rank"):
        expected = np.repeat(np.array([getattr(f, key) for f in files], np.int64), counts)
        column = table.column(key)
        if column.null_count:
            column = pc.fill_null(column, pa.array(expected))
            table = table.set_column(table.schema.get_field_index(key), key, column)
        if not np.array_equal(column.to_numpy(), expected):
            raise _NotPlaced()  # a record that says another step or rank, or rows out of file order
    return _select(table, columns)


def listed_records(step_file: StepFile) -> int | None:
    """How many records a finished step holds by its writer's word: the count in its footer (Parquet), else in
    its order file (JSON Lines, and dumps written before the footer count); None: neither says."""
    if step_file.columnar and step_file.finished:
        try:
            listed = footer_records(pq.read_metadata(step_file.path).metadata)
        except (pa.ArrowException, OSError):
            listed = None
        if listed is not None:
            return listed
    return _order_file_count(step_file)[0]


def _order_file_count(step_file: StepFile) -> tuple[int | None, str]:
    """(records listed, the order file's name); None when there is no order file (a lone step file has none)."""
    if step_file.rank is None:
        return None, ""
    order_file = DumpLayout(step_file.path.parent.parent).order_file(step_file.rank, step_file.step)
    try:
        return order_file.read_bytes().count(b"\n"), order_file.name
    except OSError:
        return None, order_file.name


def _check_complete(step_file: StepFile, count: int, listed: int | None = None) -> None:
    """A finished step holds every record its writer listed (``listed``: its footer's count, else its order
    file's), so a step file that lost whole records (a copy cut at a line boundary, rewritten short) is caught
    too, not only one cut inside a line."""
    where = "its footer"
    if listed is None:
        listed, where = _order_file_count(step_file)
    if listed is not None and count < listed:
        raise DumpFormatError(step_file.path, count + 1,
                              f"truncated: {where} lists {listed} records, the step file has {count}")


# A reader that does not wait for live writers: only for the test that shows the race the wait prevents.
def _unflushed(path: str | Path) -> DumpReader:
    reader = DumpReader.__new__(DumpReader)
    reader._list(Path(path))
    return reader


def _list_steps(path: Path) -> dict[int | None, dict[str, list[int]]]:
    return _unflushed(path).steps()
