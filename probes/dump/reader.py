"""Reading a dump: its step files, its steps by rank, its records, each step checked complete.

    reader = DumpReader("pt_out")              # waits for this process's live writers into pt_out, once
    reader.steps()                             # {0: {"finished": [0, 1], "unfinished": [2]}}
    for step_file in reader.step_files():      # finished steps, sorted by (rank, step)
        records = reader.read(step_file)
    for step_file, records in reader.read_each(files, progress=True):   # the same, with a progress bar
    records = load_dump("pt_out")              # = DumpReader("pt_out").records()

A path may be a dump directory (all its ranks), one ``rank_<r>`` directory, or one step file. The
directory is listed once, when the reader is opened; a reader opened again sees what changed since.
Unfinished (``.partial``) steps are left out unless asked for; a finished file supersedes a leftover
``.partial`` of the same step. Records come in file order, each with its ``rank`` and ``step`` (taken
from the directory and file names when a record lacks them, an error when it says otherwise).

A finished step must be whole: a last line without its newline is a cut, and a step file with fewer
lines than its ``order.txt`` lists lost whole lines (a copy cut at a line boundary). In a ``.partial``
file the unterminated last line is the write a crash interrupted: skipped. Every problem is a
DumpFormatError naming the file and line.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, cast

from ..utils.progress import progress_meter

from .layout import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, RANK_DIR_RE, STEP_FILE_RE, DumpFormatError,
                     DumpLayout, read_manifest)
from .live import flush_writers
from .record import Record

__all__ = ["DumpReader", "StepFile", "list_steps", "load_dump"]


@dataclass(frozen=True)
class StepFile:
    """One step file of a dump."""

    path: Path
    rank: int | None  # None: a lone step file outside a rank_<r> directory
    step: int
    finished: bool


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

    def _list(self, path: Path) -> None:
        self.path = path
        self._lone = path.is_file()
        self._ranks, self._files = _scan(path)

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
        lines = step_file.path.read_bytes().split(b"\n")
        tail = lines.pop()  # what follows the last newline: b"" unless the last line was cut short
        records = [_parse_line(step_file, number, raw) for number, raw in enumerate(lines, 1)]
        if step_file.finished:
            if tail:
                raise DumpFormatError(step_file.path, len(lines) + 1,
                                      "truncated last line (no newline at the end of a finished step file)")
            _check_complete(step_file, len(records))
        return records

    def read_each(self, files: Sequence[StepFile], *, progress: bool | TextIO = False,
                  label: str | None = None) -> Iterator[tuple[StepFile, list[Record]]]:
        """(step file, its records) for each of ``files`` in turn; ``progress``: a bar after a second."""
        meter = progress_meter(label or f"reading {self.path}", len(files), progress)
        try:
            for done, step_file in enumerate(files, 1):
                yield step_file, self.read(step_file)
                if meter:
                    meter.update(done)
        finally:
            if meter:
                meter.close()

    def records(self, *, include_partial: bool = False) -> list[Record]:
        """Every record, sorted by (rank, step, line in the file); unfinished steps only with ``include_partial``.

        For a lone unfinished step file without ``include_partial``: ValueError.
        """
        if self._lone and not self._files[0].finished and not include_partial:
            raise ValueError(f"{self.path} is an unfinished step; load it with include_partial=True "
                             "(show: --include-partial)")
        return [record for item in self.step_files(include_partial=include_partial) for record in self.read(item)]


def load_dump(path: str | Path, *, include_partial: bool = False) -> list[Record]:
    """Reads the records of a dump directory (all ranks), a rank_<r> directory or a single step file.

    Records come sorted by (rank, step, line in the file); each has 'rank' and 'step'. Unfinished
    (.partial) steps are skipped unless ``include_partial``, which loads their complete lines.
    Live writers of this process into ``path`` are waited for first (``flush_writers``).
    Raises DumpFormatError naming the file and line for invalid or truncated data.
    """
    return DumpReader(path).records(include_partial=include_partial)


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
            expected = "expected step_<NNNNNN>.jsonl or step_<NNNNNN>.jsonl.partial"
            raise DumpFormatError(path, None, f"not a step file ({expected})")
        rank_match = RANK_DIR_RE.fullmatch(path.parent.name)
        rank = int(rank_match[1]) if rank_match else None
        return [rank], [StepFile(path, rank, int(match[1]), match[2] is None)]
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
            if match and f"{int(match[1]):06d}" == match[1] and child.is_file():
                found[(int(match[1]), match[2] is None)] = child
        for (step, finished), file_path in sorted(found.items()):
            if not finished and (step, True) in found:
                continue  # a finished file supersedes a leftover partial of the same step
            files.append(StepFile(file_path, rank, step, finished))
    return [rank for rank, _ in rank_dirs], files


def _check_manifest(root: Path) -> None:
    manifest = read_manifest(root)
    if manifest is None:
        raise DumpFormatError(root / MANIFEST_NAME, None,
                              f"not a probes dump manifest (expected format {FORMAT_NAME!r})")
    if manifest.get("version") != FORMAT_VERSION:
        raise DumpFormatError(root / MANIFEST_NAME, None,
                              f"format version {manifest.get('version')!r}; this reader reads {FORMAT_VERSION}")


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
    return cast(Record, record)


def _check_complete(step_file: StepFile, count: int) -> None:
    # The writer lists every record of a finished step in its order file, so a step file that lost whole
    # lines (a copy cut at a line boundary) is caught too, not only one cut inside a line.
    if step_file.rank is None:
        return  # a lone step file has no rank directory, so no order file
    order_file = DumpLayout(step_file.path.parent.parent).order_file(step_file.rank, step_file.step)
    try:
        expected = order_file.read_bytes().count(b"\n")
    except FileNotFoundError:
        return
    if count < expected:
        raise DumpFormatError(step_file.path, count + 1,
                              f"truncated: {order_file.name} lists {expected} records, the step file has {count}")


# A reader that does not wait for live writers: only for the test that shows the race the wait prevents.
def _unflushed(path: str | Path) -> DumpReader:
    reader = DumpReader.__new__(DumpReader)
    reader._list(Path(path))
    return reader


def _list_steps(path: Path) -> dict[int | None, dict[str, list[int]]]:
    return _unflushed(path).steps()
