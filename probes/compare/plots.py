"""The SVG plots of the HTML report: the relative-error heatmap (step x layer) and the trajectories.

    grid = Grid.build(report)
    svg = heatmap(grid, "forward", report, HtmlConfig()) + trajectories(grid, report, HtmlConfig())

Inline SVG only (no scripts): a heatmap cell's numbers are in its <title>, shown on hover.
"""

from __future__ import annotations

import functools
import html
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..utils.phases import phase_rank
from .config import MOMENTS
from .recorddiffs import RecordDiffs, Row
from .report import Report
from .results import CellView
from .results import format_value
from .terminal import clip

__all__ = ["BASE_COLOR", "MARK_COLOR", "OTHER_COLOR", "Grid", "HtmlConfig", "escape", "heatmap", "trajectories"]

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


@dataclass
class Grid:
    """Records by row and step; rows in execution order (phase, rank, the base's seq).

    Built from the report's arrays; a plot reads the cells it shows (``bin_cells``, ``row_indices``).
    """

    rows: list[Row]
    steps: list[int]
    ratios: dict[Row, float]  # the largest |diff| / tolerance of each row over the steps
    records: RecordDiffs
    missing: dict[tuple[Row, int], str]  # "only in base" / "only in other" cells

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
        return cls(rows, sorted(steps), {row: worst.get(row, 0.0) for row in rows}, records, missing)

    def row_ratio(self, row: Row) -> float:
        return self.ratios[row]

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
        # Per cell the sort key of its best record so far: (not diverged, -rel_error, -ratio, row), smallest wins.
        have = np.zeros(len(rows) * width, dtype=bool)
        keys = (np.zeros(len(have), dtype=bool), np.zeros(len(have)), np.zeros(len(have)), np.zeros(len(have), np.int64))
        views: dict[int, CellView] = {}
        for offset, chunk in self.records.chunks():  # each part's best per cell, then the best of those
            which = self._positions(chunk, place)
            shown = np.flatnonzero(which >= 0)
            if not len(shown):
                continue
            column = np.searchsorted(starts, chunk.step[shown], side="right") - 1
            ratio, rel_error = _descending(chunk.ratio[shown]), _descending(chunk.rel_error[shown])
            calm = ~np.asarray(chunk.diverged[shown], bool)
            order = np.lexsort((shown, ratio, rel_error, calm, column, which[shown]))
            cell = which[shown[order]] * width + column[order]
            keep = order[np.concatenate([[True], cell[1:] != cell[:-1]])]
            cell = which[shown[keep]] * width + column[keep]
            found = (calm[keep], rel_error[keep], ratio[keep], offset + shown[keep])
            better = ~have[cell] | _earlier(found, tuple(key[cell] for key in keys))
            cell = cell[better]
            have[cell] = True
            for key, value in zip(keys, found):
                key[cell] = value[better]
            views.update(zip(cell.tolist(), chunk.views(shown[keep][better])))
        cells: dict[tuple[int, int], CellView | str] = {divmod(at, width): view for at, view in views.items()}
        for position, row in enumerate(rows):
            for c, steps in enumerate(columns):
                if (position, c) not in cells:
                    label = next((self.missing[(row, step)] for step in steps if (row, step) in self.missing), None)
                    if label is not None:
                        cells[(position, c)] = label
        return cells

    def series(self, rows: Sequence[Row], stats: Sequence[str]) -> dict[Row, tuple[list[int], set[int],
                                                                                   dict[tuple[str, str], list[Any]]]]:
        """Per row: its steps (in order), the steps it diverged at, and per (run, statistic) its values there."""
        place = {row: position for position, row in enumerate(rows)}
        found: dict[Row, tuple[list[int], set[int], dict[tuple[str, str], list[Any]]]] = {
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


def _earlier(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> np.ndarray:
    """Per position whether the key ``a`` sorts before ``b`` (tuples of arrays compared element by element)."""
    before = np.zeros(len(a[0]), dtype=bool)
    tied = np.ones(len(a[0]), dtype=bool)
    for x, y in zip(a, b):
        before |= tied & (x < y)
        tied &= x == y
    return before


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


def _cell_title(row: Row, step: int | str, cell: CellView | str | None) -> str:
    rank, phase, name = row
    where = f"rank {rank} step {step} {phase} {name}"
    if cell is None:
        return f"{where}: not recorded by either run"
    if isinstance(cell, str):
        return f"{where}: {cell}"
    text = f"{where}: relative error {cell.rel_error:.3g}"
    if cell.metric is not None:
        text += f"; worst {cell.metric} {format_value(cell.base)} vs {format_value(cell.other)}, ratio {cell.ratio:.3g}"
    return text + ("; DIVERGED" if cell.diverged else "")


def heatmap(grid: Grid, phase: str, report: Report, config: HtmlConfig) -> str:
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
    cells = grid.bin_cells(rows, columns)
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
            parts.append(f'<text x="{x:.1f}" y="{top - 8:.1f}" class="axis" text-anchor="middle">{escape(label)}</text>')
    parts.append(f'<text x="{label_width:.1f}" y="12" class="axis">step \u2192</text>')
    marked = None
    for r, row in enumerate(rows):
        y = top + r * cell_h
        parts.append(f'<text x="{label_width - 6:.1f}" y="{y + cell_h - 3.5:.1f}" class="label" text-anchor="end">'
                     f'{escape(clip(_row_label(row, multi_rank), 48, ELLIPSIS))}</text>')
        for c, column in enumerate(columns):
            x = label_width + c * cell_w
            cell = cells.get((r, c))
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
                         f'<title>{escape(_cell_title(row, step_label, cell))}</title></rect>')
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
    note_html = "".join(f'<p class="note">{escape(note)}</p>' for note in notes)
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
    x1 = x0 + bar_w + 20
    parts.append(f'<rect x="{x1:.1f}" y="{y:.1f}" width="10" height="10" fill="{EQUAL_COLOR}" stroke="#999"/>'
                 f'<text x="{x1 + 14:.1f}" y="{y + 9:.1f}" class="axis">equal</text>')
    parts.append(f'<rect x="{x1 + 60:.1f}" y="{y:.1f}" width="10" height="10" fill="#fff" stroke="#000"/>'
                 f'<text x="{x1 + 74:.1f}" y="{y + 9:.1f}" class="axis">diverged (outlined)</text>')
    parts.append(f'<rect x="{x1 + 190:.1f}" y="{y:.1f}" width="10" height="10" fill="{MISSING_COLOR}"/>'
                 f'<text x="{x1 + 204:.1f}" y="{y + 9:.1f}" class="axis">one run only</text>')
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
    values = [v for _, _, vals, _ in series for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
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
        reduced = len(steps) > max_points
        if reduced:
            points = _thinned(points)
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash_attr}>'
                         f'<title>{escape(label)}</title></polyline>')
        shown = [(step, v) for step, v in zip(steps, vals) if isinstance(v, (int, float)) and math.isfinite(v)]
        if reduced:  # the first diverged steps of the other run, as many as a chart of max_points shows
            shown = [(step, v) for step, v in shown if label == "other" and step in diverged_steps][:max_points]
        for step, v in shown:
            bad = label == "other" and step in diverged_steps
            parts.append(f'<circle cx="{sx(step):.1f}" cy="{sy(v):.1f}" r="{3.2 if bad else 2.4}" '
                         f'fill="{"#d00" if bad else color}"><title>{escape(label)} step {step}: {v:.6g}</title>'
                         f'</circle>')
    parts.append("</svg>")
    return "".join(parts)


def _trajectory_rows(grid: Grid, report: Report, count: int) -> list[Row]:
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


def trajectories(grid: Grid, report: Report, config: HtmlConfig) -> str:
    first = report.first_divergence
    multi_rank = len({row[0] for row in grid.rows}) > 1
    blocks = []
    chosen = _trajectory_rows(grid, report, config.trajectories)
    found = grid.series(chosen, MOMENTS)
    for row in chosen:
        steps, diverged, values = found[row]
        mark = first.step if first is not None and (first.rank, first.phase, first.name) == row else None
        charts = []
        for stat in MOMENTS:
            series = [("base", BASE_COLOR, values[("base", stat)], ""),
                      ("other", OTHER_COLOR, values[("other", stat)], "5,3")]
            charts.append(_line_chart(stat, steps, series, mark, diverged, config.max_points))
        heading = f"{row[1]} {_row_label(row, multi_rank)}"
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
