"""A comparison as one self-contained HTML file: inline SVG plots, inline CSS, no scripts, no network.

    from probes.compare import write_html
    write_html(report, "compare.html")        # or: python -m probes compare BASE OTHER --html compare.html

The page shows the verdict and the first divergence, a heatmap of the relative error over step x layer per phase
(``Grid``, ``heatmap``; the first divergence ringed, a cell's numbers on hover), the statistic trajectories of
both runs for the layers that matter most (``trajectories``), the per-step summary, the records of one run only
and the materialised zero gradients. It reads the result model and the shared sentences (``terminal``) only.
"""

from __future__ import annotations

import functools
import html
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Sequence

import numpy as np

from ..utils.phases import phase_rank
from .options import DRIFT_GROWTH, MOMENTS
from .recorddiffs import RecordDiffs, Row
from .results import ZERO_GRAD_NOTE, CellView, Divergence, Report, StepSummary, format_value, relative_name
from .terminal import (GRAD_NORM_HEADER, clip, damaged_lines, grad_norm_cells, kind_line, noise_floor_line,
                       precision_table, rule_line, verdict)

__all__ = ["BASE_COLOR", "MARK_COLOR", "OTHER_COLOR", "Grid", "HtmlConfig", "escape", "heatmap", "render_html",
           "trajectories", "write_html"]

BASE_COLOR = "#1f77b4"
OTHER_COLOR = "#ff7f0e"
MARK_COLOR = "#0050ff"  # the first divergence: blue stands out on the yellow-red heatmap
MISSING_COLOR = "#b8b8b8"
EQUAL_COLOR = "#f4f4f4"
# YlOrRd: pale for tiny relative errors, dark red for errors of order one.
HEAT_STOPS = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#b10026")
HEAT_LOG_RANGE = (-9.0, 0.0)  # log10 of the relative error mapped onto the palette

ELLIPSIS = "\u2026"


@dataclass(frozen=True)
class HtmlConfig:
    """Size limits of the page: big dumps are reduced, never dropped silently (the page says so)."""

    max_rows: int = 300  # heatmap rows per phase; the worst rows and the first divergence are kept
    max_columns: int = 200  # heatmap columns; more steps are binned (a cell shows the worst of its bin)
    max_cells: int = 10000  # per heatmap: fewer columns for many rows, to keep the page light
    trajectories: int = 6  # layers with trajectory plots
    max_points: int = 200  # steps of a trajectory drawn point by point (hover each); beyond: thinned, see _thinned
    max_steps: int = 500  # rows of the per-step table: steps that diverged or miss records first, then the worst


# --------------------------------------------------------------------------------------------- data


Series = tuple[list[int], set[int], dict[tuple[str, str], list[Any]]]  # Grid.series of a row


@dataclass
class Grid:
    """Records by row and step; rows in execution order (phase, rank, the base's seq). Built from the report's
    arrays; a plot reads the cells it shows (``bin_cells``) or the values of its rows (``series``)."""

    rows: list[Row]
    steps: list[int]
    ratios: dict[Row, float]  # the largest |diff| / tolerance of each row over the steps
    records: RecordDiffs
    missing: dict[tuple[Row, int], str]  # "only in base" / "only in other" cells
    first: Row | None  # the row of the first divergence

    @functools.cached_property
    def multi_rank(self) -> bool:
        return len({row[0] for row in self.rows}) > 1

    @classmethod
    def build(cls, report: Report) -> "Grid":
        records = report.records
        # A row's place is its seq at its earliest step, so rows follow the execution order of one step.
        order: dict[Row, tuple[int, int, int, int]] = {}
        worst: dict[Row, float] = {}
        steps: set[int] = set()
        for _, chunk in records.chunks():  # rows first seen in an earlier part keep that part's first record
            part = chunk.summary()
            for row, (step, seq), largest in zip(part.rows, part.row_first.tolist(), part.row_max.tolist()):
                if row not in order:
                    order[row] = (phase_rank(row[1]), row[0], step, seq)
                    worst[row] = largest
                else:
                    worst[row] = float(np.maximum(worst[row], largest))  # nan stays nan, as np.maximum.at keeps it
            steps.update(part.steps.tolist())
        missing: dict[tuple[Row, int], str] = {}
        for label, keys in (("only in base", report.only_in_base), ("only in other", report.only_in_other)):
            for index, (rank, step, phase, name) in enumerate(keys):
                row = (rank, phase, name)
                missing[(row, step)] = label
                position = (phase_rank(phase), rank, step, 1 << 30 | index)
                if row not in order or position < order[row]:
                    order[row] = position
        # Ties (two rows of one seq) by name, then phase: the same order however the records were read.
        rows = sorted(order, key=lambda row: (order[row][0], order[row][1], order[row][3], row[2], row[1]))
        steps.update(step for _, step in missing)
        first = report.first_divergence
        return cls(rows, sorted(steps), {row: worst.get(row, 0.0) for row in rows}, records, missing,
                   None if first is None else (first.rank, first.phase, first.name))

    @staticmethod
    def _positions(chunk: RecordDiffs, place: dict[Row, int]) -> np.ndarray:
        """Per record of ``chunk``: ``place`` of its row, -1 for rows not in ``place``."""
        found = np.array([place.get(row, -1) for row in chunk.summary().rows], np.int64)
        return found[chunk.row_of] if len(found) else np.zeros(0, np.int64)

    def bin_cells(self, rows: Sequence[Row], columns: Sequence[Sequence[int]]
                  ) -> dict[tuple[int, int], CellView | str]:
        """(row position, column) -> what the cell shows: the worst record of the column's steps
        (diverged first, then relative error, then ratio; the earliest on ties), else a missing label."""
        place = {row: position for position, row in enumerate(rows)}
        starts = np.array([column[0] for column in columns], np.int64)
        width = len(columns)
        found: list[tuple[np.ndarray, ...]] = []  # each part's best record per cell, then the best of those
        views: list[CellView] = []
        for offset, chunk in self.records.chunks():
            which = self._positions(chunk, place)
            shown = np.flatnonzero(which >= 0)
            if not len(shown):
                continue
            column = np.searchsorted(starts, chunk.step[shown], side="right") - 1
            keys = (offset + shown, _descending(chunk.ratio[shown]), _descending(chunk.rel_error[shown]),
                    ~np.asarray(chunk.diverged[shown], bool), which[shown] * width + column)
            best = _first_per_cell(keys)
            found.append(tuple(key[best] for key in keys))
            views += chunk.views(shown[best])
        cells: dict[tuple[int, int], CellView | str] = {}
        if found:
            keys = tuple(np.concatenate(key) for key in zip(*found))
            best = _first_per_cell(keys)
            cells.update((divmod(at, width), views[index]) for at, index in zip(keys[-1][best].tolist(), best.tolist()))
        for position, row in enumerate(rows):
            for c, steps in enumerate(columns):
                if (position, c) not in cells:
                    label = next((self.missing[(row, step)] for step in steps if (row, step) in self.missing), None)
                    if label is not None:
                        cells[(position, c)] = label
        return cells

    def series(self, rows: Sequence[Row], stats: Sequence[str]) -> dict[Row, Series]:
        """Per row: its steps (in order), the steps it diverged at, and per (run, statistic) its values there."""
        place = {row: position for position, row in enumerate(rows)}
        found: dict[Row, Series] = {
            row: ([], set(), {(run, stat): [] for stat in stats for run in ("base", "other")}) for row in rows}
        for _, chunk in self.records.chunks():
            which = self._positions(chunk, place)
            for row, position in place.items():
                indices = np.flatnonzero(which == position)
                if not len(indices):
                    continue
                steps, diverged, values = found[row]
                at = np.asarray(chunk.step[indices])
                steps += at.tolist()
                diverged.update(at[np.asarray(chunk.diverged[indices], bool)].tolist())
                for (run, stat), listed in values.items():
                    listed += chunk.value(indices, run, stat)
        return found


def _first_per_cell(keys: tuple[np.ndarray, ...]) -> np.ndarray:
    """Per cell (the last of ``keys``) the index of its first record, sorted by the keys (the last the primary)."""
    order = np.lexsort(keys)
    cell = keys[-1][order]
    return order[np.concatenate([[True], cell[1:] != cell[:-1]])]


def _descending(values: np.ndarray) -> np.ndarray:
    """Sort keys that put the largest value first, nan last (as ``-values`` sorts in a lexsort)."""
    keys = -np.asarray(values, np.float64)
    keys[np.isnan(keys)] = np.inf
    return keys


def _heat_color(record: CellView) -> str:
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
    a, b = _rgb(stops[index]), _rgb(stops[index + 1])
    return "#" + "".join(f"{round(x + (y - x) * frac):02x}" for x, y in zip(a, b))


@functools.lru_cache(maxsize=64)
def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


# --------------------------------------------------------------------------------------------- svg


def escape(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _row_label(row: Row, multi_rank: bool) -> str:
    rank, _, name = row
    return (f"r{rank} " if multi_rank else "") + name


def _cell_title(row: Row, step: str, cell: CellView | str | None) -> str:
    rank, phase, name = row
    where = f"rank {rank} step {step} {phase} {name}"
    if cell is None:
        return f"{where}: not recorded by either run"
    if isinstance(cell, str):
        return f"{where}: {cell}"
    text = f"{where}: relative error {cell.rel_error:.3g}"
    if cell.metric is not None:
        text += f"; worst {cell.metric} {format_value(cell.base)} vs {format_value(cell.other)}, ratio {cell.ratio:.3g}"
    # beyond its tolerance and not diverged: drift (docs/compare.md, Drift)
    return text + ("; DIVERGED" if cell.diverged else "; drift" if cell.ratio > 1 else "")


def heatmap(grid: Grid, phase: str, report: Report, config: HtmlConfig) -> str:
    rows = [row for row in grid.rows if row[1] == phase]
    first = report.first_divergence
    omitted = 0
    if len(rows) > config.max_rows:
        ranked = sorted(rows, key=lambda row: (row != grid.first, -grid.ratios[row]))  # stable sort
        keep = set(ranked[:config.max_rows])
        omitted = len(rows) - len(keep)
        rows = [row for row in rows if row in keep]
    max_columns = min(config.max_columns, max(20, config.max_cells // max(1, len(rows))))
    bin_size = max(1, math.ceil(len(grid.steps) / max_columns))
    columns = [grid.steps[i:i + bin_size] for i in range(0, len(grid.steps), bin_size)]
    cells = grid.bin_cells(rows, columns)
    label_width = 8 + 6.2 * min(48, max((len(_row_label(r, grid.multi_rank)) for r in rows), default=10))
    cell_w = min(36.0, max(8.0, 860.0 / max(1, len(columns))))
    cell_h = 14.0
    top = 34.0
    width = max(label_width + cell_w * len(columns) + 140, 720.0)  # at least the legend's width
    height = top + cell_h * len(rows) + 50
    parts = [f'<svg class="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="relative error heatmap, {phase}">']
    labels = [str(column[0]) if len(column) == 1 else f"{column[0]}-{column[-1]}" for column in columns]
    label_every = max(1, math.ceil(len(columns) / 20))
    for c, label in enumerate(labels):
        if c % label_every == 0:
            x = label_width + cell_w * (c + 0.5)
            parts.append(f'<text x="{x:.1f}" y="{top - 8:.1f}" class="axis" text-anchor="middle">'
                         f'{escape(label)}</text>')
    parts.append(f'<text x="{label_width:.1f}" y="12" class="axis">step \u2192</text>')
    marked = None
    for r, row in enumerate(rows):
        y = top + r * cell_h
        parts.append(f'<text x="{label_width - 6:.1f}" y="{y + cell_h - 3.5:.1f}" class="label" text-anchor="end">'
                     f'{escape(clip(_row_label(row, grid.multi_rank), 48, ELLIPSIS))}</text>')
        for c, column in enumerate(columns):
            x = label_width + c * cell_w
            cell = cells.get((r, c))
            if cell is None:
                fill, stroke = "#ffffff", ""
            elif isinstance(cell, str):
                fill, stroke = MISSING_COLOR, ' stroke="#555" stroke-dasharray="2,2"'
            else:
                fill = _heat_color(cell)
                stroke = ' stroke="#000" stroke-width="1.2"' if cell.diverged else ""
            parts.append(f'<rect class="cell" x="{x:.1f}" y="{y:.1f}" width="{cell_w - 1:.1f}" '
                         f'height="{cell_h - 1:.1f}" fill="{fill}"{stroke}>'
                         f'<title>{escape(_cell_title(row, labels[c], cell))}</title></rect>')
            if first is not None and row == grid.first and first.step in column:
                marked = (x, y)
    if marked is not None:
        x, y = marked
        label_x = label_width + cell_w * len(columns) + 8
        parts += [f'<rect class="first-divergence" x="{x - 2:.1f}" y="{y - 2:.1f}" width="{cell_w + 3:.1f}" '
                  f'height="{cell_h + 3:.1f}" fill="none" stroke="{MARK_COLOR}" stroke-width="3"/>',
                  f'<line x1="{x + cell_w + 1:.1f}" y1="{y + cell_h / 2:.1f}" x2="{label_x - 2:.1f}" '
                  f'y2="{y + cell_h / 2:.1f}" stroke="{MARK_COLOR}" stroke-width="1.5"/>',
                  f'<text x="{label_x:.1f}" y="{y + cell_h - 3:.1f}" class="mark">first divergence</text>']
    parts += [_heat_legend(8, top + cell_h * len(rows) + 16), "</svg>"]
    notes = [f"{omitted} rows with the smallest errors are not shown (limit {config.max_rows})." if omitted else "",
             f"Each column covers {bin_size} steps and shows the worst record of its steps." if bin_size > 1 else ""]
    note_html = "".join(f'<p class="note">{escape(note)}</p>' for note in notes if note)
    return f'<h3>{escape(phase)}</h3>{note_html}<div class="scroll">{"".join(parts)}</div>'


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
    for dx, paint, label in ((20, f'fill="{EQUAL_COLOR}" stroke="#999"', "equal"),
                             (80, 'fill="#fff" stroke="#000"', "diverged (outlined)"),
                             (210, f'fill="{MISSING_COLOR}"', "one run only")):
        x1 = x0 + bar_w + dx
        parts.append(f'<rect x="{x1:.1f}" y="{y:.1f}" width="10" height="10" {paint}/>'
                     f'<text x="{x1 + 14:.1f}" y="{y + 9:.1f}" class="axis">{label}</text>')
    return "".join(parts)


def _thinned(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A line of more points than pixels: per pixel column its lowest and highest point, in step order, so the
    line looks the same and its size stays that of the chart, whatever the steps."""
    columns: dict[int, list[tuple[float, float]]] = {}
    for point in points:
        columns.setdefault(math.floor(point[0]), []).append(point)
    kept: list[tuple[float, float]] = []
    for column in columns.values():
        ends = {min(column, key=lambda p: p[1]), max(column, key=lambda p: p[1])}
        kept += [point for point in column if point in ends]  # step order; one point where low is high
    return kept


def _line_chart(title: str, steps: Sequence[int], series: Sequence[tuple[str, str, list[Any], str]],
                mark_step: int | None, diverged_steps: set[int], max_points: int = 10 ** 9) -> str:
    """A small SVG line chart of values over steps; ``series``: (label, color, values, dash). Over ``max_points``
    steps the lines are ``_thinned`` and only the diverged steps are points to hover."""
    width, height = 230.0, 130.0
    left, right, top, bottom = 52.0, 8.0, 18.0, 20.0
    finite = [[(step, v) for step, v in zip(steps, vals) if isinstance(v, (int, float)) and math.isfinite(v)]
              for _, _, vals, _ in series]
    values = [v for found in finite for _, v in found]
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}">',
             f'<text x="{left:.0f}" y="12" class="title">{escape(title)}</text>',
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

    parts += [f'<text x="{left - 4:.0f}" y="{top + 8:.0f}" class="axis" text-anchor="end">{hi:.4g}</text>',
              f'<text x="{left - 4:.0f}" y="{height - bottom:.0f}" class="axis" text-anchor="end">{lo:.4g}</text>',
              f'<text x="{sx(s0):.1f}" y="{height - 6:.0f}" class="axis" text-anchor="middle">{s0}</text>']
    if s1 != s0:
        parts.append(f'<text x="{sx(s1):.1f}" y="{height - 6:.0f}" class="axis" text-anchor="middle">{s1}</text>')
    if mark_step is not None and s0 <= mark_step <= s1:
        x = sx(mark_step)
        parts.append(f'<line class="divergence-step" x1="{x:.1f}" y1="{top:.0f}" x2="{x:.1f}" '
                     f'y2="{height - bottom:.0f}" stroke="{MARK_COLOR}" stroke-width="1.5" stroke-dasharray="4,3"/>')
    reduced = len(steps) > max_points
    for (label, color, _, dash), shown in zip(series, finite):
        points = [(sx(step), sy(v)) for step, v in shown]
        if reduced:
            points = _thinned(points)
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash_attr}>'
                         f'<title>{escape(label)}</title></polyline>')
        if reduced:  # the first diverged steps of the other run, as many as a chart of max_points shows
            shown = [(step, v) for step, v in shown if label == "other" and step in diverged_steps][:max_points]
        for step, v in shown:
            bad = label == "other" and step in diverged_steps
            parts.append(f'<circle cx="{sx(step):.1f}" cy="{sy(v):.1f}" r="{3.2 if bad else 2.4}" '
                         f'fill="{"#d00" if bad else color}"><title>{escape(label)} step {step}: {v:.6g}</title>'
                         f'</circle>')
    parts.append("</svg>")
    return "".join(parts)


def trajectories(grid: Grid, report: Report, config: HtmlConfig) -> str:
    """The first divergence's row, then those of the largest ratio: each statistic of both runs over the steps."""
    first = report.first_divergence
    blocks = []
    ranked = sorted(grid.rows, key=grid.ratios.__getitem__, reverse=True)  # stable: ties keep execution order
    first_rows = [grid.first] if grid.first in grid.rows else []
    chosen = list(dict.fromkeys([*first_rows, *ranked]))[:max(config.trajectories, len(first_rows))]  # first: always
    found = grid.series(chosen, MOMENTS)
    for row in chosen:
        steps, diverged, values = found[row]
        mark = first.step if first is not None and grid.first == row else None
        charts = []
        for stat in MOMENTS:
            series = [("base", BASE_COLOR, values[("base", stat)], ""),
                      ("other", OTHER_COLOR, values[("other", stat)], "5,3")]
            charts.append(_line_chart(stat, steps, series, mark, diverged, config.max_points))
        heading = f"{row[1]} {_row_label(row, grid.multi_rank)}"
        flag = ' <span class="bad">first divergence</span>' if mark is not None else ""
        blocks.append(f'<div class="traj"><h4>{escape(heading)}{flag}</h4>{"".join(charts)}</div>')
    legend = (f'<p class="legend"><svg width="260" height="14" xmlns="http://www.w3.org/2000/svg">'
              f'<rect class="swatch-base" x="0" y="2" width="22" height="10" fill="{BASE_COLOR}"/>'
              f'<text x="28" y="11" class="axis">base</text>'
              f'<rect class="swatch-other" x="70" y="2" width="22" height="10" fill="{OTHER_COLOR}"/>'
              f'<text x="98" y="11" class="axis">other (dashed)</text>'
              f'<circle cx="196" cy="7" r="4" fill="#d00"/><text x="204" y="11" class="axis">diverged</text></svg>'
              f'<span> Blue dashed line: the step of the first divergence.</span></p>')
    if len(grid.steps) > config.max_points:
        legend += (f'<p class="note">Over {config.max_points} steps, each line keeps per pixel its lowest and highest '
                   f"value, and only diverged steps of the other run (the first {config.max_points}) are points "
                   "with their values on hover.</p>")
    return legend + "".join(blocks)


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


def _first_rows(header: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Collection[int],
                limit: int = 500) -> list[str]:
    """A table of the first ``limit`` rows, then how many more the JSON report lists."""
    more = [f'<p class="note">{len(rows) - limit} more in the JSON report.</p>'] if len(rows) > limit else []
    return [_table(header, rows[:limit], numeric), *more]


def _zero_grad_section(report: Report) -> str:
    """The notes on materialised zero gradients: which records, and which run has them."""
    rows = [(*key, side, "other" if side == "base" else "base") for key, side in report.zero_grads]
    return "".join([f'<h2 id="zero-grads">Notes: {escape(ZERO_GRAD_NOTE)} ({len(report.zero_grads)})</h2>',
                    '<p class="note">A gradient that is exactly zero everywhere in one run and has no record in the '
                    "other (one backend materialises the zeros another leaves out). Not a divergence; compare with "
                    "<code>--strict-zero-grads</code> (<code>strict_zero_grads=True</code>) to count it as one.</p>",
                    *_first_rows(["rank", "step", "phase", "name", "zero in", "absent in"], rows, {0, 1})])


def _drift_section(report: Report) -> str:
    """The drift records (docs/compare.md, Drift), each with its ratio and the largest of its step before."""
    rows = report.records.drift_rows()
    if not len(rows):
        return ""
    shown = [(r.rank, r.step, r.phase, r.name, r.worst.metric if r.worst else None, r.ratio, r.drift)
             for r in report.records.at(rows[:500])]
    return "".join([f'<h2 id="drift">Drift ({len(rows)})</h2>',
                    f'<p class="note">Beyond tolerance, at most {DRIFT_GROWTH:g}x the largest ratio of the step '
                    "before: the difference that step already carried, grown by training, not a divergence (a bug "
                    "is a jump). Compare with <code>--strict-drift</code> (<code>strict_drift=True</code>) to count "
                    "it as one, or measure the noise floor with <code>--noise</code>.</p>",
                    _table(["rank", "step", "phase", "name", "metric", "ratio", "largest ratio, step before"], shown,
                           {0, 1, 5, 6}),
                    *([f'<p class="note">{len(rows) - 500} more in the JSON report.</p>'] if len(rows) > 500 else [])])


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
    checks = found.sources()
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
        listed = group.ops[:max(1, limit - shown)]
        for found in listed:
            inputs = "; ".join([*(check.describe(group.module) for check in found.inputs),
                                *(f"gradient from {check.describe(group.module)}" for check in found.gradients)])
            rows.append(f'<tr class="op"><td></td><td></td><td></td>'
                        f'<td style="padding-left: 2em">{escape(relative_name(found.name, group.module))}</td>'
                        f"<td>{escape(found.metric)}</td><td class=num>{escape(format_value(found.ratio))}</td>"
                        f"<td>{escape(found.explained())}</td><td>{escape(inputs)}</td></tr>")
        shown += 1 + len(listed)
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
    firsts = [i for i, s in enumerate(summaries) if first is not None and s.step == first.step]
    flagged = [i for i, s in enumerate(summaries) if s.differs]
    rest = sorted((i for i, s in enumerate(summaries) if not s.differs),
                  key=lambda i: -(summaries[i].worst.ratio if summaries[i].worst else 0.0))  # stable: earliest first
    chosen = list(dict.fromkeys([*firsts, *flagged, *rest]))[:max(limit, len(firsts))]  # the first divergence's: always
    return [summaries[i] for i in sorted(chosen)]


def render_html(report: Report, config: HtmlConfig = HtmlConfig()) -> str:
    """The report page as a string (see the module docstring)."""
    grid = Grid.build(report)
    cfg = report.config
    first = report.first_divergence
    verdict_class = "agree" if report.agrees else "diverged"
    by_how = Counter(r.how for r in report.renamed)
    hows = ["map", "fuzzy", *(["op"] if by_how["op"] else [])]
    floor = noise_floor_line(report)
    summary = _table(None, [
        ("base", report.base), ("other", report.other), ("noise (calibration run)", report.noise or "-"),
        *((("noise floor", floor),) if floor is not None else ()),
        ("tolerance", rule_line(report)),
        *((("per-dtype defaults", precision_table()),) if cfg.fixed is None and not cfg.exact else ()),
        ("records matched / diverged / drift", f"{report.matched} / {report.diverged_count} / {report.drift_count}"),
        ("only in base / only in other", f"{len(report.only_in_base)} / {len(report.only_in_other)}"),
        ("steps only in base / other", f"{report.steps_only_in_base or '-'} / {report.steps_only_in_other or '-'}"),
        ("materialised zero gradients (notes)", len(report.zero_grads)),
        *([(f"names of other renamed ({' / '.join(hows)})", " / ".join(str(by_how[how]) for how in hows))]
          if report.renamed else []),
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
        f'<p class="note">Tolerance per statistic: {escape(rule_line(report))}. Structure (shape, dtype, numel) and '
        "nan/inf counts must be equal. See docs/compare.md.</p>" if not cfg.exact else
        '<p class="note">Exact: a record agrees when it is bit-identical (its hash); one that differs in its '
        "bytes diverges, whatever the tolerances. See docs/compare.md.</p>",
    ]
    if cfg.ranks:
        parts += ["<h2>Per rank (against rank 0)</h2>", _table(["rank", "verdict"], [
            (rank, ("bit-identical" if cfg.exact else "agrees") if found is None else f"first divergence at {found}")
            for rank, found in report.per_rank().items()], {0})]
    if first is not None:
        fields = Divergence.json_fields[:-1]  # all but noise_floor, said below
        parts += ["<h2>First divergence</h2>",
                  _table(["rank", "step", "phase", "name", "seq", "metric", "base", "other", "|diff|", "rel",
                          "tolerance"], [[getattr(first, name) for name in fields]], {0, 1, 4, 6, 7, 8, 9, 10})]
        if first.noise_floor is not None:
            parts.append(f'<p class="kind">Against the calibration run: {escape(first.noise_floor)} the noise '
                         "floor.</p>")
        parts += [f'<p class="kind">What differs: {escape(kind_line(report) or "")}</p>',
                  _first_operation_section(report)]
    parts += [_operations_section(report, config.max_rows), _drift_section(report),
              "<h2>Relative error, step &times; layer</h2>"]
    if not grid.rows:
        parts.append('<p class="note">No records to show.</p>')
    parts += [heatmap(grid, phase, report, config) for phase in sorted({row[1] for row in grid.rows}, key=phase_rank)]
    if grid.rows:
        parts += ["<h2>Statistic trajectories</h2>",
                  '<p class="note">The layer of the first divergence, then the layers with the largest '
                  "|diff| / tolerance.</p>", trajectories(grid, report, config)]
    every = report.per_step()
    summaries = _shown_steps(every, report, config.max_steps)
    norms = grad_norm_cells(summaries)
    header = ["step", "matched", "diverged", "only in base", "only in other", "worst ratio",
              *(GRAD_NORM_HEADER if norms else []), "worst record"]
    rows = [(s.step, s.matched, s.diverged, s.only_in_base, s.only_in_other, s.worst.ratio if s.worst else None,
             *(norms[i] if norms else []), f"{s.worst.phase} {s.worst.name}" if s.worst and s.worst.ratio > 0 else "-")
            for i, s in enumerate(summaries)]
    parts += ["<h2>Per step</h2>", _table(header, rows, set(range(len(header) - 1)))]
    if len(every) > len(summaries):
        parts.append(f'<p class="note">{len(every) - len(summaries)} more steps, all within tolerance and with every '
                     f"record in both runs, are not shown (limit {config.max_steps}); the JSON report lists every "
                     "step (per_step).</p>")
    for label, keys in (("Only in base", report.only_in_base), ("Only in other", report.only_in_other)):
        if keys:
            parts += [f"<h2>{label} ({len(keys)})</h2>", *_first_rows(["rank", "step", "phase", "name"], keys, {0, 1})]
    if report.renamed:
        parts += [f'<h2 id="renamed">Renamed: names of other compared as names of base ({len(report.renamed)})</h2>',
                  _table(["phase", "other", "base", "how", "confidence", "why"],
                         [(r.phase or "all", r.other, r.base, r.how, r.confidence, r.reason)
                          for r in report.renamed[:500]], {4})]
    if report.zero_grads:
        parts.append(_zero_grad_section(report))
    parts.append("</body></html>")
    return "\n".join(parts)
