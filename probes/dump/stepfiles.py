"""The step files a writer thread has open: records appended, a step finished durably, all synced or closed.

    steps = OpenSteps(layout, rank=0)              # format="parquet" (default) or "jsonl"
    steps.append(3, record)      # parquet: kept in memory; jsonl: a line of rank_0/step_000003.jsonl.partial
    steps.finish(3)              # write step_000003.order.txt and the step file, fsync'ed, renamed into place
    steps.sync(durable=False)    # what was appended reaches the .partial files (durable: and the disk)
    steps.close()                # what is still open stays .partial

In the Parquet format the ``.jsonl.partial`` file is a journal: records go there only when synced (a
flush, a reader in this process, the end of the writer), so an unfinished step stays readable as in
the JSON Lines format, and a step finished without a sync never writes a line of JSON.

Only the writer thread uses an OpenSteps. A failure is a StepFileError naming the file and what was
being done; the writer turns it into its DumpWriteError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import pyarrow as pa

from .columns import records_to_table, write_parquet
from .layout import STEP_FORMATS, DumpLayout, fsync_dir, write_durably
from .rowblock import RowBlock

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
    partial: Path
    file: BinaryIO | None = None  # the .partial file, once opened
    order: list[tuple[Any, str]] = field(default_factory=list)  # (seq, order.txt line), in write order
    records: list[Mapping[str, Any] | RowBlock] = field(default_factory=list)  # parquet: the step's records, in order
    journaled: int = 0  # parquet: how many of ``records`` are in the .partial file


def _open_step_file(path: Path) -> BinaryIO:
    # Exclusive create: a step file is never appended to or overwritten. Tests replace this to inject faults.
    return open(path, "xb", buffering=_BUFFER_SIZE)


class OpenSteps:
    """The open ``.partial`` files of one rank, by step."""

    def __init__(self, layout: DumpLayout, *, rank: int, format: str = "parquet") -> None:
        if format not in STEP_FORMATS:
            raise ValueError(f"unknown dump format {format!r}; expected one of {', '.join(STEP_FORMATS)}")
        self.layout = layout
        self.rank = rank
        self.format = format
        self._open: dict[int, _OpenStep] = {}

    def steps(self) -> list[int]:
        """The steps that have an open file."""
        return list(self._open)

    def append(self, step: int, record: Mapping[str, Any] | RowBlock) -> None:
        """One record, or a block of them (``RowBlock``: turned into columns here, on the writer thread)."""
        entry = self._open.get(step)
        if entry is None:
            entry = self._open[step] = _OpenStep(self.layout.step_file(self.rank, step, partial=True))
        if self.format == "parquet":
            entry.records.append(record)
        else:
            self._journal(entry, [record])
        if isinstance(record, RowBlock):
            entry.order.extend((seq, _order_line(name, phase)) for seq, name, phase in record.order())
        else:
            entry.order.append((record.get("seq"), _order_line(record["name"], record.get("phase"))))

    def _journal(self, entry: _OpenStep, records: Sequence[Mapping[str, Any] | RowBlock]) -> None:
        """Appends ``records`` to the step's .partial file as JSON lines (opened on the first)."""
        lines = []
        for record in _expanded(records):
            try:
                lines.append(json.dumps(record).encode("ascii") + b"\n")
            except (TypeError, ValueError) as error:
                action = f"could not write record {record.get('name')!r} (not JSON-serialisable) to"
                raise StepFileError(error, entry.partial, action) from error
        try:
            if entry.file is None:
                entry.file = _open_step_file(entry.partial)
            entry.file.write(b"".join(lines))
        except OSError as error:
            raise StepFileError(error, entry.partial, "could not write") from error

    def finish(self, step: int) -> bool:
        """Makes ``step`` a finished step; False when it has no file (no records), so nothing was done."""
        entry = self._open.pop(step, None)
        if entry is None:
            return False
        path = entry.partial
        try:
            if entry.file is not None:
                entry.file.flush()
                if self.format == "jsonl":  # a Parquet step's journal is removed below: no need to keep it
                    os.fsync(entry.file.fileno())
                entry.file.close()
            path = self.layout.order_file(self.rank, step)
            write_durably(path, "".join(line + "\n" for line in _execution_order(entry.order)).encode("utf-8"))
            if self.format == "parquet":
                path = self.layout.temporary_file(self.rank, step)
                _write_step_table(path, entry, step=step, rank=self.rank)
                os.replace(path, self.layout.step_file(self.rank, step))
                if entry.file is not None:
                    entry.partial.unlink()
            else:
                path = entry.partial
                os.replace(entry.partial, self.layout.step_file(self.rank, step, format="jsonl"))
            fsync_dir(self.layout.rank_dir(self.rank))
        except OSError as error:
            _close_quietly(entry)
            raise StepFileError(error, path, "could not finish step") from error
        except StepFileError:
            _close_quietly(entry)
            raise
        return True

    def remove_finished(self, step: int) -> None:
        """Removes a finished step (the ring buffer): the step file first, so no reader sees it without order."""
        for path in (self.layout.step_file(self.rank, step, format=self.format),
                     self.layout.order_file(self.rank, step)):
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                raise StepFileError(error, path, "could not remove an old step of the ring buffer") from error

    def sync(self, *, durable: bool = True) -> None:
        for entry in self._open.values():
            if entry.journaled < len(entry.records):
                self._journal(entry, entry.records[entry.journaled:])
                entry.journaled = len(entry.records)
            if entry.file is None:
                continue
            try:
                entry.file.flush()
                if durable:
                    os.fsync(entry.file.fileno())
            except OSError as error:
                raise StepFileError(error, entry.partial, "could not flush") from error

    def close(self) -> None:
        """Closes every open file (they stay ``.partial``); errors closing them are of no use to anyone."""
        for entry in self._open.values():
            _close_quietly(entry)
        self._open.clear()


def _order_line(name: Any, phase: Any) -> str:
    name = str(name)
    line = f"{name}_{phase}" if phase else name
    return line.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _execution_order(order: list[tuple[Any, str]]) -> list[str]:
    # "seq" is the execution order; write order can differ when records are produced late.
    if order and all(isinstance(seq, int) and not isinstance(seq, bool) for seq, _ in order):
        return [line for _, line in sorted(order, key=lambda item: item[0])]  # stable: ties keep write order
    return [line for _, line in order]


def _expanded(records: Sequence[Mapping[str, Any] | RowBlock]) -> list[Mapping[str, Any]]:
    """The records, with blocks as their dicts."""
    out: list[Mapping[str, Any]] = []
    for record in records:
        if isinstance(record, RowBlock):
            out.extend(record.records())
        else:
            out.append(record)
    return out


def _step_table(records: list[Mapping[str, Any] | RowBlock], *, step: int, rank: int) -> pa.Table:
    """One table of the step's records in order: runs of dicts through ``records_to_table``, blocks as built."""
    tables: list[pa.Table] = []
    run: list[Mapping[str, Any]] = []
    for record in records:
        if isinstance(record, RowBlock):
            if run:
                tables.append(records_to_table(run, step=step, rank=rank))
                run = []
            tables.append(record.to_table())
        else:
            run.append(record)
    if run or not tables:
        tables.append(records_to_table(run, step=step, rank=rank))
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _write_step_table(path: Path, entry: _OpenStep, *, step: int, rank: int) -> None:
    try:
        table = _step_table(entry.records, step=step, rank=rank)
    except (TypeError, ValueError, pa.ArrowException) as error:
        names = ", ".join(repr(record.get("name")) for record in _expanded(entry.records[:3])[:3])
        raise StepFileError(error, path, f"could not convert the records ({names}, ...) of the step to a table "
                                         "(a value that is not JSON-serialisable?) for") from error
    write_parquet(path, table)


def _close_quietly(entry: _OpenStep) -> None:
    if entry.file is None:
        return
    try:
        entry.file.close()
    except OSError:
        pass
