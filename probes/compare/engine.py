"""Compare two statistics dumps: match records, measure their differences, find the first divergence.

    report = compare_loaded(read_dump("pt_out"), read_dump("ort_out"), CompareConfig())
    if not report.agrees: print(report.first_divergence)
    python -m probes compare pt_out ort_out [--noise pt_noise1 pt_noise2] [--json r.json] [--html r.html]

``compare_dumps`` (``windows``) reads the dumps a window of steps at a time and runs this on each window.

Records are matched by (rank, step, phase, name); records present on one side only are listed,
never dropped. A gradient that is exactly zero everywhere in one run and absent in the other (one
backend materialises the zeros another leaves out) is a note, not a divergence, unless
``strict_zero_grads``. Every matched record is checked statistic by statistic against a tolerance that is
fixed (``atol + rtol * |base|``) or, given calibration runs (the base run again with its rounding perturbed,
``probes.rounding``), at least the statistic's noise floor: noise_factor times how much calibration moved it.
The first divergence is searched in execution order: earliest step, then its phases in the order they run
(forward, backward, recompute, grad, param, optim: ``probes.utils.phases``), within a phase the base run's order
(``seq``), across ranks; ``report.divergence_kind`` says in plain words which part of the step differs.
docs/compare.md states the rules, the exit status of the command and the JSON schema.
The rules are ``rules``, applied to every pair at once by ``evaluation`` (the verdicts, and the RecordDiff
objects a report shows), on the dumps' columns; ``compare_records`` makes columns of records at hand and takes
the same path. The result model is ``results``, ``recorddiffs`` and ``report``, reading ``reading``, the
terminal summary ``terminal``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TextIO

import numpy as np
import pyarrow.compute as pc

from ..dump import Record, first_anomaly
from ..dump.anomaly import Anomaly
from ..dump.record import RecordKey
from ..dump.record import execution_order
from ..dump.statistics import global_norms
from ..utils.phases import GRAD, GRADIENT_PHASES
from ..utils.progress import progress_meter
from .align import align_operations, apply_renames, fuzzy_renames
from .options import CompareConfig
from .evaluation import NOISED, WORST, measure, noise_levels, record_diffs
from .recorddiffs import RecordDiffs, WorstMetric
from .opfinding import find_operations
from .pairs import match
from .reading import LoadedDump, check_hashes
from .results import Divergence, NoiseFloor, RecordDiff, Rename, Report, op_name

__all__ = ["compare_loaded", "compare_records", "is_zero_gradient", "noise_label"]


def compare_records(base: Record, other: Record, config: CompareConfig = CompareConfig(),
                    noise: Record | None = None) -> RecordDiff:
    """Compares one matched pair of records (same rank, step, phase and name); ``noise``: the base record's
    counterpart in a calibration run, whose difference from ``base`` gives the noise levels."""
    loaded = [LoadedDump.of_records([record]) for record in (base, other, noise) if record is not None]
    rows = (np.zeros(1, np.int64), np.zeros(1, np.int64))
    levels = None if noise is None else noise_levels(loaded[0], loaded[2], rows)
    return record_diffs(loaded[0], loaded[1], rows, config, levels)[0]


def compare_loaded(base: LoadedDump, other: LoadedDump, config: CompareConfig,
                   noise: LoadedDump | Sequence[LoadedDump] | None = None, *, progress: bool | TextIO = False,
                   fuzzy: Sequence[Rename] | None = None) -> Report:
    """Compares two loaded dumps (see ``compare_dumps``); ``noise``: the calibration runs; with ``config.fuzzy``,
    renames ``other``'s records (by ``fuzzy``, the pairs found on the whole dumps, when the dumps are windows of them).

    The checks run on whole columns (``evaluation``); only the records a report shows become RecordDiff objects.
    With ``config.exact`` the verdict of a pair is whether its hashes are equal; MissingHashes when a record
    of either dump has none.
    """
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
    natural = match(base, other)  # in base row order: both sides' columns are read in the order they are stored
    if meter:
        meter.update(1)
    runs = [] if noise is None else [noise] if isinstance(noise, LoadedDump) else list(noise)
    levels, noise_unmatched = _noise(base, runs, natural[0]) if runs else (None, 0)
    measured = measure(base, other, natural, config, levels)
    position = np.empty(len(base), np.int64)
    position[base.order] = np.arange(len(base))
    in_order = np.argsort(position[natural[0]], kind="stable")
    pairs = (natural[0][in_order], natural[1][in_order])
    measured = measured.reordered(in_order)
    levels = None if levels is None else levels[in_order]
    noise_floor = None if levels is None or measured.noise_ratio is None else \
        _noise_floor(levels, measured.noise_ratio, lambda row: base.key(int(pairs[0][row])))
    if meter:
        meter.update(2)

    def build(rows: np.ndarray) -> list[RecordDiff]:
        return record_diffs(base, other, (pairs[0][rows], pairs[1][rows]), config,
                            None if levels is None else levels[rows])

    phase_codes, phases = base.codes("phase")
    name_codes, names = base.codes("name")
    records = RecordDiffs(rank=base.rank[pairs[0]], step=base.step[pairs[0]], seq=base.seq[pairs[0]],
                          phase=phase_codes[pairs[0]], name=name_codes[pairs[0]],
                          labels=(phases.to_pylist(), names.to_pylist()), ratio=measured.ratio,
                          diverged=measured.diverged, rel_error=measured.rel_error, build=build,
                          worst_metric=WorstMetric(WORST, measured.worst, measured.worst_base, measured.worst_other,
                                                   measured.worst_null),
                          moments=measured.moments)
    only_in_base = _unmatched(base, pairs[0])
    only_in_other = _unmatched(other, pairs[1])
    zero_grads: list[tuple[RecordKey, str]] = []
    if not config.strict_zero_grads:
        only_in_base, zero_base = _split_zero_grads(only_in_base, base, other)
        only_in_other, zero_other = _split_zero_grads(only_in_other, other, base)
        zero_grads = _merge_in_order([(row, "base") for row in zero_base], [(row, "other") for row in zero_other],
                                     base, other)
    if meter:
        meter.update(3)
    report = Report(str(base.path), str(other.path), noise_label([str(run.path) for run in runs]), config, records,
                    base.keys(only_in_base), other.keys(only_in_other), base.steps_by_rank, other.steps_by_rank,
                    {"base": base.unfinished, "other": other.unfinished}, noise_unmatched=noise_unmatched,
                    zero_grads=zero_grads, renamed=renamed,
                    grad_norms={"base": _grad_norms(base), "other": _grad_norms(other)})
    report.noise_floor = noise_floor
    report.first_divergence = _first_divergence(report, base, other, only_in_base, only_in_other)
    report.operations = find_operations(base, other, pairs, records, (_in_common(only_in_base, base, other),
                                                                      _in_common(only_in_other, other, base)),
                                        report.first_divergence)
    report.first_nonfinite = {"base": _first_nonfinite(base), "other": _first_nonfinite(other)}
    if meter:
        meter.update(4)
        meter.close()
    return report


def noise_label(paths: Sequence[str]) -> str | None:
    """What a report names as its noise: the calibration run, several joined by ", ", or None."""
    return ", ".join(paths) if paths else None


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


def _merge_in_order(first: list[tuple[int, str]], second: list[tuple[int, str]], base: LoadedDump,
                    other: LoadedDump) -> list[tuple[RecordKey, str]]:
    loaded = {"base": base, "other": other}
    items = []
    for row, side in first + second:
        key = loaded[side].key(row)
        items.append((execution_order(key[1], key[2], int(loaded[side].seq[row]), key[0]), key, side))
    return [(key, side) for _, key, side in sorted(items, key=lambda item: item[0])]


def is_zero_gradient(record: Record) -> bool:
    """Whether a record is a gradient that is exactly zero everywhere, by its counts.

        is_zero_gradient({"phase": "backward", "numel": 6, "zero": 6, "nan": 0, "inf": 0})  # True

    A backward record whose ``zero`` count equals ``numel``, with no nan or inf. Records without
    these counts (a tensor the statistics could not handle) are never zero gradients.
    """
    if record.get("phase") not in GRADIENT_PHASES:
        return False
    counts = [record.get(key) for key in ("numel", "zero", "nan", "inf")]
    if not all(isinstance(count, int) and not isinstance(count, bool) for count in counts):
        return False
    numel, zero, nan, inf = counts
    return zero == numel and nan == 0 and inf == 0


def _split_zero_grads(rows: np.ndarray, has: LoadedDump, lacks: LoadedDump) -> tuple[np.ndarray, list[int]]:
    """``rows`` (records only in ``has``) split into (the rest, zero gradients of steps both runs finished).

    In a step the other run never finished, every record is missing there: that is a different step
    count, so its zero gradients stay with the rest.
    """
    candidates = _in_common(rows, has, lacks)
    if len(candidates):
        phase_codes, phases = has.codes("phase")
        gradient = np.isin(phase_codes[candidates], [i for i, p in enumerate(phases.to_pylist()) if p in GRADIENT_PHASES])
        candidates = candidates[gradient]
    zeros = [row for row, record in zip(candidates.tolist(), has.records_at(candidates)) if is_zero_gradient(record)]
    return rows[~np.isin(rows, zeros)], zeros


def _finished_in_both(rank: np.ndarray, step: np.ndarray, one: LoadedDump, other: LoadedDump) -> np.ndarray:
    """Per (rank, step): whether both runs finished it; only there is a record missing on one side a mismatch."""
    mine, theirs = one.steps_by_rank, other.steps_by_rank
    both = [(r, s) for r in set(mine) & set(theirs) for s in set(mine[r]) & set(theirs[r])]
    if not both:
        return np.zeros(len(rank), dtype=bool)
    pairs = np.array(both, np.int64)
    return np.isin(rank * (1 << 32) + step, pairs[:, 0] * (1 << 32) + pairs[:, 1])


def _in_common(rows: np.ndarray, loaded: LoadedDump, counterpart: LoadedDump) -> np.ndarray:
    """The rows (of ``loaded``, in one run only) in a (rank, step) both runs finished: divergences."""
    return rows[_finished_in_both(loaded.rank[rows], loaded.step[rows], loaded, counterpart)]


def _first_divergence(report: Report, base: LoadedDump, other: LoadedDump, only_in_base: np.ndarray,
                      only_in_other: np.ndarray) -> Divergence | None:
    """The earliest value or presence mismatch in execution order.

    A record missing on one side counts only in a (rank, step) both runs finished: a step one run
    did not reach is reported as a different step count, not as thousands of divergences.
    """
    candidates: list[tuple[tuple[int, int, int, int], Divergence]] = []
    diverged = report.records.diverged_rows()
    if len(diverged):
        first_value = report.records[int(diverged[0])]
        candidates.append((execution_order(first_value.step, first_value.phase, first_value.seq, first_value.rank),
                           first_value.divergence()))
    for rows, loaded, present, missing in ((only_in_base, base, "present", "missing"),
                                           (only_in_other, other, "missing", "present")):
        common = _in_common(rows, loaded, other if loaded is base else base)
        if len(common):  # an operation of one run only is listed, not a divergence (``Report.agrees``)
            name_codes, names = loaded.codes("name")
            is_op = np.array([op_name(name) is not None for name in names.to_pylist()], dtype=bool)
            common = common[~is_op[name_codes[common]]]
        if len(common):  # rows are in execution order: the first one in a common step is the earliest
            row = int(common[0])
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
