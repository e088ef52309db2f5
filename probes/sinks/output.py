"""What every export shares: its options, the dump's step files for one rank or all, a safe output path, an
atomic write.

    options = ExportOptions(dump="pt_out", output="pt.csv", format="csv")   # export_dump's and probes export's
    files = select_files("pt_out", rank=None)          # (reader, finished step files), ValueError for a bad rank
    check_output(Path("pt.csv"), "pt_out", overwrite=False)
    with atomic_output(Path("pt.csv")) as temporary:   # written in full, then renamed over the output
        temporary.write_text(...)

An export never writes into the dump it reads, never replaces an existing output unless asked, and
never leaves a half-written output under the final name: it writes a temporary sibling and renames it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..dump import DumpReader
from ..dump.reader import DumpArgument, StepFile
from ..utils.flags import OptionError, option, settle

__all__ = ["FORMATS", "ExportOptions", "ExportSummary", "atomic_output", "check_output", "select_files"]

FORMATS = ("jsonl", "csv", "ort")


@dataclass(frozen=True, kw_only=True)
class ExportOptions(DumpArgument):
    """An export's options, declared once (``probes.utils.flags``): ``export_dump``'s arguments and ``probes
    export``'s, with their help and checks. ``output`` is ``export_dump``'s second argument and the command's
    ``--output``."""

    format: str = option(choices=FORMATS, help="the output format")
    output: Path = option(positional=True, flag="--output", parse=Path, convert=Path, metavar="PATH",
                          help="the output file (jsonl, csv) or directory (ort)")
    overwrite: bool = option(False, help="replace an existing output")
    rank: int | None = option(None, help="only this rank (ort: default the lowest)")
    progress: bool | TextIO = option(False, command_line=False, help=(
        "a progress bar for long exports: True on stderr, or on this stream"))

    def __post_init__(self) -> None:
        settle(self)
        if self.format not in FORMATS:  # the command line's --format has these choices
            raise OptionError(ExportOptions, lambda say: (
                f"unknown export format {self.format!r}; choose from {', '.join(FORMATS)}"))


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote; ``str()`` is the line the command line prints."""

    format: str
    output: Path
    records: int
    steps: int
    ranks: tuple[int, ...]
    notes: tuple[str, ...] = field(default=())

    @classmethod
    def of(cls, format: str, output: Path, records: int, files: list[StepFile],
           notes: tuple[str, ...] = ()) -> "ExportSummary":
        """The summary of an export of ``records`` records read from ``files``."""
        return cls(format, output, records, len(files), ranks_of(files), notes)

    def __str__(self) -> str:
        ranks = ", ".join(str(rank) for rank in self.ranks) or "none"
        text = (f"{self.records} record{'s' * (self.records != 1)} of {self.steps} step{'s' * (self.steps != 1)} "
                f"(rank {ranks}) written to {self.output}")
        return "; ".join([text, *self.notes])


def select_files(dump: str | Path, *, rank: int | None = None) -> tuple[DumpReader, list[StepFile]]:
    """The finished step files of ``dump`` (of ``rank`` only, if given), sorted by (rank, step)."""
    reader = DumpReader(dump)
    files = reader.step_files()
    if rank is not None:
        ranks = sorted({item.rank for item in files if item.rank is not None})
        files = [item for item in files if item.rank == rank or item.rank is None]
        if not files:
            raise ValueError(f"{dump} has no finished step of rank {rank} (its ranks: "
                             f"{', '.join(map(str, ranks)) or 'none'}); choose one of those")
    return reader, files


def ranks_of(files: list[StepFile]) -> tuple[int, ...]:
    return tuple(sorted({item.rank if item.rank is not None else 0 for item in files}))


def check_output(output: Path, dump: str | Path, *, overwrite: bool) -> None:
    """Refuses an output inside the dump, and an existing one unless ``overwrite``."""
    root = Path(dump).resolve()
    root = root if root.is_dir() else root.parent
    target = output.resolve()
    if target == root or root in target.parents:
        raise ValueError(f"{output} is inside the dump {dump}; write the export outside it")
    if os.path.lexists(output) and not overwrite:
        raise FileExistsError(f"{output} already exists; choose another output, or pass overwrite=True "
                              "(command line: --overwrite) to replace it")


@contextlib.contextmanager
def atomic_output(output: Path) -> Iterator[Path]:
    """A temporary path next to ``output``; renamed over it when the block ends without an error."""
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    _remove(temporary)
    try:
        yield temporary
        if output.is_dir() and not output.is_symlink():
            # A directory cannot be renamed over a non-empty one: move the old one aside first.
            old = output.with_name(f".{output.name}.old-{os.getpid()}")
            os.replace(output, old)
            os.replace(temporary, output)
            shutil.rmtree(old)
        else:
            os.replace(temporary, output)
    finally:
        _remove(temporary)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
