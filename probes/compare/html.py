"""A comparison as one self-contained HTML file: inline SVG plots, inline CSS, no scripts, no network.

    from probes.compare import write_html
    write_html(report, "compare.html")        # or: python -m probes compare BASE OTHER --html compare.html

The page shows the verdict and the first divergence, a heatmap of the relative error over
step x layer per phase (first divergence ringed), the statistic trajectories of both runs for the
layers that matter most (the first divergence's and the worst ones), the per-step summary, the
records present in one run only and, as notes, the materialised zero gradients (exactly zero in
one run, absent in the other; not divergences unless compared with strict_zero_grads). Hovering a
heatmap cell shows its numbers (SVG <title>). It reads the result model and the shared sentences
(``text.verdict``) only, never the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Iterable, Sequence

from ..utils.phases import phase_rank
from .results import relative_name
from .report import Report
from .results import ZERO_GRAD_NOTE, StepSummary
from .results import format_value
from .plots import BASE_COLOR, MARK_COLOR, OTHER_COLOR, Grid, HtmlConfig, escape, heatmap, trajectories
from .terminal import (GRAD_NORM_HEADER, damaged_lines, grad_norm_cells, kind_line, noise_floor_line, precision_table,
                       rule_line, verdict)

__all__ = ["BASE_COLOR", "MARK_COLOR", "OTHER_COLOR", "HtmlConfig", "render_html", "write_html"]


def write_html(report: Report, path: str | Path, config: HtmlConfig = HtmlConfig()) -> Path:
    """Writes the report page to ``path`` and returns the path."""
    path = Path(path)
    path.write_text(render_html(report, config), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------- page

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; } h3 { font-size: 15px; } h4 { margin: 8px 0 2px; }
.verdict { padding: 10px 14px; border-radius: 6px; font-weight: 600; }
.agree { background: #e3f6e5; border: 1px solid #5cb85c; } .diverged { background: #fde8e8; border: 1px solid #d9534f; }
table { border-collapse: collapse; margin: 8px 0; } td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.scroll { overflow-x: auto; } .note { color: #666; font-size: 12px; } .bad { color: #c00; font-weight: 600; }
svg text { font: 10px monospace; fill: #333; } svg text.title { font: bold 11px sans-serif; }
svg text.mark { font: bold 11px sans-serif; fill: #0050ff; }
.traj { display: inline-block; vertical-align: top; margin: 0 18px 12px 0; } .chart { margin-right: 4px; }
code { background: #f3f3f3; padding: 0 3px; }
"""


def _table(header: Sequence[str] | None, rows: Iterable[Sequence[Any]], numeric: Collection[int] = ()) -> str:
    head = "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in numeric else ""}>{escape(format_value(v))}</td>'
                                     for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _zero_grad_section(report: Report, limit: int = 500) -> str:
    """The notes on materialised zero gradients: which records, and which run has them."""
    shown = report.zero_grads[:limit]
    rows = [(*key, side, "other" if side == "base" else "base") for key, side in shown]
    parts = [f'<h2 id="zero-grads">Notes: {escape(ZERO_GRAD_NOTE)} ({len(report.zero_grads)})</h2>',
             '<p class="note">A gradient that is exactly zero everywhere in one run and has no record in the other '
             "(one backend materialises the zeros another leaves out). Not a divergence; compare with "
             "<code>--strict-zero-grads</code> (<code>strict_zero_grads=True</code>) to count it as one.</p>",
             _table(["rank", "step", "phase", "name", "zero in", "absent in"], rows, {0, 1})]
    if len(report.zero_grads) > len(shown):
        parts.append(f'<p class="note">{len(report.zero_grads) - len(shown)} more in the JSON report.</p>')
    return "".join(parts)


def _first_operation_section(report: Report) -> str:
    """The first diverging operation and what each record it is computed from says."""
    operations, first = report.operations, report.first_divergence
    if operations is None or first is None:
        return ""
    said = operations.first_line(first.name)
    found = operations.first
    if found is None:
        return f'<p class="kind">Operations: {escape(said)}</p>' if said else ""
    parts = ["<h3>First diverging operation</h3>",
             _table(["rank", "step", "phase", "name", "metric", "ratio"],
                    [(found.rank, found.step, found.phase, found.name, found.metric, found.ratio)], {0, 1, 5}),
             f'<p class="kind">{escape(found.explained())}</p>']
    checks = [(f"input {position}", check) for position, check in enumerate(found.inputs)]
    checks += [("gradient from", check) for check in found.gradients]
    if checks:
        parts.append(_table(["", "record", "phase", "says", "metric", "ratio", "note"],
                            [(label, check.name or "-", check.phase, check.status, check.metric, check.ratio,
                              check.note) for label, check in checks], {5}))
    return "".join(parts)


def _operations_section(report: Report, limit: int) -> str:
    """The diverged operations, each under a row of its module call (at most ``limit`` rows)."""
    operations = report.operations
    if operations is None or not operations.modules:
        return ""
    rows, shown = [], 0
    for group in operations.modules:
        if shown >= limit:
            break
        rows.append(f'<tr class="module"><td class=num>{group.rank}</td><td class=num>{group.step}</td>'
                    f'<td>{escape(group.phase)}</td><td><b>{escape(group.label)}</b></td>'
                    f'<td colspan="4">{escape(group.own())}</td></tr>')
        for found in group.ops[:max(1, limit - shown)]:
            inputs = "; ".join([*(check.describe(group.module) for check in found.inputs),
                                *(f"gradient from {check.describe(group.module)}" for check in found.gradients)])
            rows.append(f'<tr class="op"><td></td><td></td><td></td>'
                        f'<td style="padding-left: 2em">{escape(relative_name(found.name, group.module))}</td>'
                        f"<td>{escape(found.metric)}</td><td class=num>{escape(format_value(found.ratio))}</td>"
                        f"<td>{escape(found.explained())}</td><td>{escape(inputs)}</td></tr>")
        shown += 1 + len(group.ops)
    hidden = sum(1 + len(group.ops) for group in operations.modules) - shown
    head = "".join(f"<th>{escape(h)}</th>" for h in ("rank", "step", "phase", "module call / operation", "metric",
                                                     "ratio", "cause", "inputs"))
    return (f'<h2 id="operations">Diverged operations, by module call ({operations.diverged} of {operations.matched} '
            "matched op records)</h2>"
            '<p class="note">Each module call with diverged operations, its own records, then those operations in '
            "execution order: what broke, and whether an input's record already differed (propagated) or every "
            "recorded input agrees (the operation itself).</p>"
            f'<div class="scroll"><table><tr>{head}</tr>{"".join(rows)}</table></div>'
            + (f'<p class="note">{hidden} more rows in the JSON report (operations).</p>' if hidden > 0 else ""))


def _shown_steps(summaries: list[StepSummary], report: Report, limit: int) -> list[StepSummary]:
    """At most ``limit`` steps, in step order: the first divergence's, those that diverged or miss records (the
    earliest first), then those of the largest worst ratio: a long run's table stays a page."""
    if len(summaries) <= limit:
        return summaries
    first = report.first_divergence
    flagged = [i for i, s in enumerate(summaries) if s.diverged or s.only_in_base or s.only_in_other]
    rest = sorted((i for i, s in enumerate(summaries) if not (s.diverged or s.only_in_base or s.only_in_other)),
                  key=lambda i: -(summaries[i].worst.ratio if summaries[i].worst else 0.0))  # stable: earliest first
    chosen = [i for i, s in enumerate(summaries) if first is not None and s.step == first.step]
    for i in flagged + rest:
        if len(chosen) >= limit:
            break
        if i not in chosen:
            chosen.append(i)
    return [summaries[i] for i in sorted(chosen)]


def render_html(report: Report, config: HtmlConfig = HtmlConfig()) -> str:
    """The report page as a string (see the module docstring)."""
    grid = Grid.build(report)
    cfg = report.config
    first = report.first_divergence
    verdict_class = "agree" if report.agrees else "diverged"
    hows = ["map", "fuzzy", *(["op"] if any(r.how == "op" for r in report.renamed) else [])]
    floor = noise_floor_line(report)
    summary = _table(None, [
        ("base", report.base), ("other", report.other), ("noise (calibration run)", report.noise or "-"),
        *((("noise floor", floor),) if floor is not None else ()),
        ("tolerance", rule_line(report)),
        *((("per-dtype defaults", precision_table()),) if cfg.fixed is None and not cfg.exact else ()),
        ("records matched / diverged", f"{report.matched} / {report.diverged_count}"),
        ("only in base / only in other", f"{len(report.only_in_base)} / {len(report.only_in_other)}"),
        ("steps only in base / other", f"{report.steps_only_in_base or '-'} / {report.steps_only_in_other or '-'}"),
        ("materialised zero gradients (notes)", len(report.zero_grads)),
        *(((f"names of other renamed ({' / '.join(hows)})", " / ".join(str(sum(r.how == how for r in report.renamed))
                                                                       for how in hows)),)
          if report.renamed else ()),
        *((f"first non-finite value, {side}", str(anomaly) if anomaly else "none")
          for side, anomaly in report.first_nonfinite.items() if any(report.first_nonfinite.values())),
        *(("note", line) for line in damaged_lines(report)),
    ])
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>probes compare: {escape(report.base)} vs {escape(report.other)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>probes compare</h1>",
        f'<p class="verdict {verdict_class}">{escape(verdict(report))}</p>',
        summary,
        f'<p class="note">Tolerance per statistic: {escape(rule_line(report))}. Structure (shape, dtype, numel) and nan/inf counts '
        "must be equal. See docs/compare.md.</p>" if not cfg.exact else
        '<p class="note">Exact: a record agrees when it is bit-identical (its hash); one that differs in its '
        "bytes diverges, whatever the tolerances. See docs/compare.md.</p>",
    ]
    if cfg.ranks:
        parts.append("<h2>Per rank (against rank 0)</h2>")
        parts.append(_table(["rank", "verdict"], [
            (rank, ("bit-identical" if cfg.exact else "agrees") if found is None else f"first divergence at {found}")
            for rank, found in report.per_rank().items()], {0}))
    if first is not None:
        parts.append("<h2>First divergence</h2>")
        parts.append(_table(["rank", "step", "phase", "name", "seq", "metric", "base", "other", "|diff|", "rel",
                             "tolerance"],
                            [(first.rank, first.step, first.phase, first.name, first.seq, first.metric, first.base,
                              first.other, first.abs_diff, first.rel_diff, first.tolerance)], {0, 1, 4, 6, 7, 8, 9, 10}))
        if first.noise_floor is not None:
            parts.append(f'<p class="kind">Against the calibration run: {escape(first.noise_floor)} the noise '
                         "floor.</p>")
        parts.append(f'<p class="kind">What differs: {escape(kind_line(report) or "")}</p>')
        parts.append(_first_operation_section(report))
    parts.append(_operations_section(report, config.max_rows))
    parts.append("<h2>Relative error, step &times; layer</h2>")
    if not grid.rows:
        parts.append('<p class="note">No records to show.</p>')
    for phase in sorted({row[1] for row in grid.rows}, key=lambda p: phase_rank(p)):
        parts.append(heatmap(grid, phase, report, config))
    if grid.rows:
        parts.append("<h2>Statistic trajectories</h2>")
        parts.append('<p class="note">The layer of the first divergence, then the layers with the largest '
                     "|diff| / tolerance.</p>")
        parts.append(trajectories(grid, report, config))
    parts.append("<h2>Per step</h2>")
    every = report.per_step()
    summaries = _shown_steps(every, report, config.max_steps)
    norms = grad_norm_cells(summaries)
    parts.append(_table(["step", "matched", "diverged", "only in base", "only in other", "worst ratio",
                         *(GRAD_NORM_HEADER if norms else []), "worst record"],
                        [(s.step, s.matched, s.diverged, s.only_in_base, s.only_in_other,
                          s.worst.ratio if s.worst else None, *(norms[i] if norms else []),
                          f"{s.worst.phase} {s.worst.name}" if s.worst and s.worst.ratio > 0 else "-")
                         for i, s in enumerate(summaries)], set(range(8 if norms else 6))))
    if len(every) > len(summaries):
        parts.append(f'<p class="note">{len(every) - len(summaries)} more steps, all within tolerance and with every '
                     f"record in both runs, are not shown (limit {config.max_steps}); the JSON report lists every "
                     "step (per_step).</p>")
    for label, keys in (("Only in base", report.only_in_base), ("Only in other", report.only_in_other)):
        if keys:
            shown = keys[:500]
            parts.append(f"<h2>{label} ({len(keys)})</h2>")
            parts.append(_table(["rank", "step", "phase", "name"], shown, {0, 1}))
            if len(keys) > len(shown):
                parts.append(f'<p class="note">{len(keys) - len(shown)} more in the JSON report.</p>')
    if report.renamed:
        parts.append(f'<h2 id="renamed">Renamed: names of other compared as names of base ({len(report.renamed)})</h2>')
        parts.append(_table(["phase", "other", "base", "how", "confidence", "why"],
                            [(r.phase or "all", r.other, r.base, r.how, r.confidence, r.reason)
                             for r in report.renamed[:500]], {4}))
    if report.zero_grads:
        parts.append(_zero_grad_section(report))
    parts.append("</body></html>")
    return "\n".join(parts)
