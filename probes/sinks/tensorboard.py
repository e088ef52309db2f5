"""A dump's statistics as TensorBoard scalars, from a finished dump or live from the subscriber.

    write_tensorboard("pt_out", "tb", modules=["blocks.0.*"])      # then: tensorboard --logdir tb
    live = LiveTensorBoard("tb")                                    # or live, off the training thread:
    StatisticsSubscriber("pt_out", on_step_written=live); ...; live.close()

Stages: read (the dump, step by step) -> select (module globs, phases) -> write (one
``torch.utils.tensorboard.SummaryWriter`` per rank, into ``<logdir>/rank_<r>``). A record gives one
scalar per statistic, tagged ``<phase>/<record name>/<statistic>`` (``forward/blocks.0.attn.output.0/std``)
at its training step, so TensorBoard groups the charts by phase and module. A module glob matches the
module's qualified name or the record name. Gradient norms also go where people look for them: each
grad record's norm as ``grad_norm/<parameter name>`` and the step's global gradient norm (every grad record of
the step, whatever the module filter: ``probes.dump.statistics.global_grad_norms``) as ``grad_norm/global``,
unless ``phases`` leaves ``grad`` out. Statistics a record lacks (no finite element, a tensor
without statistics) are left out, not written as zero. A rank directory that already holds event
files is refused unless ``overwrite`` (TensorBoard would show the two runs mixed in one chart).

The options are declared once (``probes.utils.flags``): ``ScalarOptions`` (the log directory, the selection,
the statistics) are ``LiveTensorBoard``'s; ``TensorBoardOptions`` adds the dump, and are ``write_tensorboard``'s
and ``probes tensorboard``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..dump import DumpReader, Record
from ..dump.reader import DumpArgument
from ..dump.statistics import global_grad_norms, names
from ..utils.flags import OptionError, check_keywords, option, settle, takes_options
from ..utils.patterns import check_patterns, name_matcher
from ..utils.phases import GRAD, PHASES
from .output import ExportSummary, check_output, select_files

__all__ = ["DEFAULT_STATISTICS", "LiveTensorBoard", "PHASES", "ScalarOptions", "TensorBoardOptions",
           "write_tensorboard"]

DEFAULT_STATISTICS = names(plotted=True)  # ("min", "max", "mean", "std", "norm", "nan", "inf")
EVENT_FILES = "events.out.tfevents.*"


def _summary_writer(path: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # torch's module needs the tensorboard package
        raise ImportError(f"TensorBoard output needs the tensorboard package ({error}); install it: "
                          "pip install 'probes[tensorboard]'") from None
    return SummaryWriter(log_dir=str(path), flush_secs=10)


def _not_empty(statistics: Sequence[str]) -> str | None:
    return None if statistics else "is empty; name at least one, e.g. ('mean', 'std')"


@dataclass(frozen=True, kw_only=True)
class ScalarOptions:
    """Where TensorBoard scalars go and which: ``LiveTensorBoard``'s arguments (``TensorBoardOptions`` adds the
    dump). ``logdir`` is the first argument in Python, ``--logdir`` on the command line."""

    logdir: Path = option(positional=True, flag="--logdir", parse=Path, convert=Path,
                          help="TensorBoard's log directory (rank_<r> inside)")
    modules: Sequence[str] = option((), flag="--module", many="append", parse=str, metavar="GLOB",
                                    help="only modules (or record names) matching this glob (repeatable)")
    phases: Sequence[str] | None = option(None, flag="--phase", many="append", parse=str, choices=PHASES,
                                          help="only this phase (repeatable)")
    statistics: Sequence[str] = option(DEFAULT_STATISTICS, command_line=False, check=_not_empty, help=(
        "the record fields written, one scalar each (any numeric field, e.g. 'zero')"))
    overwrite: bool = option(False, help="replace the event files already in the log directory's rank_<r> "
                                         "(default: refuse)")

    def __post_init__(self) -> None:
        unknown = sorted(set(self.phases or ()) - set(PHASES))  # the command line's --phase has these choices
        if unknown:
            raise OptionError(ScalarOptions, lambda say: (
                f"unknown phase {', '.join(unknown)}; choose from {', '.join(PHASES)}"))
        modules = self.modules
        if isinstance(modules, str) or not all(isinstance(glob, str) for glob in modules):
            raise TypeError(f"modules must be a list of pattern strings (globs, or 're:<regex>'), got {modules!r}")
        check_patterns(tuple(modules) or None, "modules")
        settle(self)


@dataclass(frozen=True, kw_only=True)
class TensorBoardOptions(ScalarOptions, DumpArgument):  # DumpArgument last: its field first, DUMP then --logdir
    """``write_tensorboard``'s arguments and ``probes tensorboard``'s, declared once: the dump and
    ``ScalarOptions``."""

    progress: bool | TextIO = option(False, command_line=False, help=(
        "a progress bar for long reads: True on stderr, or on this stream"))


class _Scalars:
    """The selection (modules, phases, statistics) and the per-rank writers of one log directory."""

    def __init__(self, options: ScalarOptions) -> None:
        self._matches = name_matcher(tuple(options.modules), "modules")
        self.logdir = options.logdir
        self.modules, self.phases = tuple(options.modules), frozenset(options.phases or PHASES)
        self.statistics, self.overwrite = tuple(options.statistics), options.overwrite
        self._writers: dict[int, Any] = {}
        self.scalars = 0
        for rank_dir in self.logdir.glob("rank_*"):
            self._check_fresh(rank_dir)

    def _check_fresh(self, rank_dir: Path) -> None:
        events = sorted(rank_dir.glob(EVENT_FILES))
        if events and not self.overwrite:
            raise FileExistsError(f"{rank_dir} already holds TensorBoard event files ({events[0].name}); "
                                  "use another log directory, or overwrite=True (command line: --overwrite) "
                                  "to replace them")
        for event_file in events:
            event_file.unlink()

    def wants(self, record: Record) -> bool:
        if record.get("phase") not in self.phases:
            return False
        if not self.modules:
            return True
        return any(self._matches(str(record.get(key, ""))) for key in ("module", "name"))

    def add(self, records: Iterable[Record]) -> int:
        """Writes the selected records' scalars and the gradient norms; returns how many records were selected."""
        records = list(records)
        selected = 0
        for record in records:
            if not self.wants(record):
                continue
            selected += 1
            tags = [(f"{record['phase']}/{record['name']}/{statistic}", record.get(statistic))
                    for statistic in self.statistics]
            if record.get("phase") == GRAD:
                tags.append((f"grad_norm/{record['name']}", record.get("norm")))
            for tag, value in tags:
                self._scalar(record["rank"], tag, value, record["step"])
        if GRAD in self.phases:
            for (rank, step), norm in global_grad_norms(records).items():
                self._scalar(rank, "grad_norm/global", norm, step)
        return selected

    def _scalar(self, rank: int, tag: str, value: Any, step: int) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._writer(rank).add_scalar(tag, value, step)
            self.scalars += 1

    def _writer(self, rank: int) -> Any:
        if rank not in self._writers:
            rank_dir = self.logdir / f"rank_{rank}"
            self._check_fresh(rank_dir)
            self._writers[rank] = _summary_writer(rank_dir)
        return self._writers[rank]

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


@takes_options(TensorBoardOptions)
def write_tensorboard(dump: str | Path, logdir: str | Path, **options: Any) -> ExportSummary:
    """Writes the statistics of ``dump`` as TensorBoard scalars under ``logdir/rank_<r>`` (see the module).

    The keywords are ``TensorBoardOptions``' fields, listed below (``probes tensorboard``'s flags; ``logdir`` is
    its ``--logdir``).
    """
    check_keywords(TensorBoardOptions, options, "write_tensorboard")
    chosen = TensorBoardOptions(dump=dump, logdir=logdir, **options)
    check_output(chosen.logdir, dump, overwrite=True)  # an existing log directory is fine; its event files are not
    scalars = _Scalars(chosen)
    reader, files = select_files(dump)
    selected = 0
    try:
        for _, records in reader.read_each(files, progress=chosen.progress, label=f"writing {dump} to TensorBoard"):
            selected += scalars.add(records)
    finally:
        scalars.close()
    notes = [f"{scalars.scalars} scalars"]
    if not selected:
        notes.append("no record matched the module and phase filters")
    return ExportSummary.of("tensorboard", chosen.logdir, selected, files, tuple(notes))


class LiveTensorBoard:
    """An ``on_step_written`` listener: each finished step's scalars go to TensorBoard as the run goes.

        live = LiveTensorBoard("tb", modules=["blocks.*"])
        subscriber = StatisticsSubscriber("pt_out", on_step_written=live)
        ...                                    # train; refresh TensorBoard to see each step
        live.close()                           # or ``with LiveTensorBoard("tb") as live:``

    It runs on the dump writer's thread, never on the training thread; the step's records are read
    back from the step file just written. An existing log directory with event files is refused here,
    before training starts, unless ``overwrite``.
    """

    @takes_options(ScalarOptions)
    def __init__(self, logdir: str | Path, **options: Any) -> None:
        check_keywords(ScalarOptions, options, "LiveTensorBoard")
        self._scalars = _Scalars(ScalarOptions(logdir=logdir, **options))
        self._lock = threading.Lock()  # one writer thread per rank's dump may call at once
        self.steps = 0

    def __call__(self, step: int, path: Path) -> None:
        # On the writer's own thread: waiting for the writer would wait for itself.
        records = DumpReader(path, wait=False).records()
        with self._lock:
            self._scalars.add(records)
            self._scalars.flush()
            self.steps += 1

    def close(self) -> None:
        """Flushes and closes the event files (idempotent)."""
        with self._lock:
            self._scalars.close()

    def __enter__(self) -> "LiveTensorBoard":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
