"""Comparing two statistics dumps: one comparison (match, measure, the first divergence), and a comparison of dumps
of any size, a window of steps at a time, windows on every core.

    report = compare_dumps("pt_out", "ort_out")                       # windows of DEFAULT_WINDOW records
    report = compare_dumps("pt_out", "ort_out", window=50_000, jobs=4)  # smaller windows, four processes
    report = compare_dumps("pt_out", "ort_out", exact=True)           # bit-identical or not, by the records' hashes
    report = compare_dumps("ddp_out", ranks=True, exact=True)         # every rank against rank 0 (grad/param/optim)
    report = compare_loaded(read_dump("pt_out"), read_dump("ort_out"), CompareConfig())   # one window, loaded

**One comparison** (``compare_loaded``): records matched by (rank, step, phase, name), those of one run only listed;
a gradient exactly zero in one run and absent in the other a note unless ``strict_zero_grads``; every pair checked
on whole columns (``evaluation``); the first divergence the earliest in execution order (docs/compare.md).
**Windows** (``compare_dumps``): every rule looks at one step, so whole steps compare on their own. A window (about
``window`` records of a dump) is read, compared and reduced: its arrays spilled to one Arrow IPC file, the
RecordDiffs a report shows built. The windows are joined in step order as a SpilledRecordDiffs: memory grows with
the window, not the dumps; a record nobody built is rebuilt by comparing its window again. Fuzzy pairs are found
once, on the step fuzzy alignment always uses.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..dump import DumpFormatError, DumpReader, Record, first_anomaly
from ..dump.anomaly import Anomaly
from ..dump.reader import DamagedSteps, StepFile, listed_records
from ..dump.record import RecordKey, execution_order
from ..dump.statistics import global_norms
from ..utils.flags import OptionError, check_keywords, option, positive, positive_int, positive_or_none, takes_options
from ..utils.phases import GRAD, GRADIENT_PHASES, PARAMETER_PHASES
from ..utils.progress import progress_meter
from .evaluation import NOISED, WORST, Carried, carried, drift, measure, noise_levels, record_diffs
from .operations import align_operations, apply_renames, find_operations, fuzzy_renames, reference_step
from .options import DEFAULT_WINDOW, CompareConfig, NameMap, NameMapLike, as_name_map
from .pairs import match
from .reading import LoadedDump, check_hashes, drop_steps, rank_pairs, rank_steps, read_dump
from .recorddiffs import RecordDiffs, SpilledRecordDiffs, Summary, WorstMetric, spill
from .results import Damaged, Divergence, NoiseFloor, Operations, RecordDiff, Rename, Report, op_name

__all__ = ["CompareOptions", "compare_dumps", "compare_loaded", "compare_records", "is_zero_gradient", "windows_of"]


def compare_records(base: Record, other: Record, config: CompareConfig = CompareConfig(),
                    noise: Record | None = None) -> RecordDiff:
    """Compares one matched pair of records (same rank, step, phase and name); ``noise``: the base record's
    counterpart in a calibration run, whose difference from ``base`` gives the noise levels."""
    loaded = [LoadedDump.of_records([record]) for record in (base, other, noise) if record is not None]
    rows = (np.zeros(1, np.int64), np.zeros(1, np.int64))
    levels = None if noise is None else noise_levels(loaded[0], loaded[2], rows)
    return record_diffs(loaded[0], loaded[1], rows, config, levels)[0]


def compare_loaded(base: LoadedDump, other: LoadedDump, config: CompareConfig, runs: Sequence[LoadedDump] = (), *,
                   progress: bool | TextIO = False, fuzzy: Sequence[Rename] | None = None,
                   before: Mapping[tuple[int, int], Carried] | None = None) -> Report:
    """Compares two loaded dumps (see ``compare_dumps``); ``runs``: the calibration runs; with ``config.fuzzy``,
    renames ``other``'s records (by ``fuzzy``, the pairs found on the whole dumps, when the dumps are windows of them);
    ``before``: (rank, step) -> what the step before the dumps' first carried on (when they are a window), which
    drift grows from (``evaluation.carried``, ``evaluation.drift``).
    Only the records a report shows become RecordDiff objects. With ``config.exact`` the verdict of a pair is whether
    its hashes are equal; MissingHashes when a record of either dump has none."""
    if config.exact:
        check_hashes(base)
        check_hashes(other)
    renamed = [Rename(None, original, new, "map", 1.0, "the name map")
               for original, new in other.renamed.items()]
    renamed += align_operations(base, other)
    if config.fuzzy:
        paired = fuzzy_renames(base, other) if fuzzy is None else list(fuzzy)
        apply_renames(other, paired)
        renamed += paired
    meter = progress_meter("comparing", 4, progress)
    tick = meter.update if meter else lambda done: None
    natural = match(base, other)  # in base row order: both sides' columns are read in the order they are stored
    tick(1)
    levels, noise_unmatched = _noise(base, runs, natural[0]) if runs else (None, 0)
    measured = measure(base, other, natural, config, levels)
    position = np.empty(len(base), np.int64)
    position[base.order] = np.arange(len(base))
    in_order = np.argsort(position[natural[0]], kind="stable")
    pairs = (natural[0][in_order], natural[1][in_order])
    measured = measured.reordered(in_order)
    levels = None if levels is None else levels[in_order]
    drifted = np.full(len(in_order), np.nan)
    if config.drifts:  # drift is no divergence: every verdict below reads measured.diverged
        drifted = drift(base.rank[pairs[0]], base.step[pairs[0]], measured, before or {})
        measured.diverged &= np.isnan(drifted)
    noise_floor = None if levels is None or measured.noise_ratio is None else \
        _noise_floor(levels, measured.noise_ratio, lambda row: base.key(int(pairs[0][row])))
    tick(2)

    def build(rows: np.ndarray) -> list[RecordDiff]:
        found = record_diffs(base, other, (pairs[0][rows], pairs[1][rows]), config,
                             None if levels is None else levels[rows])
        for record, grown in zip(found, drifted[rows].tolist()):
            record.drift = None if math.isnan(grown) else grown
        return found

    phase_codes, phases = base.codes("phase")
    name_codes, names = base.codes("name")
    records = RecordDiffs(rank=base.rank[pairs[0]], step=base.step[pairs[0]], seq=base.seq[pairs[0]],
                          phase=phase_codes[pairs[0]], name=name_codes[pairs[0]],
                          labels=(phases.to_pylist(), names.to_pylist()), ratio=measured.ratio,
                          diverged=measured.diverged, rel_error=measured.rel_error, build=build, drift=drifted,
                          worst_metric=WorstMetric(WORST, measured.worst, measured.worst_base, measured.worst_other,
                                                   measured.worst_null),
                          moments=measured.moments)
    only_in_base = _unmatched(base, pairs[0])
    only_in_other = _unmatched(other, pairs[1])
    zero_grads: list[tuple[RecordKey, str]] = []
    if not config.strict_zero_grads:
        only_in_base, zero_base = _split_zero_grads(only_in_base, base, other)
        only_in_other, zero_other = _split_zero_grads(only_in_other, other, base)
        zero_grads = _in_order(zero_base, zero_other, base, other)
    tick(3)
    noise = ", ".join(str(run.path) for run in runs) or None  # the calibration runs a report names
    report = Report(str(base.path), str(other.path), noise, config, records,
                    base.keys(only_in_base), other.keys(only_in_other), base.steps_by_rank, other.steps_by_rank,
                    {"base": base.unfinished, "other": other.unfinished}, noise_unmatched=noise_unmatched,
                    zero_grads=zero_grads, renamed=renamed,
                    grad_norms={"base": _grad_norms(base), "other": _grad_norms(other)})
    report.noise_floor = noise_floor
    common = (_in_common(only_in_base, base, other), _in_common(only_in_other, other, base))
    report.first_divergence = _first_divergence(report, base, other, common)
    report.operations = find_operations(base, other, pairs, records, common, report.first_divergence)
    report.first_nonfinite = {"base": _first_nonfinite(base), "other": _first_nonfinite(other)}
    tick(4)
    if meter:
        meter.close()
    return report


def _noise(base: LoadedDump, runs: Sequence[LoadedDump], rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Each matched base row's noise levels (``metrics.NOISED``, a column each): per statistic the largest the
    calibration runs give (nan: none gives one: no counterpart, or another structure), and how many rows have none."""
    levels = np.full((len(rows), len(NOISED)), np.nan)
    for run in runs:
        base_rows, noise_rows = match(base, run)
        counterpart = np.full(len(base), -1, np.int64)
        counterpart[base_rows] = noise_rows
        has = np.flatnonzero(counterpart[rows] >= 0)
        levels[has] = np.fmax(levels[has], noise_levels(base, run, (rows[has], counterpart[rows[has]])))
    return levels, int(np.isnan(levels).all(axis=1).sum())


def _noise_floor(levels: np.ndarray, ratios: np.ndarray, key_of: Callable[[int], RecordKey]) -> NoiseFloor:
    """What the report says of the noise floor, from each pair's levels and noise ratio (in execution order)."""
    measured = ~np.isnan(ratios)
    beyond = np.flatnonzero(measured & (ratios > 1))
    silent = (levels == 0).all(axis=1)  # a counterpart identical to the base: nothing measured
    return NoiseFloor(beyond=int(len(beyond)), within=int((measured & (ratios <= 1)).sum()), silent=int(silent.sum()),
                      first_beyond=key_of(int(beyond[0])) if len(beyond) else None,
                      largest=float(ratios[measured].max()) if measured.any() else None)


def _grad_norms(loaded: LoadedDump) -> dict[tuple[int, int], float]:
    """(rank, step) -> the global gradient norm of its grad records (``global_norms``, in file order)."""
    rows = np.flatnonzero(pc.equal(loaded.table.column("phase"), GRAD).to_numpy(zero_copy_only=False))
    if not len(rows):
        return {}
    norms = loaded.table.column("norm").take(rows).to_numpy(zero_copy_only=False).astype(np.float64)  # null: nan
    pairs = list(zip(loaded.rank[rows].tolist(), loaded.step[rows].tolist()))
    keys = list(dict.fromkeys(pairs))
    index = {key: i for i, key in enumerate(keys)}
    values = global_norms(norms, np.array([index[pair] for pair in pairs], np.int64), len(keys))
    return {key: float(value) for key, value in zip(keys, values.tolist()) if not math.isnan(value)}


def _unmatched(loaded: LoadedDump, matched: np.ndarray) -> np.ndarray:
    """The rows of ``loaded`` without a counterpart, in its execution order."""
    alone = np.ones(len(loaded), dtype=bool)
    alone[matched] = False
    return loaded.order[alone[loaded.order]]


def _in_order(rows_base: list[int], rows_other: list[int], base: LoadedDump, other: LoadedDump
              ) -> list[tuple[RecordKey, str]]:
    """The keys of rows of both runs, with their side, in execution order."""
    items = []
    for side, loaded, rows in (("base", base, rows_base), ("other", other, rows_other)):
        for row in rows:
            key = loaded.key(row)
            items.append((execution_order(key[1], key[2], int(loaded.seq[row]), key[0]), key, side))
    return [(key, side) for _, key, side in sorted(items, key=lambda item: item[0])]


def is_zero_gradient(record: Record) -> bool:
    """Whether a gradient record is exactly zero everywhere: ``zero == numel``, no nan or inf (without these counts:
    never).

        is_zero_gradient({"phase": "backward", "numel": 6, "zero": 6, "nan": 0, "inf": 0})  # True
    """
    if record.get("phase") not in GRADIENT_PHASES:
        return False
    counts = [record.get(key) for key in ("numel", "zero", "nan", "inf")]
    if not all(isinstance(count, int) and not isinstance(count, bool) for count in counts):
        return False
    numel, zero, nan, inf = counts
    return zero == numel and nan == 0 and inf == 0


def _split_zero_grads(rows: np.ndarray, has: LoadedDump, lacks: LoadedDump) -> tuple[np.ndarray, list[int]]:
    """``rows`` (records only in ``has``) split into (the rest, zero gradients of steps both runs finished: in a step
    the other run never finished, every record is missing, a different step count)."""
    candidates = _in_common(rows, has, lacks)
    if len(candidates):
        candidates = candidates[has.matches("phase", lambda phase: phase in GRADIENT_PHASES)[candidates]]
    zeros = [row for row, record in zip(candidates.tolist(), has.records_at(candidates)) if is_zero_gradient(record)]
    return rows[~np.isin(rows, zeros)], zeros


def _in_common(rows: np.ndarray, loaded: LoadedDump, counterpart: LoadedDump) -> np.ndarray:
    """The rows (of ``loaded``, in one run only) in a (rank, step) both runs finished: divergences (only there is a
    record missing on one side a mismatch)."""
    mine, theirs = loaded.steps_by_rank, counterpart.steps_by_rank
    return rows[loaded.in_steps([(r, s) for r in set(mine) & set(theirs) for s in set(mine[r]) & set(theirs[r])],
                                rows)]


def _first_divergence(report: Report, base: LoadedDump, other: LoadedDump, common: tuple[np.ndarray, np.ndarray]
                      ) -> Divergence | None:
    """The earliest value or presence mismatch in execution order; a record missing on one side counts only in a
    (rank, step) both runs finished (a step one run did not reach is a different step count)."""
    candidates: list[tuple[tuple[int, int, int, int], Divergence]] = []
    diverged = report.records.diverged_rows()
    if len(diverged):
        first_value = report.records[int(diverged[0])]
        candidates.append((execution_order(first_value.step, first_value.phase, first_value.seq, first_value.rank),
                           first_value.divergence()))
    for rows, loaded, present, missing in ((common[0], base, "present", "missing"),
                                           (common[1], other, "missing", "present")):
        if len(rows):  # an operation of one run only is listed, not a divergence (``Report.agrees``)
            rows = rows[~loaded.matches("name", lambda name: op_name(name) is not None)[rows]]
        if len(rows):  # rows are in execution order: the first one in a common step is the earliest
            row = int(rows[0])
            rank, step, phase, name = loaded.key(row)
            seq = int(loaded.seq[row])
            candidates.append((execution_order(step, phase, seq, rank),
                               Divergence(rank, step, phase, name, "record", present, missing, seq)))
    return min(candidates, key=lambda item: item[0])[1] if candidates else None


def _first_nonfinite(loaded: LoadedDump) -> Anomaly | None:
    """``first_anomaly`` of every record, reading only the records whose counts (or odd values) may say so."""
    table = loaded.table
    nan = table.column("nan").to_numpy(zero_copy_only=False)
    inf = table.column("inf").to_numpy(zero_copy_only=False)
    with np.errstate(invalid="ignore"):
        maybe = (np.nan_to_num(nan) > 0) | (np.nan_to_num(inf) > 0)
    maybe |= pc.is_valid(table.column("extra")).to_numpy(zero_copy_only=False)
    return first_anomaly(loaded.records_at(np.flatnonzero(maybe)))


@dataclass(frozen=True)
class _Window:
    """What one window compares; plain data, so it goes to another process."""

    paths: tuple[str, ...]  # base, other, then the calibration runs (noise)
    readers: tuple[DumpReader, ...]  # the same, listed once, narrowed to the window's steps
    config: Mapping[str, Any]  # CompareConfig.fields(), the user's
    steps: frozenset[int] | None  # this window's steps (None: every step the config wants)
    name_map: NameMap | None
    fuzzy: tuple[Rename, ...] | None  # the pairs found on the whole dumps (None: find them here)
    previous: tuple[int, ...] = ()  # the (at most) two steps before the window's first: drift grows from them
    before: tuple[DumpReader, ...] | None = None  # the readers narrowed to those steps


def _compare(window: _Window, progress: bool | TextIO = False) -> Report:
    """The window's report: its steps of each dump read, compared."""
    config = CompareConfig(**window.config)  # type: ignore[arg-type]
    steps = {} if window.steps is None else {"steps": window.steps}
    base, other, noise = _read(window.readers, CompareConfig(**{**window.config, **steps}),  # type: ignore[arg-type]
                               window.name_map, progress)
    report = compare_loaded(base, other, config, noise, progress=progress, fuzzy=window.fuzzy,
                            before=_carried(window) if config.drifts else None)
    report.damaged = {side: damaged for side, damaged in (("base", base.damaged), ("other", other.damaged),
                                                         ("noise", [item for run in noise for item in run.damaged]))
                      if damaged}
    return report


def _carried(window: _Window) -> dict[tuple[int, int], Carried]:
    """(rank, step) -> what the step before the window's first carried on (``evaluation.carried``), from the two steps
    before the window compared again here: what drift grows from, whatever the windows (empty: the first window)."""
    if window.before is None or not window.previous:
        return {}
    config = CompareConfig(**{**window.config, "steps": frozenset(window.previous)})  # type: ignore[arg-type]
    base, other, noise = _read(window.before, config, window.name_map, False)
    raw = CompareConfig(**{**window.config, "strict_drift": True})  # type: ignore[arg-type]  # verdicts, no drift
    records = compare_loaded(base, other, raw, noise, fuzzy=window.fuzzy).records
    worst = records.worst_metric
    found = carried(records.rank, records.step, records.ratio, records.diverged,
                    np.ones(len(records), np.int8) if worst is None else worst.code)
    return {key: value for key, value in found.items() if key[1] == max(window.previous)}


def _read(readers: Sequence[DumpReader], config: CompareConfig, name_map: NameMap | None, progress: bool | TextIO
          ) -> tuple[LoadedDump, LoadedDump, list[LoadedDump]]:
    """(base, other, the calibration runs) read, damaged files left out: a step damaged in one run is compared in
    neither (it is not a step only the other run has)."""
    if config.ranks:
        base, other = rank_pairs(read_dump(readers[0], config, progress=progress, skip_damaged=True))
    else:
        base = read_dump(readers[0], config, progress=progress, skip_damaged=True)
        other = read_dump(readers[1], config, progress=progress, name_map=name_map, skip_damaged=True)
    noise = [read_dump(reader, config, progress=progress, skip_damaged=True) for reader in readers[2:]]
    damaged = [{(item.rank, item.step) for item in loaded.damaged} for loaded in (base, other)]
    drop_steps(base, damaged[1])
    drop_steps(other, damaged[0])
    return base, other, noise


_Spilled = tuple[Path, dict[int, RecordDiff], Summary]  # a window's spill file, the RecordDiffs built, its summary


def _compared_part(window: _Window, directory: str, index: int) -> tuple[Report, _Spilled]:
    """The window compared, its arrays written to ``directory``, the records a report shows built (in a worker
    process when there are jobs, where the dumps are read), and the rest of its report (without records, config)."""
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
    return report, (spilled, built, summary)


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


def _before(windows: Sequence[frozenset[int] | None]) -> list[tuple[int, ...]]:
    """Per window the (at most) two steps before its first, of the windows before it (drift grows from them)."""
    steps = sorted(step for window in windows if window is not None for step in window)
    found = []
    for window in windows:
        first = steps.index(min(window)) if window else 0
        found.append(tuple(steps[max(0, first - 2):first]))
    return found


def _compare_windows(windows: Sequence[_Window], jobs: int, progress: bool | TextIO) -> Report:
    """The windows compared (``jobs`` processes) and joined into one report, as if compared at once."""
    if len(windows) == 1:
        return _compare(windows[0], progress)
    meter = progress_meter(f"comparing {len(windows)} windows", len(windows), progress)
    directory = tempfile.TemporaryDirectory(prefix="probes-compare-")
    parts: list[tuple[Report, _Spilled]] = []
    try:
        for done, part in enumerate(_parts(windows, max(1, min(jobs, len(windows))), directory.name), 1):
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


def _parts(windows: Sequence[_Window], jobs: int, directory: str) -> Iterator[tuple[Report, _Spilled]]:
    arguments = (windows, [directory] * len(windows), range(len(windows)))
    if jobs == 1:
        yield from map(_compared_part, *arguments)
        return
    # fork: a worker starts in milliseconds with everything imported; the windows come back in order.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_one_thread) as pool:
        yield from pool.map(_compared_part, *arguments)


def _one_thread() -> None:
    """A worker's Arrow reads with one thread: the processes are the parallelism (as many as the cores)."""
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)


def _joined(windows: Sequence[_Window], parts: Sequence[tuple[Report, _Spilled]],
            directory: tempfile.TemporaryDirectory) -> Report:
    def build(rows: np.ndarray) -> list[RecordDiff]:
        """Records no window built: their windows compared again."""
        found: dict[int, RecordDiff] = {}
        part_of = np.searchsorted(offsets, rows, side="right") - 1
        for index in np.unique(part_of).tolist():
            wanted = rows[part_of == index]
            again = _compare(windows[index]).records
            found.update(zip(wanted.tolist(), again.at(wanted - offsets[index])))
        return [found[row] for row in rows.tolist()]

    records = SpilledRecordDiffs(directory, [spilled for _, spilled in parts], build)
    offsets = np.cumsum([0, *records.counts])
    reports = [report for report, _ in parts]
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
    base, other, *noise = windows[0].paths
    report = Report(base, other, ", ".join(noise) or None, CompareConfig(**windows[0].config),  # type: ignore[arg-type]
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
    return rank_steps((rank, step) for by_rank in found for rank, listed in by_rank.items() for step in listed)


def _runs(noise: Any) -> tuple[Any, ...]:
    """The calibration runs given as ``noise``: None, one path (or reader), or a sequence of them."""
    if noise is None:
        return ()
    if isinstance(noise, (str, Path, DumpReader)):
        return (noise,)
    return tuple(noise)


def _fuzzy_pairs(readers: tuple[DumpReader, ...], config: CompareConfig, name_map: NameMap | None
                 ) -> tuple[Rename, ...]:
    """Fuzzy alignment's pairs, found as on the whole dumps: on the lowest common rank's first common step."""
    reference = reference_step(*(rank_steps((f.rank, f.step) for f in reader.step_files()
                                            if f.rank is not None and config.wants_step(f.step))
                                 for reader in readers[:2]))
    if reference is None:
        return ()
    first = frozenset({reference[1]})
    reading = CompareConfig(**{**config.fields(), "steps": first})  # type: ignore[arg-type]
    base, other, _ = _read([reader.with_finished_steps(first) for reader in readers[:2]], reading, name_map, False)
    align_operations(base, other)  # as every window does before fuzzy alignment
    return tuple(fuzzy_renames(base, other))


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
    paths = (str(base), str(other), *(str(path) for path in _runs(chosen.noise)))
    # Each dump is listed once, here: a window's reader is narrowed to its steps (listing a dump of ten thousand
    # step files in every window would cost more than comparing them).
    opened = {path: DumpReader(path) for path in paths}
    readers = tuple(opened[path] for path in paths)
    windows = windows_of(readers[0], readers[1], readers[2:], config, chosen.window)
    pairs = _fuzzy_pairs(readers, config, mapping) if config.fuzzy and len(windows) > 1 else None
    report = _compare_windows([_Window(
        paths, readers if steps is None else tuple(reader.with_finished_steps(steps) for reader in readers),
        config.fields(), steps, mapping, pairs, previous,
        tuple(reader.with_finished_steps(set(previous)) for reader in readers) if previous else None)
        for steps, previous in zip(windows, _before(windows))], chosen.jobs, chosen.progress)
    if not chosen.skip_damaged and any(report.damaged.values()):
        raise DamagedSteps([(StepFile(Path(item.path), item.rank, item.step, True),
                             DumpFormatError(item.path, item.line, item.problem))
                            for side in ("base", "other", "noise") for item in report.damaged.get(side, [])])
    return report
