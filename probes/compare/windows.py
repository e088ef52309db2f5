"""A comparison of dumps of any size: read and compared a window of steps at a time, windows on every core.

    report = compare_dumps("pt_out", "ort_out")                       # windows of DEFAULT_WINDOW records
    report = compare_dumps("pt_out", "ort_out", window=50_000, jobs=4)  # smaller windows, four processes
    report = compare_dumps("pt_out", "ort_out", skip_damaged=True)    # damaged steps left out, listed
    report = compare_dumps("pt_out", "ort_out", exact=True)           # bit-identical or not, by the records' hashes
    report = compare_dumps("ddp_out", ranks=True, exact=True)         # every rank against rank 0 (grad/param/optim)

Records are matched within a (rank, step), and every rule, the noise level and the zero-gradient note look at
one step, so whole steps (of every rank) compare on their own. Windows are consecutive steps, about ``window``
records of a dump each; each is read (both runs, the noise run), compared by ``engine`` and reduced: its arrays
(verdicts, keys, the moments the plots read) written to a temporary directory, one Arrow IPC file per window
(``recorddiffs.spill``), and the RecordDiffs a report shows built (every diverged record, each step's worst, the
worst records, those around the window's first divergence). The windows are joined in step order, which is
execution order, as a SpilledRecordDiffs whose tables and plots read the arrays a window at a time: memory grows
with the window, not with the dumps. A record nobody built is rebuilt by comparing its window again. Fuzzy pairs
are found once, on the step fuzzy alignment always uses, and applied in every window. With one window this is
``engine`` alone.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa

from ..dump import DumpFormatError, DumpReader
from ..dump.reader import DamagedSteps, StepFile, listed_records
from ..utils.flags import OptionError, check_keywords, option, positive, positive_int, positive_or_none, takes_options
from ..utils.phases import PARAMETER_PHASES
from ..utils.progress import progress_meter
from .align import align_operations, fuzzy_renames
from .options import DEFAULT_WINDOW, CompareConfig, NameMap, NameMapLike, as_name_map
from .engine import compare_loaded, noise_label
from .recorddiffs import SpilledRecordDiffs, Summary, spill
from .reading import LoadedDump, drop_steps, rank_pairs, read_dump
from .results import Damaged, NoiseFloor, Operations, RecordDiff, Rename, Report

__all__ = ["CompareOptions", "compare_dumps", "compare_windows", "windows_of"]


@dataclass(frozen=True)
class _Window:
    """What one window compares; plain data, so it goes to another process."""

    paths: tuple[str, str, tuple[str, ...]]  # base, other, the calibration runs (noise)
    readers: tuple[DumpReader, DumpReader, tuple[DumpReader, ...]]  # the same, listed once, narrowed to the steps
    config: Mapping[str, Any]  # CompareConfig.fields(), the user's
    steps: frozenset[int] | None  # this window's steps (None: every step the config wants)
    name_map: NameMap | None
    fuzzy: tuple[Rename, ...] | None  # the pairs found on the whole dumps (None: find them here)


@dataclass
class _Part:
    """One window's comparison, reduced to what the joined report needs: its arrays in its spill file
    (``recorddiffs.spill``), the RecordDiffs a report shows (``_compared_part``), the rest of its report."""

    spilled: Path
    built: dict[int, RecordDiff]
    summary: Summary
    report: Report  # without its records and config (None): they are the spill file's and the joined report's


def _compare(window: _Window, progress: bool | TextIO = False) -> Report:
    """The window's report: its steps of each dump read (damaged files left out, of both runs), compared."""
    config = CompareConfig(**window.config)  # type: ignore[arg-type]
    reading = config if window.steps is None else CompareConfig(**{**window.config, "steps": window.steps})  # type: ignore[arg-type]
    base_reader, other_reader, noise_readers = window.readers
    if config.ranks:
        base, other = rank_pairs(read_dump(base_reader, reading, progress=progress, skip_damaged=True))
    else:
        base = read_dump(base_reader, reading, progress=progress, skip_damaged=True)
        other = read_dump(other_reader, reading, progress=progress, name_map=window.name_map, skip_damaged=True)
    noise = [read_dump(reader, reading, progress=progress, skip_damaged=True) for reader in noise_readers]
    _drop_damaged(base, other)
    report = compare_loaded(base, other, config, noise or None, progress=progress, fuzzy=window.fuzzy)
    report.damaged = {side: damaged for side, damaged in (("base", base.damaged), ("other", other.damaged),
                                                         ("noise", [item for run in noise for item in run.damaged]))
                      if damaged}
    return report


def _drop_damaged(base: LoadedDump, other: LoadedDump) -> None:
    """A step damaged in one run is compared in neither: it is not a step only the other run has."""
    damaged = [{(item.rank, item.step) for item in loaded.damaged} for loaded in (base, other)]
    drop_steps(base, damaged[1])
    drop_steps(other, damaged[0])


def _compared_part(window: _Window, directory: str, index: int) -> _Part:
    """The window compared, its arrays written to ``directory`` and the rest reduced (run in a worker process
    when there are jobs): the records the report shows are built here, where the dumps are read."""
    report = _compare(window)
    records = report.records
    summary = records.summary()
    rows = [summary.diverged_rows, summary.worst_rows, summary.top_rows]  # every step's worst, the worst records
    if records.worst_metric is not None:
        rows.append(np.flatnonzero(records.worst_metric.code == 1))  # what only a RecordDiff shows (plots build them)
    first = report.first_divergence
    if first is not None:
        rows.append(np.flatnonzero(records.where(rank=first.rank, step=first.step, phase=first.phase)))
    spilled = Path(directory) / f"{index}.arrow"
    spill(records, spilled)
    built = records.built(np.concatenate(rows))
    report.records = report.config = None  # type: ignore[assignment]  # the spill file's; the joined report's
    report.renamed = [rename for rename in report.renamed if rename.how != "fuzzy"]
    return _Part(spilled, built, summary, report)


def windows_of(base: str | Path | DumpReader, other: str | Path | DumpReader,
               noise: str | Path | DumpReader | Sequence[str | Path | DumpReader] | None,
               config: CompareConfig, window: int | None) -> list[frozenset[int] | None]:
    """The steps of each window, in order: about ``window`` records of a dump each, whole steps (None: one window
    of every step, also for a lone step file); ``noise``: the calibration runs (one, several or None)."""
    readers = [path if isinstance(path, DumpReader) else DumpReader(path)
               for path in (base, other, *_runs(noise))]
    if window is None or any(reader.path.is_file() for reader in readers):
        return [None]
    if window < 1:
        raise ValueError(f"window must be at least 1 record, got {window}")
    files = [f for reader in readers for f in reader.step_files() if f.rank is not None and config.wants_step(f.step)]
    steps = sorted({f.step for f in files})
    if not steps:
        return [None]
    per_step = max(1, _records_at(files, steps[0]))
    size = max(1, window // per_step)
    return [frozenset(steps[start:start + size]) for start in range(0, len(steps), size)]


def _records_at(files: Sequence[StepFile], step: int) -> int:
    """Records of one step over the ranks of the first dump that has it, from its order files (rows of one run)."""
    by_root: dict[Path, int] = {}
    for f in files:
        if f.step == step:
            root = f.path.parent.parent
            by_root[root] = by_root.get(root, 0) + (listed_records(f) or 1)
    return max(by_root.values(), default=1)


def compare_windows(windows: Sequence[_Window], *, jobs: int = 1, progress: bool | TextIO = False) -> Report:
    """The windows compared (``jobs`` processes) and joined into one report, as if compared at once."""
    if len(windows) == 1:
        return _compare(windows[0], progress)
    jobs = max(1, min(jobs, len(windows)))
    meter = progress_meter(f"comparing {len(windows)} windows", len(windows), progress)
    directory = tempfile.TemporaryDirectory(prefix="probes-compare-")
    parts: list[_Part] = []
    try:
        for done, part in enumerate(_each(windows, jobs, directory.name), 1):
            parts.append(part)
            if meter:
                meter.update(done)
    except BaseException:
        directory.cleanup()
        raise
    finally:
        if meter:
            meter.close()
    return _joined(windows, parts, directory)


def _each(windows: Sequence[_Window], jobs: int, directory: str) -> Iterable[_Part]:
    arguments = (windows, [directory] * len(windows), range(len(windows)))
    if jobs == 1:
        return map(_compared_part, *arguments)
    # fork: a worker starts in milliseconds with everything imported; the windows come back in order.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    return _pooled(arguments, jobs, context)


def _pooled(arguments: tuple[Sequence[Any], ...], jobs: int, context: Any) -> Iterator[_Part]:
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_one_thread) as pool:
        yield from pool.map(_compared_part, *arguments)


def _one_thread() -> None:
    """A worker's Arrow reads with one thread: the processes are the parallelism (as many as the cores)."""
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)


def _joined(windows: Sequence[_Window], parts: Sequence[_Part], directory: tempfile.TemporaryDirectory) -> Report:
    def build(rows: np.ndarray) -> list[RecordDiff]:
        """Records no window built: their windows compared again."""
        found: dict[int, RecordDiff] = {}
        part_of = np.searchsorted(offsets, rows, side="right") - 1
        for index in np.unique(part_of).tolist():
            wanted = rows[part_of == index]
            again = _compare(windows[index]).records
            found.update(zip(wanted.tolist(), again.at(wanted - offsets[index])))
        return [found[row] for row in rows.tolist()]

    records = SpilledRecordDiffs(directory, [(part.spilled, part.built, part.summary) for part in parts], build)
    offsets = np.cumsum([0, *records.counts])
    reports = [part.report for part in parts]
    renamed: dict[tuple[str, ...], Rename] = {}  # the name map's by name; operation pairs once each
    for how in ("map", "op"):
        for window in reports:
            for rename in window.renamed:
                if rename.how == how:
                    renamed.setdefault((how, rename.other) if how == "map" else (how, str(rename.phase), rename.other,
                                                                                   rename.base), rename)
    fuzzy = list(windows[0].fuzzy or ())
    damaged: dict[str, list[Damaged]] = {}
    for window in reports:
        for side, items in window.damaged.items():
            damaged.setdefault(side, []).extend(items)
    base, other, noise = windows[0].paths
    report = Report(base, other, noise_label(noise), CompareConfig(**windows[0].config),  # type: ignore[arg-type]
                    records, [key for window in reports for key in window.only_in_base],
                    [key for window in reports for key in window.only_in_other],
                    _union(window.base_steps for window in reports), _union(window.other_steps for window in reports),
                    reports[0].unfinished, noise_unmatched=sum(window.noise_unmatched for window in reports),
                    zero_grads=[item for window in reports for item in window.zero_grads],
                    renamed=[*renamed.values(), *fuzzy], damaged=damaged,
                    grad_norms={side: {key: value for window in reports
                                       for key, value in window.grad_norms.get(side, {}).items()}
                                for side in ("base", "other")})
    with_first = next((window for window in reports if window.first_divergence), None)
    report.first_divergence = None if with_first is None else with_first.first_divergence
    operations = [window.operations for window in reports if window.operations is not None]
    report.operations = Operations.merged(operations, None if with_first is None else with_first.operations) \
        if operations else None
    floors = [window.noise_floor for window in reports if window.noise_floor is not None]
    report.noise_floor = NoiseFloor.merged(floors) if floors else None
    report.first_nonfinite = {side: next((window.first_nonfinite.get(side) for window in reports
                                          if window.first_nonfinite.get(side)), None) for side in ("base", "other")}
    return report


def _union(found: Iterable[Mapping[int, list[int]]]) -> dict[int, list[int]]:
    steps: dict[int, set[int]] = {}
    for by_rank in found:
        for rank, listed in by_rank.items():
            steps.setdefault(rank, set()).update(listed)
    return {rank: sorted(listed) for rank, listed in sorted(steps.items())}


def _narrowed(readers: tuple[DumpReader, DumpReader, tuple[DumpReader, ...]], steps: frozenset[int] | None
              ) -> tuple[DumpReader, DumpReader, tuple[DumpReader, ...]]:
    if steps is None:
        return readers
    base, other, noise = readers
    return (base.with_finished_steps(steps), other.with_finished_steps(steps),
            tuple(reader.with_finished_steps(steps) for reader in noise))


def _runs(noise: Any) -> tuple[Any, ...]:
    """The calibration runs given as ``noise``: None, one path (or reader), or a sequence of them."""
    if noise is None:
        return ()
    if isinstance(noise, (str, Path, DumpReader)):
        return (noise,)
    return tuple(noise)


def _fuzzy_pairs(readers: tuple[DumpReader, DumpReader, tuple[DumpReader, ...]], config: CompareConfig,
                 name_map: NameMap | None) -> tuple[Rename, ...]:
    """Fuzzy alignment's pairs, found as on the whole dumps: on the lowest common rank's first common step."""
    base, other = readers[0], readers[1]
    steps: list[dict[int, set[int]]] = []
    for reader in (base, other):
        by_rank: dict[int, set[int]] = {}
        for f in reader.step_files():
            if f.rank is not None and config.wants_step(f.step):
                by_rank.setdefault(f.rank, set()).add(f.step)
        steps.append(by_rank)
    for rank in sorted(set(steps[0]) & set(steps[1])):
        common = sorted(steps[0][rank] & steps[1][rank])
        if common:
            reading = CompareConfig(**{**config.fields(), "steps": frozenset({common[0]})})  # type: ignore[arg-type]
            first = frozenset({common[0]})
            loaded_base = read_dump(base.with_finished_steps(first), reading, progress=False, skip_damaged=True)
            loaded_other = read_dump(other.with_finished_steps(first), reading, progress=False, name_map=name_map, skip_damaged=True)
            _drop_damaged(loaded_base, loaded_other)
            align_operations(loaded_base, loaded_other)  # as every window does before fuzzy alignment
            return tuple(fuzzy_renames(loaded_base, loaded_other))
    return ()


@dataclass(frozen=True, kw_only=True)
class CompareOptions(CompareConfig):
    """Every option of a comparison of dumps: ``compare_dumps``' arguments and ``probes compare``'s, declared once.

        options = CompareOptions(base="pt_out", other="ort_out", rtol=1e-3, window=10_000)
        options.config()                           # the CompareConfig every window compares with

    ``ranks``: ``base`` is one dump whose ranks are compared with its rank 0 (no ``other``, ``noise``, ``name_map``
    or ``fuzzy``); its phases default to ``PARAMETER_PHASES``. A bad combination is an OptionError naming the
    options as the caller wrote them.
    """

    base: str | os.PathLike = option(positional=True, metavar="BASE",
                                     help="the reference dump (directory, rank_<r> directory or step file)")
    other: str | os.PathLike | None = option(None, positional=True, metavar="OTHER",
                                             help="the dump to check against {base} (not with {ranks})")
    noise: tuple[str | os.PathLike | DumpReader, ...] | None = option(
        None, many="extend", nargs="+", parse=str, metavar="CALIBRATION", convert=_runs, help=(
        "calibration runs: {base} again under probes.testing.perturbed_rounding (one or several); each statistic's "
        "tolerance is then max(its default or fixed tolerance, k*noise), k*noise its noise floor (docs/compare.md, "
        "Noise floor)"))
    name_map: NameMapLike | None = option(None, flag="--map", parse=Path, metavar="FILE", help=(
        "a YAML or JSON name map (or, in Python, a NameMap or its rules): regular expressions rewriting {other}'s "
        "names into {base}'s before the {names} filter (docs/names.md)"))
    window: int | None = option(DEFAULT_WINDOW, parse=positive_int, metavar="RECORDS",
                                check=positive_or_none, help=(
        f"records of a dump read and compared at a time, whole steps (default {DEFAULT_WINDOW:,}; in Python None: "
        "all at once); bounds the memory a comparison takes, whatever the dumps' size"))
    jobs: int = option(1, parse=positive_int, command_line_default=os.cpu_count() or 1, metavar="N",
                       check=positive, help=(
        "processes comparing windows at once (default: the cores there are; in Python 1)"))
    skip_damaged: bool = option(False, convert=bool, help=(
        "leave damaged step files out (of both runs) and list them as a note (default: they are an error naming "
        "every one)"))
    progress: bool | TextIO = option(False, command_line=False, help=(
        "progress bars for long reads and compares: True on stderr, or on this stream"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.ranks and self.other is None:
            raise OptionError(CompareOptions, lambda say: (
                f"give the dump {say('other')} to compare with {say('base')}, or {say('ranks')} to compare the ranks "
                f"of {say('base')}"))
        if self.ranks and self.other is not None:
            raise OptionError(CompareOptions, lambda say: (
                f"{say('ranks')} compares the ranks of one dump: give {say('base')} only, not {str(self.other)!r}"))
        if self.ranks and (self.noise or self.name_map is not None or self.fuzzy):
            raise OptionError(CompareOptions, lambda say: (
                f"{say('ranks')} compares the ranks of one dump: {say('noise')}, {say('name_map')} and "
                f"{say('fuzzy')} do not apply"))
        if self.ranks and self.phases is None:
            object.__setattr__(self, "phases", PARAMETER_PHASES)


@takes_options(CompareOptions)
def compare_dumps(base: str | Path, other: str | Path | None = None, **options: Any) -> Report:
    """Compares the dump ``other`` against the dump ``base``.

        report = compare_dumps("pt_out", "ort_out", rtol=1e-3, noise=["noise_1"], window=10_000, jobs=4)

    The keywords are ``CompareOptions``' fields, listed below (``probes compare``'s flags); a bad one, or a bad
    combination, is a ValueError (OptionError) naming it. ``name_map`` and ``fuzzy`` pairs are listed in
    ``report.renamed``; materialised zero gradients in ``report.zero_grads``; with ``skip_damaged`` the damaged step
    files in ``report.damaged`` (without it they raise one DamagedSteps naming every one). Raises DumpFormatError
    (naming file and line) or OSError when a dump cannot be read, NameMapError for a name map that cannot be used,
    MissingHashes (a ValueError) with ``exact`` for a record without a hash. With ``ranks`` the report's records
    carry the rank compared, and ``report.first_divergence`` is the first rank, step and record that differ
    (OptionError for a dump with one rank).
    """
    check_keywords(CompareOptions, options, "compare_dumps")
    chosen = CompareOptions(base=base, other=other, **options)
    if chosen.ranks:
        other = base
        found = sorted(rank for rank in DumpReader(base).steps() if rank is not None)
        if len(found) < 2 or found[0] != 0:
            raise OptionError(CompareOptions, lambda say: (
                f"{base}: {say('ranks')} compares every rank with rank 0 and needs rank 0 and at least one more rank, "
                f"found rank(s) {', '.join(map(str, found)) or 'none'}; give the dump directory of a multi-process "
                "run"))
    config = chosen.config()
    mapping = as_name_map(chosen.name_map)
    paths = (str(base), str(other), tuple(str(path) for path in _runs(chosen.noise)))
    # Each dump is listed once, here: a window's reader is narrowed to its steps (listing a dump of ten thousand
    # step files in every window would cost more than comparing them).
    opened = {path: DumpReader(path) for path in (*paths[:2], *paths[2])}
    readers = (opened[paths[0]], opened[paths[1]], tuple(opened[path] for path in paths[2]))
    windows = windows_of(*readers, config, chosen.window)
    pairs = _fuzzy_pairs(readers, config, mapping) if config.fuzzy and len(windows) > 1 else None
    report = compare_windows([_Window(paths, _narrowed(readers, steps_of), config.fields(), steps_of, mapping, pairs)
                              for steps_of in windows], jobs=chosen.jobs, progress=chosen.progress)
    if not chosen.skip_damaged and any(report.damaged.values()):
        raise DamagedSteps([(StepFile(Path(item.path), item.rank, item.step, True),
                             DumpFormatError(item.path, item.line, item.problem))
                            for side in ("base", "other", "noise") for item in report.damaged.get(side, [])])
    return report
