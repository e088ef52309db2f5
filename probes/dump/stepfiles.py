"""The step files a writer thread has open: record batches appended, a step finished durably, all synced or closed.

    steps = OpenSteps(layout, rank=0)              # format="parquet" (default) or "jsonl"
    steps.append(3, batch)       # a RowBlock or an Arrow table; parquet: kept in memory as Arrow
    steps.finish(3)              # the step file written, fsync'ed, renamed into place
    steps.sync(durable=False)    # what was appended reaches the journal (durable: and the disk)
    steps.close()                # what is still open stays unfinished

Parquet format: a step's records stay Arrow tables in memory until ``finish`` writes them as one Parquet
file, their count in its footer. A sync (a flush, a reader in this process, the end of the writer) journals
the records appended since the last one as one more Parquet part, ``step_<N>.parquet.partial/part_<K>.parquet``
(written under a temporary name and renamed: a part is whole or absent), so an unfinished or crashed step
stays readable; ``finish`` removes the journal. A step finished without a sync writes no journal.

JSON Lines format: each batch becomes lines of ``step_<N>.jsonl.partial`` at once, renamed at ``finish``,
beside ``step_<N>.order.txt`` (the record count a cut at a line boundary is checked against).

Only the writer thread uses an OpenSteps. A failure is a StepFileError naming the file and what was
being done; the writer turns it into its DumpWriteError.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from .columns import table_to_records, write_parquet
from .layout import STEP_FORMATS, DumpLayout, fsync_dir, write_durably
from .rowblock import EntryColumns, RowBlock

_BUFFER_SIZE = 1 << 16


class StepFileError(Exception):
    """``cause`` (an OSError, or why a record is not JSON) hit while ``action`` on ``path``."""

    def __init__(self, cause: BaseException, path: Path, action: str) -> None:
        super().__init__(f"{action} {path}: {cause}")
        self.cause = cause
        self.path = path
        self.action = action


@dataclass
class _OpenStep:
    partial: Path  # parquet: the journal directory; jsonl: the .jsonl.partial file
    tables: list[pa.Table] = field(default_factory=list)  # parquet: the step's records, in order
    journaled: int = 0  # parquet: how many of ``tables`` are in the journal
    file: BinaryIO | None = None  # jsonl: the .partial file, once opened
    order: list[tuple[object, str]] = field(default_factory=list)  # jsonl: (seq, order.txt line), in write order


def _open_step_file(path: Path) -> BinaryIO:
    # Exclusive create: a step file is never appended to or overwritten. Tests replace this to inject faults.
    return open(path, "xb", buffering=_BUFFER_SIZE)


class OpenSteps:
    """The open steps of one rank, by step."""

    def __init__(self, layout: DumpLayout, *, rank: int, format: str = "parquet") -> None:
        if format not in STEP_FORMATS:
            raise ValueError(f"unknown dump format {format!r}; expected one of {', '.join(STEP_FORMATS)}")
        self.layout = layout
        self.rank = rank
        self.format = format
        self._open: dict[int, _OpenStep] = {}
        self._reuse = EntryColumns()  # a step's columns of names and descriptions, taken again by the next

    def steps(self) -> list[int]:
        """The steps that are open."""
        return list(self._open)

    def append(self, step: int, batch: RowBlock | pa.Table) -> None:
        """Records of ``step``: a RowBlock (turned into an Arrow table here, on the writer thread) or a table."""
        entry = self._open.get(step)
        if entry is None:
            entry = self._open[step] = _OpenStep(
                self.layout.step_file(self.rank, step, partial=True, format=self.format))
        table = batch.to_table(self._reuse) if isinstance(batch, RowBlock) else batch
        if self.format == "parquet":
            entry.tables.append(table)
        else:
            self._write_lines(entry, table)

    def _write_lines(self, entry: _OpenStep, table: pa.Table) -> None:
        """Appends the records of ``table`` to the step's .jsonl.partial file (opened on the first)."""
        lines = []
        for record in table_to_records(table):
            lines.append(json.dumps(record).encode("ascii") + b"\n")
            entry.order.append((record.get("seq"), _order_line(record["name"], record.get("phase"))))
        try:
            if entry.file is None:
                entry.file = _open_step_file(entry.partial)
            entry.file.write(b"".join(lines))
        except OSError as error:
            raise StepFileError(error, entry.partial, "could not write") from error

    def finish(self, step: int) -> bool:
        """Makes ``step`` a finished step; False when it has no records, so nothing was done."""
        entry = self._open.pop(step, None)
        if entry is None:
            return False
        path = entry.partial
        try:
            if self.format == "parquet":
                path = self.layout.temporary_file(self.rank, step)
                write_parquet(path, _concat(entry.tables))
                os.replace(path, self.layout.step_file(self.rank, step))
                if entry.journaled:
                    path = entry.partial
                    shutil.rmtree(entry.partial)
            else:
                if entry.file is not None:
                    entry.file.flush()
                    os.fsync(entry.file.fileno())
                    entry.file.close()
                path = self.layout.order_file(self.rank, step)
                write_durably(path, "".join(line + "\n" for line in _execution_order(entry.order)).encode("utf-8"))
                path = entry.partial
                os.replace(entry.partial, self.layout.step_file(self.rank, step, format="jsonl"))
            fsync_dir(self.layout.rank_dir(self.rank))
        except OSError as error:
            _close_quietly(entry)
            raise StepFileError(error, path, "could not finish step") from error
        return True

    def remove_finished(self, step: int) -> None:
        """Removes a finished step (the ring buffer): the step file first, so no reader sees it without order."""
        paths = [self.layout.step_file(self.rank, step, format=self.format)]
        if self.format == "jsonl":
            paths.append(self.layout.order_file(self.rank, step))
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                raise StepFileError(error, path, "could not remove an old step of the ring buffer") from error

    def sync(self, *, durable: bool = True) -> None:
        """What was appended reaches the journal (parquet) or the .partial file (jsonl); ``durable``: fsync'ed."""
        for step, entry in self._open.items():
            if entry.journaled < len(entry.tables):
                self._journal(step, entry, durable=durable)
            if entry.file is None:
                continue
            try:
                entry.file.flush()
                if durable:
                    os.fsync(entry.file.fileno())
            except OSError as error:
                raise StepFileError(error, entry.partial, "could not flush") from error

    def _journal(self, step: int, entry: _OpenStep, *, durable: bool) -> None:
        """The tables appended since the last sync as the journal's next Parquet part."""
        journal = entry.partial
        path = journal / f"part_{entry.journaled:06d}.parquet"
        temporary = path.with_name(path.name + ".tmp")
        try:
            journal.mkdir(exist_ok=True)
            write_parquet(temporary, _concat(entry.tables[entry.journaled:]), durable=durable)
            os.replace(temporary, path)
            if durable:
                fsync_dir(journal)
        except OSError as error:
            raise StepFileError(error, path, f"could not journal step {step} to") from error
        entry.journaled = len(entry.tables)

    def close(self) -> None:
        """Closes every open file (unfinished steps stay as they are); errors closing them are of no use to anyone."""
        for entry in self._open.values():
            _close_quietly(entry)
        self._open.clear()


def _concat(tables: list[pa.Table]) -> pa.Table:
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _order_line(name: object, phase: object) -> str:
    name = str(name)
    line = f"{name}_{phase}" if phase else name
    return line.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _execution_order(order: list[tuple[object, str]]) -> list[str]:
    # "seq" is the execution order; write order can differ when records are produced late.
    if order and all(isinstance(seq, int) and not isinstance(seq, bool) for seq, _ in order):
        return [line for _, line in sorted(order, key=lambda item: item[0])]  # stable: ties keep write order
    return [line for _, line in order]


def _close_quietly(entry: _OpenStep) -> None:
    if entry.file is None:
        return
    try:
        entry.file.close()
    except OSError:
        pass
