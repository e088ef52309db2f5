"""A comparison as one self-contained HTML file: inline SVG plots, inline CSS, no scripts, no network.

    from probes.compare import write_html
    write_html(report, "compare.html")        # or: python -m probes compare BASE OTHER --html compare.html

The page shows the verdict and the first divergence, a heatmap of the relative error over
step x layer per phase (first divergence ringed), the statistic trajectories of both runs for the
layers that matter most (the first divergence's and the worst ones), the per-step summary, the
records present in one run only and, as notes, the materialised zero gradients (exactly zero in
one run, absent in the other; not divergences unless compared with strict_zero_grads). Hovering a heatmap cell shows its numbers (SVG <title>).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Sequence

from .engine import MOMENTS, PHASE_ORDER, ZERO_GRAD_NOTE, Key, RecordDiff, Report

__all__ = ["HtmlConfig", "render_html", "write_html"]

BASE_COLOR = "#1f77b4"
OTHER_COLOR = "#ff7f0e"
MARK_COLOR = "#0050ff"  # the first divergence: blue stands out on the yellow-red heatmap
MISSING_COLOR = "#b8b8b8"
EQUAL_COLOR = "#f4f4f4"
# YlOrRd: pale for tiny relative errors, dark red for errors of order one.
HEAT_STOPS = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#b10026")
HEAT_LOG_RANGE = (-9.0, 0.0)  # log10 of the relative error mapped onto the palette

Row = tuple[int, str, str]  # rank, phase, name


@dataclass(frozen=True)
class HtmlConfig:
    """Size limits of the page: big dumps are reduced, never dropped silently (the page says so)."""

    max_rows: int = 300  # heatmap rows per phase; the worst rows and the first divergence are kept
    max_columns: int = 200  # heatmap columns; more steps are binned (a cell shows the worst of its bin)
    max_cells: int = 15000  # per heatmap: fewer columns for many rows, to keep the page light
    trajectories: int = 6  # layers with trajectory plots


def write_html(report: Report, path: str | Path, config: HtmlConfig = HtmlConfig()) -> Path:
    """Writes the report page to ``path`` and returns the path."""
    path = Path(path)
    path.write_text(render_html(report, config), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------- data


@dataclass
class _Grid:
    """Records by row and step; rows in execution order (phase, rank, the base's seq)."""

    rows: list[Row]
    steps: list[int]
    cells: dict[tuple[Row, int], RecordDiff | str]  # a RecordDiff, or "only in base" / "only in other"
    ratios: dict[Row, float]  # the largest |diff| / tolerance of each row over the steps

    @classmethod
    def build(cls, report: Report) -> "_Grid":
        cells: dict[tuple[Row, int], RecordDiff | str] = {}
        order: dict[Row, tuple[int, int, int, int]] = {}

        def place(key: Key, value: RecordDiff | str, seq: int) -> None:
            rank, step, phase, name = key
            row = (rank, phase, name)
            cells[(row, step)] = value
            position = (PHASE_ORDER.get(phase, len(PHASE_ORDER)), rank, step, seq)
            if row not in order or position < order[row]:
                order[row] = position

        for record in report.records:
            place(record.key, record, record.seq)
        for label, keys in (("only in base", report.only_in_base), ("only in other", report.only_in_other)):
            for index, key in enumerate(keys):
                place(key, label, 1 << 30 | index)
        # A row's place is its seq at its earliest step, so rows follow the execution order of one step.
        rows = sorted(order, key=lambda row: (order[row][0], order[row][1], order[row][3]))
        steps = sorted({step for _, step in cells})
        ratios = dict.fromkeys(rows, 0.0)
        for record in report.records:
            row = (record.rank, record.phase, record.name)
            ratios[row] = max(ratios[row], record.ratio)
        return cls(rows, steps, cells, ratios)

    def row_ratio(self, row: Row) -> float:
        return self.ratios[row]


def _heat_color(record: RecordDiff) -> str:
    value = record.rel_error
    if record.diverged and not value:
        value = math.inf  # broke on a count, the structure or the samples: show it as large
    if value == 0:
        return EQUAL_COLOR
    low, high = HEAT_LOG_RANGE
    t = 1.0 if math.isinf(value) else min(max((math.log10(value) - low) / (high - low), 0.0), 1.0)
    return _interpolate(HEAT_STOPS, t)


def _interpolate(stops: Sequence[str], t: float) -> str:
    position = t * (len(stops) - 1)
    index = min(int(position), len(stops) - 2)
    frac = position - index
    a, b = (tuple(int(stop[i:i + 2], 16) for i in (1, 3, 5)) for stop in (stops[index], stops[index + 1]))
    return "#" + "".join(f"{round(x + (y - x) * frac):02x}" for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------- svg


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _clip(name: str, width: int) -> str:
    return name if len(name) <= width else "\u2026" + name[-(width - 1):]


def _row_label(row: Row, multi_rank: bool) -> str:
    rank, _, name = row
    return (f"r{rank} " if multi_rank else "") + name


def _cell_title(row: Row, step: int | str, cell: RecordDiff | str | None) -> str:
    rank, phase, name = row
    where = f"rank {rank} step {step} {phase} {name}"
    if cell is None:
        return f"{where}: not recorded by either run"
    if isinstance(cell, str):
        return f"{where}: {cell}"
    worst = cell.worst
    text = f"{where}: relative error {cell.rel_error:.3g}"
    if worst is not None:
        text += f"; worst {worst.metric} {_num(worst.base)} vs {_num(worst.other)}, ratio {worst.ratio:.3g}"
    return text + ("; DIVERGED" if cell.diverged else "")


def _heatmap(grid: _Grid, phase: str, report: Report, config: HtmlConfig) -> str:
    rows = [row for row in grid.rows if row[1] == phase]
    first = report.first_divergence
    first_row = (first.rank, first.phase, first.name) if first else None
    omitted = 0
    if len(rows) > config.max_rows:
        ranked = sorted(rows, key=lambda row: (row != first_row, -grid.row_ratio(row)))  # stable sort
        keep = set(ranked[:config.max_rows])
        omitted = len(rows) - len(keep)
        rows = [row for row in rows if row in keep]
    max_columns = min(config.max_columns, max(20, config.max_cells // max(1, len(rows))))
    bin_size = max(1, math.ceil(len(grid.steps) / max_columns))
    columns = [grid.steps[i:i + bin_size] for i in range(0, len(grid.steps), bin_size)]
    multi_rank = len({row[0] for row in grid.rows}) > 1
    label_width = 8 + 6.2 * min(48, max((len(_row_label(r, multi_rank)) for r in rows), default=10))
    cell_w = min(36.0, max(8.0, 860.0 / max(1, len(columns))))
    cell_h = 14.0
    top = 34.0
    width = max(label_width + cell_w * len(columns) + 140, 720.0)  # at least the legend's width
    height = top + cell_h * len(rows) + 50
    parts = [f'<svg class="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="relative error heatmap, {phase}">']
    label_every = max(1, math.ceil(len(columns) / 20))
    for c, column in enumerate(columns):
        if c % label_every == 0:
            label = str(column[0]) if len(column) == 1 else f"{column[0]}-{column[-1]}"
            x = label_width + cell_w * (c + 0.5)
            parts.append(f'<text x="{x:.1f}" y="{top - 8:.1f}" class="axis" text-anchor="middle">{_e(label)}</text>')
    parts.append(f'<text x="{label_width:.1f}" y="12" class="axis">step \u2192</text>')
    marked = None
    for r, row in enumerate(rows):
        y = top + r * cell_h
        parts.append(f'<text x="{label_width - 6:.1f}" y="{y + cell_h - 3.5:.1f}" class="label" text-anchor="end">'
                     f'{_e(_clip(_row_label(row, multi_rank), 48))}</text>')
        for c, column in enumerate(columns):
            x = label_width + c * cell_w
            cell = _bin_cell(grid, row, column)
            step_label = column[0] if len(column) == 1 else f"{column[0]}-{column[-1]}"
            if cell is None:
                fill, stroke = "#ffffff", ""
            elif isinstance(cell, str):
                fill, stroke = MISSING_COLOR, ' stroke="#555" stroke-dasharray="2,2"'
            else:
                fill = _heat_color(cell)
                stroke = ' stroke="#000" stroke-width="1.2"' if cell.diverged else ""
            parts.append(f'<rect class="cell" x="{x:.1f}" y="{y:.1f}" width="{cell_w - 1:.1f}" '
                         f'height="{cell_h - 1:.1f}" fill="{fill}"{stroke}>'
                         f'<title>{_e(_cell_title(row, step_label, cell))}</title></rect>')
            if first is not None and row == first_row and first.step in column:
                marked = (x, y)
    if marked is not None:
        x, y = marked
        parts.append(f'<rect class="first-divergence" x="{x - 2:.1f}" y="{y - 2:.1f}" width="{cell_w + 3:.1f}" '
                     f'height="{cell_h + 3:.1f}" fill="none" stroke="{MARK_COLOR}" stroke-width="3"/>')
        label_x = label_width + cell_w * len(columns) + 8
        parts.append(f'<line x1="{x + cell_w + 1:.1f}" y1="{y + cell_h / 2:.1f}" x2="{label_x - 2:.1f}" '
                     f'y2="{y + cell_h / 2:.1f}" stroke="{MARK_COLOR}" stroke-width="1.5"/>')
        parts.append(f'<text x="{label_x:.1f}" y="{y + cell_h - 3:.1f}" class="mark">first divergence</text>')
    parts.append(_heat_legend(8, top + cell_h * len(rows) + 16))
    parts.append("</svg>")
    notes = []
    if omitted:
        notes.append(f"{omitted} rows with the smallest errors are not shown (limit {config.max_rows}).")
    if bin_size > 1:
        notes.append(f"Each column covers {bin_size} steps and shows the worst record of its steps.")
    note_html = "".join(f'<p class="note">{_e(note)}</p>' for note in notes)
    return f'<h3>{_e(phase)}</h3>{note_html}<div class="scroll">{"".join(parts)}</div>'


def _bin_cell(grid: _Grid, row: Row, steps: Sequence[int]) -> RecordDiff | str | None:
    cells = [grid.cells.get((row, step)) for step in steps]
    records = [c for c in cells if isinstance(c, RecordDiff)]
    if records:
        return max(records, key=lambda rec: (rec.diverged, rec.rel_error, rec.ratio))
    return next((c for c in cells if c is not None), None)


def _heat_legend(x: float, y: float) -> str:
    parts = [f'<text x="{x:.1f}" y="{y + 9:.1f}" class="axis">relative error of min/max/mean/std:</text>']
    x0, bar_w = x + 240, 200.0
    for i in range(40):
        color = _interpolate(HEAT_STOPS, i / 39)
        parts.append(f'<rect x="{x0 + i * bar_w / 40:.1f}" y="{y:.1f}" width="{bar_w / 40 + 0.5:.1f}" height="10" '
                     f'fill="{color}"/>')
    low, high = HEAT_LOG_RANGE
    for exponent in range(int(low), int(high) + 1, 3):
        tx = x0 + (exponent - low) / (high - low) * bar_w
        parts.append(f'<text x="{tx:.1f}" y="{y + 22:.1f}" class="axis" text-anchor="middle">1e{exponent}</text>')
    x1 = x0 + bar_w + 20
    parts.append(f'<rect x="{x1:.1f}" y="{y:.1f}" width="10" height="10" fill="{EQUAL_COLOR}" stroke="#999"/>'
                 f'<text x="{x1 + 14:.1f}" y="{y + 9:.1f}" class="axis">equal</text>')
    parts.append(f'<rect x="{x1 + 60:.1f}" y="{y:.1f}" width="10" height="10" fill="#fff" stroke="#000"/>'
                 f'<text x="{x1 + 74:.1f}" y="{y + 9:.1f}" class="axis">diverged (outlined)</text>')
    parts.append(f'<rect x="{x1 + 190:.1f}" y="{y:.1f}" width="10" height="10" fill="{MISSING_COLOR}"/>'
                 f'<text x="{x1 + 204:.1f}" y="{y + 9:.1f}" class="axis">one run only</text>')
    return "".join(parts)


def _line_chart(title: str, steps: Sequence[int], series: Sequence[tuple[str, str, list[Any], str]],
                mark_step: int | None, diverged_steps: set[int]) -> str:
    """A small SVG line chart of values over steps; ``series``: (label, color, values, dash)."""
    width, height = 230.0, 130.0
    left, right, top, bottom = 52.0, 8.0, 18.0, 20.0
    values = [v for _, _, vals, _ in series for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}">',
             f'<text x="{left:.0f}" y="12" class="title">{_e(title)}</text>',
             f'<rect x="{left:.0f}" y="{top:.0f}" width="{width - left - right:.0f}" '
             f'height="{height - top - bottom:.0f}" fill="#fafafa" stroke="#ddd"/>']
    if not values or not steps:
        parts.append(f'<text x="{left + 10:.0f}" y="{top + 30:.0f}" class="axis">no values</text></svg>')
        return "".join(parts)
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(lo) * 0.01 or 1.0
        lo, hi = lo - pad, hi + pad
    s0, s1 = steps[0], steps[-1]

    def sx(step: int) -> float:
        return left + 6 + (width - left - right - 12) * ((step - s0) / (s1 - s0) if s1 != s0 else 0.5)

    def sy(value: float) -> float:
        return top + 4 + (height - top - bottom - 8) * (1 - (value - lo) / (hi - lo))

    parts.append(f'<text x="{left - 4:.0f}" y="{top + 8:.0f}" class="axis" text-anchor="end">{hi:.4g}</text>')
    parts.append(f'<text x="{left - 4:.0f}" y="{height - bottom:.0f}" class="axis" text-anchor="end">{lo:.4g}</text>')
    parts.append(f'<text x="{sx(s0):.1f}" y="{height - 6:.0f}" class="axis" text-anchor="middle">{s0}</text>')
    if s1 != s0:
        parts.append(f'<text x="{sx(s1):.1f}" y="{height - 6:.0f}" class="axis" text-anchor="middle">{s1}</text>')
    if mark_step is not None and s0 <= mark_step <= s1:
        x = sx(mark_step)
        parts.append(f'<line class="divergence-step" x1="{x:.1f}" y1="{top:.0f}" x2="{x:.1f}" y2="{height - bottom:.0f}" '
                     f'stroke="{MARK_COLOR}" stroke-width="1.5" stroke-dasharray="4,3"/>')
    for label, color, vals, dash in series:
        points = [(sx(step), sy(v)) for step, v in zip(steps, vals)
                  if isinstance(v, (int, float)) and math.isfinite(v)]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash_attr}>'
                         f'<title>{_e(label)}</title></polyline>')
        for step, v in zip(steps, vals):
            if isinstance(v, (int, float)) and math.isfinite(v):
                bad = label == "other" and step in diverged_steps
                parts.append(f'<circle cx="{sx(step):.1f}" cy="{sy(v):.1f}" r="{3.2 if bad else 2.4}" '
                             f'fill="{"#d00" if bad else color}"><title>{_e(label)} step {step}: {v:.6g}</title>'
                             f'</circle>')
    parts.append("</svg>")
    return "".join(parts)


def _trajectory_rows(grid: _Grid, report: Report, count: int) -> list[Row]:
    first = report.first_divergence
    chosen: list[Row] = []
    if first is not None and (first.rank, first.phase, first.name) in grid.rows:
        chosen.append((first.rank, first.phase, first.name))
    ranked = sorted(grid.rows, key=grid.row_ratio, reverse=True)  # stable: ties keep execution order
    for row in ranked:
        if len(chosen) >= count:
            break
        if row not in chosen:
            chosen.append(row)
    return chosen


def _trajectories(grid: _Grid, report: Report, config: HtmlConfig) -> str:
    first = report.first_divergence
    multi_rank = len({row[0] for row in grid.rows}) > 1
    blocks = []
    for row in _trajectory_rows(grid, report, config.trajectories):
        cells = {step: grid.cells.get((row, step)) for step in grid.steps}
        records = {step: cell for step, cell in cells.items() if isinstance(cell, RecordDiff)}
        steps = sorted(records)
        diverged = {step for step, record in records.items() if record.diverged}
        mark = first.step if first is not None and (first.rank, first.phase, first.name) == row else None
        charts = []
        for stat in MOMENTS:
            series = [("base", BASE_COLOR, [records[s].value("base", stat) for s in steps], ""),
                      ("other", OTHER_COLOR, [records[s].value("other", stat) for s in steps], "5,3")]
            charts.append(_line_chart(stat, steps, series, mark, diverged))
        heading = f"{row[1]} {_row_label(row, multi_rank)}"
        flag = ' <span class="bad">first divergence</span>' if mark is not None else ""
        blocks.append(f'<div class="traj"><h4>{_e(heading)}{flag}</h4>{"".join(charts)}</div>')
    legend = (f'<p class="legend"><svg width="260" height="14" xmlns="http://www.w3.org/2000/svg">'
              f'<rect class="swatch-base" x="0" y="2" width="22" height="10" fill="{BASE_COLOR}"/>'
              f'<text x="28" y="11" class="axis">base</text>'
              f'<rect class="swatch-other" x="70" y="2" width="22" height="10" fill="{OTHER_COLOR}"/>'
              f'<text x="98" y="11" class="axis">other (dashed)</text>'
              f'<circle cx="196" cy="7" r="4" fill="#d00"/><text x="204" y="11" class="axis">diverged</text></svg>'
              f'<span> Blue dashed line: the step of the first divergence.</span></p>')
    return legend + "".join(blocks)


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
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in numeric else ""}>{_e(_num(v))}</td>'
                                     for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _zero_grad_section(report: Report, limit: int = 500) -> str:
    """The notes on materialised zero gradients: which records, and which run has them."""
    shown = report.zero_grads[:limit]
    rows = [(*key, side, "other" if side == "base" else "base") for key, side in shown]
    parts = [f'<h2 id="zero-grads">Notes: {_e(ZERO_GRAD_NOTE)} ({len(report.zero_grads)})</h2>',
             '<p class="note">A gradient that is exactly zero everywhere in one run and has no record in the other '
             "(one backend materialises the zeros another leaves out). Not a divergence; compare with "
             "<code>--strict-zero-grads</code> (<code>strict_zero_grads=True</code>) to count it as one.</p>",
             _table(["rank", "step", "phase", "name", "zero in", "absent in"], rows, {0, 1})]
    if len(report.zero_grads) > len(shown):
        parts.append(f'<p class="note">{len(report.zero_grads) - len(shown)} more in the JSON report.</p>')
    return "".join(parts)


def render_html(report: Report, config: HtmlConfig = HtmlConfig()) -> str:
    """The report page as a string (see the module docstring)."""
    grid = _Grid.build(report)
    cfg = report.config
    first = report.first_divergence
    verdict_class = "agree" if report.agrees else "diverged"
    if report.agrees:
        verdict = f"AGREE: {report.matched} records within tolerance"
        if report.zero_grads:
            verdict += f" ({len(report.zero_grads)} materialised zero gradients noted)"
    elif first is not None:
        verdict = f"DIVERGED at rank {first.rank}, step {first.step}, {first.phase}, {first.name} ({first.metric})"
    else:
        verdict = "DIFFERENT RECORDS: some records exist in one run only"
    rule = "|diff| &le; atol + rtol&middot;|base|"
    if report.noise is not None:
        rule = "|diff| &le; max(atol + rtol&middot;|base|, k&middot;noise)"
    diverged = sum(r.diverged for r in report.records)
    summary = _table(None, [
        ("base", report.base), ("other", report.other), ("noise (second baseline)", report.noise or "-"),
        ("rtol / atol / k", f"{cfg.rtol:g} / {cfg.atol:g} / {cfg.noise_factor:g}"),
        ("records matched / diverged", f"{report.matched} / {diverged}"),
        ("only in base / only in other", f"{len(report.only_in_base)} / {len(report.only_in_other)}"),
        ("steps only in base / other", f"{report.steps_only_in_base or '-'} / {report.steps_only_in_other or '-'}"),
        ("materialised zero gradients (notes)", len(report.zero_grads)),
    ])
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>probes compare: {_e(report.base)} vs {_e(report.other)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>probes compare</h1>",
        f'<p class="verdict {verdict_class}">{_e(verdict)}</p>',
        summary,
        f'<p class="note">Tolerance per statistic: {rule}. Structure (shape, dtype, numel) and nan/inf counts '
        "must be equal. See docs/compare.md.</p>",
    ]
    if first is not None:
        parts.append("<h2>First divergence</h2>")
        parts.append(_table(["rank", "step", "phase", "name", "seq", "metric", "base", "other", "|diff|", "rel",
                             "tolerance"],
                            [(first.rank, first.step, first.phase, first.name, first.seq, first.metric, first.base,
                              first.other, first.abs_diff, first.rel_diff, first.tolerance)], {0, 1, 4, 6, 7, 8, 9, 10}))
    parts.append("<h2>Relative error, step &times; layer</h2>")
    if not grid.rows:
        parts.append('<p class="note">No records to show.</p>')
    for phase in sorted({row[1] for row in grid.rows}, key=lambda p: PHASE_ORDER.get(p, len(PHASE_ORDER))):
        parts.append(_heatmap(grid, phase, report, config))
    if grid.rows:
        parts.append("<h2>Statistic trajectories</h2>")
        parts.append('<p class="note">The layer of the first divergence, then the layers with the largest '
                     "|diff| / tolerance.</p>")
        parts.append(_trajectories(grid, report, config))
    parts.append("<h2>Per step</h2>")
    parts.append(_table(["step", "matched", "diverged", "only in base", "only in other", "worst ratio", "worst record"],
                        [(s.step, s.matched, s.diverged, s.only_in_base, s.only_in_other,
                          s.worst.ratio if s.worst else None,
                          f"{s.worst.phase} {s.worst.name}" if s.worst and s.worst.ratio > 0 else "-")
                         for s in report.per_step()], {0, 1, 2, 3, 4, 5}))
    for label, keys in (("Only in base", report.only_in_base), ("Only in other", report.only_in_other)):
        if keys:
            shown = keys[:500]
            parts.append(f"<h2>{label} ({len(keys)})</h2>")
            parts.append(_table(["rank", "step", "phase", "name"], shown, {0, 1}))
            if len(keys) > len(shown):
                parts.append(f'<p class="note">{len(keys) - len(shown)} more in the JSON report.</p>')
    if report.zero_grads:
        parts.append(_zero_grad_section(report))
    parts.append("</body></html>")
    return "\n".join(parts)
