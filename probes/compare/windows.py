"""A comparison of dumps of any size: read and compared a window of steps at a time, windows on every core.

    report = compare_dumps("pt_out", "ort_out")                       # windows of DEFAULT_WINDOW records
    report = compare_dumps("pt_out", "ort_out", window=50_000, jobs=4)  # smaller windows, four processes
    report = compare_dumps("pt_out", "ort_out", skip_damaged=True)    # damaged steps left out, listed
    report = compare_dumps("pt_out", "ort_out", exact=True)           # bit-identical or not, by the records' hashes
    report = compare_dumps("ddp_out", ranks=True, exact=True)         # every rank against rank 0 (grad/param/optim)

Records are matched within a (rank, step), and every rule, the noise level and the zero-gradient note look
at one step, so whole steps (of every rank) compare on their own. Windows are consecutive steps, about
``window`` records of a dump each; each is read (both runs, the noise run), compared by ``engine`` and
reduced: its arrays (verdicts, keys, the moments the plots read) written to a temporary directory, one
Arrow IPC file per window (``recorddiffs.spill``), and the RecordDiffs a report shows built (every diverged record, each step's
worst, the worst records, those around the window's first divergence). The windows are joined in step order,
which is execution order, as a SpilledRecordDiffs whose tables and plots read the arrays a window at a time:
memory grows with the window, not with the dumps. A record nobody built is rebuilt by comparing its window
again. Fuzzy pairs are found once, on the step
fuzzy alignment always uses, and applied in every window. With one window this is ``engine`` alone.
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
from ..utils.phases import PARAMETER_PHASES
from ..utils.progress import progress_meter
from .align import align_operations, fuzzy_renames
from .config import DEFAULT_NOISE_FACTOR, DEFAULT_WINDOW, CompareConfig
from .engine import compare_loaded, noise_label
from .recorddiffs import SpilledRecordDiffs, Summary, spill
from .names import NameMap, NameMapLike, as_name_map
from .reading import LoadedDump, drop_steps, rank_pairs, read_dump
from .report import Report
from .results import Damaged, NoiseFloor, Operations, RecordDiff, Rename

__all__ = ["compare_dumps", "compare_windows", "windows_of"]


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
                    grad_norms={side: {key: value for window in reports for key, value in window.grad_norms.get(side, {}).items()}
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
    return base.only(steps), other.only(steps), tuple(reader.only(steps) for reader in noise)


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
            loaded_base = read_dump(base.only(first), reading, progress=False, skip_damaged=True)
            loaded_other = read_dump(other.only(first), reading, progress=False, name_map=name_map, skip_damaged=True)
            _drop_damaged(loaded_base, loaded_other)
            align_operations(loaded_base, loaded_other)  # as every window does before fuzzy alignment
            return tuple(fuzzy_renames(loaded_base, loaded_other))
    return ()


def compare_dumps(base: str | Path, other: str | Path | None = None, *, rtol: float | None = None,
                  atol: float | None = None,
                  noise: str | Path | Sequence[str | Path] | None = None, noise_factor: float = DEFAULT_NOISE_FACTOR,
                  steps: Iterable[int] | None = None, names: Sequence[str] = (),
                  progress: bool | TextIO = False, strict_zero_grads: bool = False,
                  name_map: NameMapLike | None = None, fuzzy: bool = False, window: int | None = DEFAULT_WINDOW,
                  jobs: int = 1, skip_damaged: bool = False, exact: bool = False, ranks: bool = False,
                  phases: Iterable[str] | None = None) -> Report:
    """Compares the dump ``other`` against the dump ``base``; ``noise``: the dump of a calibration run (the base run
    again under ``probes.testing.perturbed_rounding``), or several: each record's noise levels are the largest the
    runs give (docs/compare.md, Noise floor).

    ``rtol``, ``atol``: one fixed rule ``atol + rtol * |x|`` for every record (the one not given: 1e-4, 1e-6);
    neither: each record's per-dtype default (docs/compare.md, Tolerance).

    ``name_map``: OTHER's names rewritten into BASE's (a NameMap, its rules, or a YAML/JSON file;
    ``probes.compare.names``), before the ``names`` filter. ``fuzzy``: names still found in one run only
    are paired by module class, shape and execution order (``probes.compare.align``). Both are listed
    in ``report.renamed``.

    ``strict_zero_grads``: a gradient exactly zero in one run and absent in the other diverges
    (by default it is only noted in ``report.zero_grads``). ``window``: about how many records of a dump
    are read at a time (whole steps; None: all at once); ``jobs``: processes comparing windows at once.
    ``skip_damaged``: step files that cannot be read are left out (of both runs) and listed in
    ``report.damaged``; without it they raise one DamagedSteps naming every one. Raises DumpFormatError (naming
    file and line) or OSError when a dump cannot be read, NameMapError for a name map that cannot be used.

    ``exact``: a record agrees when its bytes are bit-identical (the records' hashes, ``hash=True``), whatever
    the tolerances; MissingHashes (a ValueError) when a record has none. ``phases``: only records of these
    phases. ``ranks``: ``base`` is one dump whose every rank is compared with its rank 0 (``other`` not given);
    the phases default to those that must agree across data-parallel ranks (``PARAMETER_PHASES``: grad,
    param, optim); the report's records carry the rank compared, and ``report.first_divergence`` is the first
    rank, step and record that differ (ValueError for a dump with one rank).
    """
    if ranks:
        if other is not None or _runs(noise) or name_map is not None or fuzzy:
            raise ValueError("ranks=True compares the ranks of one dump: give no other dump, noise, name_map or fuzzy")
        other = base
        found = sorted(rank for rank in DumpReader(base).steps() if rank is not None)
        if len(found) < 2 or found[0] != 0:
            raise ValueError(f"{base}: --ranks compares every rank with rank 0 and needs rank 0 and at least one more "
                             f"rank, found rank(s) {', '.join(map(str, found)) or 'none'}; give the dump directory of "
                             "a multi-process run")
        if phases is None:
            phases = PARAMETER_PHASES
    elif other is None:
        raise ValueError("give the dump to compare with base (or ranks=True to compare the ranks of base)")
    config = CompareConfig(rtol=rtol, atol=atol, noise_factor=noise_factor,
                           steps=frozenset(steps) if steps is not None else None, names=tuple(names),
                           strict_zero_grads=bool(strict_zero_grads), fuzzy=bool(fuzzy), exact=bool(exact),
                           phases=None if phases is None else (phases,) if isinstance(phases, str) else tuple(phases),
                           ranks=bool(ranks))
    mapping = as_name_map(name_map)
    paths = (str(base), str(other), tuple(str(path) for path in _runs(noise)))
    # Each dump is listed once, here: a window's reader is narrowed to its steps (listing a dump of ten thousand
    # step files in every window would cost more than comparing them).
    opened = {path: DumpReader(path) for path in (*paths[:2], *paths[2])}
    readers = (opened[paths[0]], opened[paths[1]], tuple(opened[path] for path in paths[2]))
    chosen = windows_of(*readers, config, window)
    pairs = _fuzzy_pairs(readers, config, mapping) if fuzzy and len(chosen) > 1 else None
    report = compare_windows([_Window(paths, _narrowed(readers, steps_of), config.fields(), steps_of, mapping, pairs)
                              for steps_of in chosen], jobs=jobs, progress=progress)
    if not skip_damaged and any(report.damaged.values()):
        raise DamagedSteps([(StepFile(Path(item.path), item.rank, item.step, True),
                             DumpFormatError(item.path, item.line, item.problem))
                            for side in ("base", "other", "noise") for item in report.damaged.get(side, [])])
    return report
