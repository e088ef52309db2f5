"""The terminal summary of a comparison, and the sentences every report form shares.

    print(format_report(report, top=10))        # what python -m probes compare prints
    verdict(report)                             # "AGREE (...)", "DIVERGED at ...", "DIFFERENT RECORDS (...)"
    ranges([1, 3, 5, 6, 7])                     # "1,3,5-7 (5)": the --step syntax (options.parse_steps reads it)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ..dump.record import RecordKey
from ..utils.tables import text_table
from .options import DRIFT_GROWTH, PRECISIONS, CompareConfig
from .results import ZERO_GRAD_NOTE, RecordDiff, Report, StepSummary, format_value, op_name, relative_name

__all__ = ["GRAD_NORM_HEADER", "clip", "counts_line", "damaged_lines", "drift_lines", "format_report", "grad_norm_cells",
           "kind_line", "largest_drift", "noise_floor_line", "nonfinite_lines", "plural", "precision_table", "rank_lines",
           "ranges", "renamed_lines", "rule_line", "tolerance_name", "tolerance_rule", "verdict"]


# --------------------------------------------------------------------------------------------- shared sentences


def verdict(report: Report) -> str:
    """The verdict in one sentence; the terminal, the HTML page and ``assert_parity`` all say it this way."""
    first = report.first_divergence
    if report.agrees:
        noted = f"; {len(report.zero_grads)} {plural(len(report.zero_grads), 'materialised zero gradient')} noted" \
            if report.zero_grads else ""
        ops = len(report.ops_in_one_run)
        noted += f"; {ops} op {plural(ops, 'record')} of one run only listed" if ops else ""
        within = "bit-identical" if report.config.exact else "within tolerance"
        drift = report.drift_count
        if drift:
            within += f" or drift ({drift} {plural(drift, 'record')} grown from the step before, not divergences)"
        return f"AGREE ({report.matched} records {within}{_floor_clause(report)}{noted})"
    if first is not None:
        what = "differs in its bytes" if first.metric == "hash" else first.metric
        if first.noise_floor is not None:
            what += f", {first.noise_floor} the noise floor"
        operations = None if report.operations is None else report.operations.first_line(first.name)
        return (f"DIVERGED at rank {first.rank}, step {first.step}, {first.phase}, {format_value(first.name)} "
                f"({what})" + (f"; {operations}" if operations else ""))
    return (f"DIFFERENT RECORDS ({len(report.only_in_base)} only in base, "
            f"{len(report.only_in_other)} only in other; matched records agree)")


def largest_drift(report: Report) -> int:
    """The row of the drift record of the largest ratio (the first on ties); -1 when there is none."""
    best, found = -math.inf, -1
    for offset, chunk in report.records.chunks():
        rows = chunk.summary().drift_rows
        if len(rows) and chunk.ratio[rows].max() > best:
            top = int(np.argmax(chunk.ratio[rows]))
            best, found = float(chunk.ratio[rows][top]), offset + int(rows[top])
    return found


def drift_lines(report: Report, limit: int = 10) -> list[str]:
    """The drift records (docs/compare.md, Drift): the first ``limit`` and the largest, each with both ratios."""
    rows = report.records.drift_rows()
    if not len(rows):
        return []
    records = report.records.at(rows[:limit])
    largest = report.records[largest_drift(report)] if len(rows) > limit else None
    lines = ["", f"Drift: {len(rows)} {plural(len(rows), 'record')} beyond tolerance, each at most "
                 f"{DRIFT_GROWTH:g}x the largest ratio of its step before (the difference that step carried, grown "
                 "by training); not divergences (--strict-drift counts them):"]
    for record in [*records, *([largest] if largest is not None and all(r is not largest for r in records) else [])]:
        lines.append(f"  {_key_text(record.key, False, 48)}: ratio {_short(record.ratio)}, "
                     f"the step before {_short(record.drift)}")
    return lines + _more(len(rows), limit + (largest is not None))


def _floor_clause(report: Report) -> str:
    """For an agreeing report with a calibration run: whether every record is within its noise floor."""
    floor = report.noise_floor
    if floor is None or report.config.exact:
        return ""
    if not floor.beyond:
        return ", none beyond the noise floor"
    return f", {floor.beyond} beyond the noise floor but within {tolerance_name(report.config)}"


def noise_floor_line(report: Report) -> str | None:
    """With a calibration run: how many records are beyond their noise floor, and the first of them."""
    floor = report.noise_floor
    if floor is None or report.config.exact:
        return None
    text = (f"{floor.beyond} {plural(floor.beyond, 'record')} beyond the noise floor, {floor.within} within it"
            + (f" (largest |diff| / noise floor {format_value(floor.largest)})" if floor.largest is not None else ""))
    if floor.first_beyond is not None:
        rank, step, phase, name = floor.first_beyond
        text += f"; the first beyond it: rank {rank} step {step} {phase} {format_value(name)}"
    if floor.silent and not floor.beyond + floor.within:
        text += ("; the calibration run is identical to the base, so it measures no noise: make it with "
                 "probes.testing.perturbed_rounding (docs/compare.md, Noise floor)")
    elif floor.silent:
        text += (f"; {floor.silent} {plural(floor.silent, 'record')} identical in the calibration run "
                 f"({tolerance_name(report.config)} alone)")
    return text


def kind_line(report: Report) -> str | None:
    """What kind of divergence the first one is, in plain words ("gradients agree, the update differs")."""
    kind = report.first_divergence_kind()
    return None if kind is None else f"{kind.sentence} [{kind.code}]"


GRAD_NORM_HEADER = ["grad norm base", "grad norm other"]
_OTHER_RUN = {"base": "other", "other": "base"}
_RENAMED_BY = {"map": "the name map", "fuzzy": "fuzzy alignment", "op": "operation alignment"}  # Rename.how


def grad_norm_cells(summaries: Sequence[StepSummary]) -> list[list[str]] | None:
    """Per step the global gradient norm of base and other (the lowest rank's); None when no step has one."""
    if not any(s.grad_norm for s in summaries):
        return None
    return [["-", "-"] if s.grad_norm is None else
            ["-" if value is None else f"{value:.6g}" for value in (s.grad_norm.base, s.grad_norm.other)]
            for s in summaries]


def counts_line(report: Report) -> str:
    """"N records matched, D diverged, B only in base, O only in other"."""
    return (f"{report.matched} records matched, {report.diverged_count} diverged, "
            f"{len(report.only_in_base)} only in base, {len(report.only_in_other)} only in other")


def tolerance_name(config: CompareConfig) -> str:
    """The tolerance a statistic has without a noise floor, named: the fixed rule given, or the per-dtype default."""
    return "the per-dtype default tolerance" if config.fixed is None else "the fixed tolerance"


def tolerance_rule(config: CompareConfig) -> str:
    """The fixed part of the tolerance in words: the rule given, or the per-dtype defaults' rule."""
    if config.fixed is not None:
        rtol, atol = config.fixed
        return f"atol + rtol*|base|  (rtol {rtol:g}, atol {atol:g})"
    return ("rtol*max(|base|, rms) per value, max(passes*mtol, rtol/sqrt(numel))*max(|base|, rms) per mean, std, "
            "norm; rtol, mtol of each record's precision (its dtype or its step's least precise), rms of its tensor")


def rule_line(report: Report) -> str:
    """The rule a statistic is judged by: the fixed part (``tolerance_rule``), raised to its noise floor with
    calibration runs; or the hashes in exact mode."""
    config = report.config
    if config.exact:
        return "bit-identical bytes (the records' hashes; tolerances not used)"
    if report.noise is None:
        return f"|diff| <= {tolerance_rule(config)}"
    return (f"|diff| <= max({tolerance_rule(config)}, k*noise)  (k {config.noise_factor:g}; noise per statistic, "
            "k*noise its noise floor)")


def precision_table() -> str:
    """The per-dtype default constants in one line (config.PRECISIONS)."""
    shown = [f"{name} {p.rtol:.3g}/{p.mtol:.3g}" for name, p in PRECISIONS.items() if not name.endswith("fnuz")]
    return f"rtol/mtol {', '.join(shown)}; integers exact (docs/compare.md, Tolerance)"


def plural(count: int, note: str) -> str:
    """``note`` ("materialised zero gradient, ...") with its noun in the plural when ``count`` != 1."""
    noun, comma, rest = note.partition(",")
    return note if count == 1 else f"{noun}s{comma}{rest}"


def clip(name: str, width: int, ellipsis: str = "...") -> str:
    """``name`` cut to ``width`` characters, keeping its end (the distinctive part of a module path)."""
    return name if len(name) <= width else ellipsis + name[-(width - len(ellipsis)):]


def ranges(values: Iterable[int]) -> str:
    """Steps as "0-4,7 (6)": the --step syntax, then how many."""
    values = sorted(values)
    if not values:
        return "none"
    spans: list[list[int]] = []  # [first, last] of each run of consecutive steps
    for value in values:
        if spans and value == spans[-1][1] + 1:
            spans[-1][1] = value
        else:
            spans.append([value, value])
    return f"{','.join(str(a) if a == b else f'{a}-{b}' for a, b in spans)} ({len(values)})"


# --------------------------------------------------------------------------------------------- terminal


def _short(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2g}" if value != 0 else "0"


def _name(name: str, width: int = 48) -> str:
    return clip(format_value(name), width)


def _record_rows(records: Sequence[RecordDiff], mark: RecordKey | None, with_rank: bool,
                 nest: bool = False) -> list[list[str]]:
    """A row per record; ``nest``: op records under a row naming their module call, by their short names."""
    rows = []
    site = None
    for record in records:
        worst = record.worst
        parsed = op_name(record.name) if nest else None
        if parsed is not None and (record.rank, record.step, record.phase, parsed.site) != site:
            site = (record.rank, record.step, record.phase, parsed.site)
            label = f"{parsed.module}{f'#{parsed.call}' if parsed.call else ''}/"
            rows.append(["", *([""] if with_rank else []), "", "", "", _name(label), *[""] * 7])
        elif parsed is None:
            site = None
        row = [">>" if record.key == mark else ("x" if record.diverged else "")]
        if with_rank:
            row.append(str(record.rank))
        row += [str(record.step), record.phase, str(record.seq),
                _name(record.name) if parsed is None else "  " + _name(parsed.short, 46)]
        if worst is None:
            row += ["-"] * 5
        else:
            row += [worst.metric if record.ratio > 0 else "equal", format_value(worst.base),
                    format_value(worst.other), _short(worst.abs_diff), _short(worst.rel_diff)]
        row += [_short(record.ratio), f"{record.samples_cosine:.6f}" if record.samples_cosine is not None else "-"]
        rows.append(row)
    return rows


def _record_table(records: Sequence[RecordDiff], report: Report, with_rank: bool, nest: bool = False) -> list[str]:
    """The records as a table, the first divergence marked ">>"."""
    first = report.first_divergence
    mark = None if first is None else (first.rank, first.step, first.phase, first.name)
    header = ["", *(["rank"] if with_rank else []), "step", "phase", "seq", "name", "worst", "base", "other",
              "|diff|", "rel", "ratio", "cos"]
    offset = 1 if with_rank else 0
    right = {1 + offset, 3 + offset, *range(6 + offset, 12 + offset)}
    return text_table(header, _record_rows(records, mark, with_rank, nest), right=right, indent="  ")


def _steps_text(steps: Mapping[int, list[int]]) -> str:
    parts = [f"rank {rank}: {ranges(by_rank)}" for rank, by_rank in sorted(steps.items())]
    return "; ".join(parts) if parts else "no finished steps"


def _header(report: Report) -> list[str]:
    """Runs, tolerance, filters, counts and notes."""
    config = report.config
    lines = ["probes compare",
             f"  base   {report.base}   {_steps_text(report.base_steps)}",
             f"  other  {report.other}   {_steps_text(report.other_steps)}"]
    if report.noise is not None:
        lines.append(f"  noise  {report.noise}   ({report.noise_unmatched} compared records had no noise counterpart)")
    lines.append(f"  {'exact' if config.exact else 'tolerance'}  {rule_line(report)}")
    if not config.exact and config.fixed is None:
        lines.append(f"  defaults  {precision_table()}")
    if config.ranks:
        lines.append(f"  ranks  every rank of {report.base} against its rank 0; phases "
                     f"{', '.join(config.phases) if config.phases is not None else 'all'}")
    elif config.phases is not None:
        lines.append(f"  phases  {', '.join(config.phases)}")
    if config.steps is not None or config.names:
        lines.append(f"  filters  steps {ranges(config.steps) if config.steps is not None else 'all'}; "
                     f"names {' '.join(config.names) or '*'}")
    lines += [f"  note: {side} rank {rank} has unfinished steps {ranges(steps)} (not compared)"
              for side, ranks in report.unfinished.items() for rank, steps in ranks.items()]
    lines.append(f"  {counts_line(report)}")
    floor = noise_floor_line(report)
    if floor is not None:
        lines.append(f"  noise floor: {floor}")
    if report.steps_only_in_base or report.steps_only_in_other:
        lines.append(f"  different step counts: steps only in base {ranges(report.steps_only_in_base)}, "
                     f"only in other {ranges(report.steps_only_in_other)}")
    if report.renamed:
        by_how = Counter(r.how for r in report.renamed)
        lines.append("  names: " + ", ".join(f"{by_how[how]} {plural(by_how[how], 'name')} of other renamed by {label}"
                                             for how, label in _RENAMED_BY.items() if by_how[how]) + " (listed below)")
    if report.zero_grads:
        lines.append(f"  note: {len(report.zero_grads)} {plural(len(report.zero_grads), ZERO_GRAD_NOTE)} "
                     "(not counted as divergences; --strict-zero-grads counts them)")
    lines += [f"  note: {line}" for line in damaged_lines(report)]
    return lines


def damaged_lines(report: Report) -> list[str]:
    """One sentence per run with damaged step files left out (``--skip-damaged``)."""
    return [f"{side} has {len(items)} damaged step {plural(len(items), 'file')}, "
            f"{'left out' if side == 'noise' else 'its steps left out of both runs'} (--skip-damaged): "
            + "; ".join(map(str, items))
            for side, items in report.damaged.items() if items]


def _first_divergence(report: Report, with_rank: bool) -> list[str]:
    """The first divergence and the matched records around it in execution order."""
    first = report.first_divergence
    if first is None:
        return []
    lines = ["", f"FIRST DIVERGENCE  rank {first.rank}  step {first.step}  {first.phase}  "
                 f"{format_value(first.name)}  (seq {first.seq})",
             f"  {first.metric}: base {format_value(first.base)}  other {format_value(first.other)}"
             + ("  (differs in its bytes)" if first.metric == "hash" else
                f"  |diff| {format_value(first.abs_diff)}  rel {format_value(first.rel_diff)}  "
                f"tolerance {format_value(first.tolerance)}" if first.abs_diff is not None else "")
             + (f"  ({first.noise_floor} the noise floor)" if first.noise_floor is not None else ""),
             f"  kind: {kind_line(report)}", *_first_operation(report)]
    neighbours = report.records.at(report.records.rows_where(rank=first.rank, step=first.step, phase=first.phase))
    at = next((i for i, r in enumerate(neighbours) if r.name == first.name), None)
    if at is None:  # a missing record: show the matched records that precede it
        at = sum(1 for r in neighbours if (r.seq or 0) < (first.seq or 0))
    window = neighbours[max(0, at - 3): at + 8]
    if window:
        lines += ["", f"Around the first divergence (rank {first.rank}, step {first.step}, {first.phase}, "
                      "in execution order; x = diverged" + ("; operations under their module" if
                                                           report.operations is not None else "") + "):"]
        lines += _record_table(window, report, with_rank, nest=report.operations is not None)
    return lines


def _first_operation(report: Report) -> list[str]:
    """The first diverging operation and what each record it is computed from says."""
    operations, first = report.operations, report.first_divergence
    said = None if operations is None or first is None else operations.first_line(first.name)
    if said is None:
        return []
    found = operations.first
    if found is None:
        return [f"  operations: {said}"]
    lines = [f"  operation: {said}" if found.name == first.name else f"  {format_value(said)}"]
    lines += [f"    {label}: {check.describe()}" for label, check in found.sources()]
    return lines


def _operation_lines(report: Report, limit: int = 10) -> list[str]:
    """The diverged operations under their module calls (at most ``limit`` calls, ``limit`` operations each)."""
    operations = report.operations
    if operations is None or not operations.modules:
        return []
    lines = ["", f"Diverged operations, by module call ({operations.diverged} of {operations.matched} matched op "
                 "records diverged; execution order):"]
    for group in operations.modules[:limit]:
        lines.append(f"  rank {group.rank} step {group.step} {group.phase}  {format_value(group.label)}  "
                     f"({group.own()})")
        rows = [[_name(relative_name(found.name, group.module)), found.metric, f"ratio {found.ratio:.3g}",
                 found.explained()] for found in group.ops[:limit]]
        lines += text_table(["operation", "worst", "", "cause"], rows, indent="    ")[1:]
        lines += _more(len(group.ops), limit, "    ")
    return lines + _more(len(operations.modules), limit, "  ", " module calls")


def _more(count: int, limit: int, indent: str = "  ", what: str = "") -> list[str]:
    """The line saying how many of ``count`` items a list cut at ``limit`` leaves to the JSON report."""
    return [f"{indent}... {count - limit} more{what} (see --json)"] if count > limit else []


def _per_step(report: Report) -> list[str]:
    summaries = report.per_step()
    shown = [s for s in summaries if s.differs][:20] \
        if len(summaries) > 20 else summaries
    if not shown:
        return []
    norms = grad_norm_cells(shown)
    header = ["step", "matched", "diverged", "only base", "only other", "worst ratio",
              *(GRAD_NORM_HEADER if norms else []), "worst record"]
    rows = [[str(s.step), str(s.matched), str(s.diverged), str(s.only_in_base), str(s.only_in_other),
             _short(s.worst.ratio) if s.worst else "-", *(norms[i] if norms else []),
             f"{s.worst.phase} {_name(s.worst.name, 40)}" if s.worst and s.worst.ratio > 0 else "-"]
            for i, s in enumerate(shown)]
    return ["", "Per step" + (" (steps with differences only)" if len(shown) < len(summaries) else "") + ":",
            *text_table(header, rows, right=set(range(len(header) - 1)), indent="  ")]


def _key_text(key: RecordKey, with_rank: bool, width: int) -> str:
    return f"{'r%d ' % key[0] if with_rank else ''}s{key[1]} {key[2]} {_name(key[3], width)}"


def format_report(report: Report, top: int = 10) -> str:
    """The terminal summary: runs, tolerance, first divergence, records around it, worst records, steps."""
    with_rank = len(set(report.base_steps) | set(report.other_steps)) > 1
    lines = _header(report) + _first_divergence(report, with_rank)
    worst = report.records.worst(top)
    if worst:
        lines += ["", "Worst records (ratio = |diff| / tolerance):", *_record_table(worst, report, with_rank)]
    for label, keys in (("only in base", report.only_in_base), ("only in other", report.only_in_other)):
        if keys:
            shown = ", ".join(_key_text(key, with_rank, 40) for key in keys[:5])
            lines += ["", f"{len(keys)} records {label}: {shown}{' ...' if len(keys) > 5 else ''}"]
    if report.zero_grads:
        lines += ["", f"Notes ({ZERO_GRAD_NOTE}):"]
        lines += [f"  {_key_text(key, with_rank, 60)}: zero in {side}, absent in {_OTHER_RUN[side]}"
                  for key, side in report.zero_grads[:10]] + _more(len(report.zero_grads), 10)
    lines += [*_operation_lines(report), *renamed_lines(report), *drift_lines(report), *_per_step(report),
              *rank_lines(report),
              *nonfinite_lines(report), "", f"verdict: {verdict(report)}"]
    return "\n".join(lines)


def rank_lines(report: Report) -> list[str]:
    """With ``ranks``: per rank, whether it agrees with rank 0, or its first divergence."""
    if not report.config.ranks:
        return []
    agree = "bit-identical to rank 0" if report.config.exact else "agrees with rank 0"
    return ["", "Per rank (against rank 0):"] + [
        f"  rank {rank}: {agree if first is None else f'first divergence at {first}'}"
        for rank, first in report.per_rank().items()]


def nonfinite_lines(report: Report) -> list[str]:
    """Where each run saw its first nan or inf (nothing when neither did)."""
    if not any(report.first_nonfinite.values()):
        return []
    return ["", "First non-finite value (execution order, across ranks):"] + [
        f"  {side}: {anomaly if anomaly else 'none'}" for side, anomaly in report.first_nonfinite.items()]


def renamed_lines(report: Report, limit: int = 20) -> list[str]:
    """Which names of OTHER were compared as which names of BASE, and how sure the pairing is."""
    if not report.renamed:
        return []
    return (["", "Renamed (other -> base):"] + [f"  {rename}" for rename in report.renamed[:limit]]
            + _more(len(report.renamed), limit))
