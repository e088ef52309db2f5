"""The step files a writer thread has open: lines appended, a step finished durably, all synced or closed.

    steps = OpenSteps(layout, rank=0)
    steps.append(3, record)      # opens rank_0/step_000003.jsonl.partial on the step's first record
    steps.finish(3)              # fsync, write step_000003.order.txt, rename to step_000003.jsonl
    steps.sync(durable=False)    # buffered lines reach the files (durable: and the disk)
    steps.close()                # what is still open stays .partial

Only the writer thread uses an OpenSteps. A failure is a StepFileError naming the file and what was
being done; the writer turns it into its DumpWriteError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .layout import DumpLayout, fsync_dir, write_durably

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
    file: BinaryIO
    order: list[tuple[Any, str]] = field(default_factory=list)  # (seq, order.txt line), in write order


def _open_step_file(path: Path) -> BinaryIO:
    # Exclusive create: a step file is never appended to or overwritten. Tests replace this to inject faults.
    return open(path, "xb", buffering=_BUFFER_SIZE)


class OpenSteps:
    """The open ``.partial`` files of one rank, by step."""

    def __init__(self, layout: DumpLayout, *, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        self._open: dict[int, _OpenStep] = {}

    def steps(self) -> list[int]:
        """The steps that have an open file."""
        return list(self._open)

    def append(self, step: int, record: Mapping[str, Any]) -> None:
        partial = self.layout.step_file(self.rank, step, partial=True)
        try:
            line = json.dumps(record).encode("ascii") + b"\n"
        except (TypeError, ValueError) as error:
            action = f"could not write record {record.get('name')!r} (not JSON-serialisable) to"
            raise StepFileError(error, partial, action) from error
        entry = self._open.get(step)
        try:
            if entry is None:
                entry = self._open[step] = _OpenStep(partial, _open_step_file(partial))
            entry.file.write(line)
        except OSError as error:
            raise StepFileError(error, partial, "could not write") from error
        entry.order.append((record.get("seq"), _order_line(record)))

    def finish(self, step: int) -> bool:
        """Makes ``step`` a finished step; False when it has no file (no records), so nothing was done."""
        entry = self._open.pop(step, None)
        if entry is None:
            return False
        path = entry.partial
        try:
            entry.file.flush()
            os.fsync(entry.file.fileno())
            entry.file.close()
            path = self.layout.order_file(self.rank, step)
            write_durably(path, "".join(line + "\n" for line in _execution_order(entry.order)).encode("utf-8"))
            path = entry.partial
            os.replace(entry.partial, self.layout.step_file(self.rank, step))
            fsync_dir(self.layout.rank_dir(self.rank))
        except OSError as error:
            _close_quietly(entry)
            raise StepFileError(error, path, "could not finish step") from error
        return True

    def remove_finished(self, step: int) -> None:
        """Removes a finished step (the ring buffer): the step file first, so no reader sees it without order."""
        for path in (self.layout.step_file(self.rank, step), self.layout.order_file(self.rank, step)):
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                raise StepFileError(error, path, "could not remove an old step of the ring buffer") from error

    def sync(self, *, durable: bool = True) -> None:
        for entry in self._open.values():
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


def _order_line(record: Mapping[str, Any]) -> str:
    name = str(record["name"])
    phase = record.get("phase")
    line = f"{name}_{phase}" if phase else name
    return line.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _execution_order(order: list[tuple[Any, str]]) -> list[str]:
    # "seq" is the execution order; write order can differ when records are produced late.
    if order and all(isinstance(seq, int) and not isinstance(seq, bool) for seq, _ in order):
        return [line for _, line in sorted(order, key=lambda item: item[0])]  # stable: ties keep write order
    return [line for _, line in order]


def _close_quietly(entry: _OpenStep) -> None:
    try:
        entry.file.close()
    except OSError:
        pass
