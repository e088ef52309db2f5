"""TEMPORARY: a stand-in for ``probes.dump.DumpReader`` / ``StepFile`` until the dump room's reader lands.

Delete this file at the merge and change the one import in ``probes/compare/reading.py`` to
``from ..dump import DumpReader, StepFile``. It has exactly the public API the dump room adds, built
from today's private helpers of ``probes.dump`` and the order-file check moved out of compare:

    reader = DumpReader("pt_out")                 # waits once for this process's live writers into it
    for step_file in reader.step_files(): records = reader.read(step_file)
"""

from __future__ import annotations

from pathlib import Path

from ..dump import DumpFormatError, DumpLayout, Record, flush_writers
from ..dump import _list_steps, _read_step_file, _scan
from ..dump import _StepFile as StepFile

__all__ = ["DumpReader", "StepFile"]


class DumpReader:
    """TEMPORARY (see the module docstring): the records and steps of one dump."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        flush_writers(self.path)

    def step_files(self, *, include_partial: bool = False) -> list[StepFile]:
        """The step files, sorted by (rank, step); a lone step file path gives that file."""
        _, files = _scan(self.path)
        return [step_file for step_file in files if step_file.finished or include_partial]

    def steps(self) -> dict[int | None, dict[str, list[int]]]:
        return _list_steps(self.path)

    def read(self, step_file: StepFile) -> list[Record]:
        """The records of one step file; a finished one in a rank directory is checked against its order file."""
        records = _read_step_file(step_file)
        if step_file.finished and step_file.rank is not None:
            # The writer lists every record of a finished step in its order file, so a step file that lost
            # whole lines (a copy cut at a line boundary) is caught too, not only one cut inside a line.
            order_file = DumpLayout(step_file.path.parent.parent).order_file(step_file.rank, step_file.step)
            try:
                expected = order_file.read_bytes().count(b"\n")
            except FileNotFoundError:
                return records
            if len(records) < expected:
                raise DumpFormatError(step_file.path, len(records) + 1, f"truncated: {order_file.name} lists "
                                      f"{expected} records, the step file has {len(records)}")
        return records

    def records(self, *, include_partial: bool = False) -> list[Record]:
        if self.path.is_file() and not include_partial and not _scan(self.path)[1][0].finished:
            raise ValueError(f"{self.path} is an unfinished step; load it with include_partial=True "
                             "(show: --include-partial)")
        return [record for step_file in self.step_files(include_partial=include_partial)
                for record in self.read(step_file)]
