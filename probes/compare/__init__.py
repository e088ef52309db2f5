"""Comparing two dumps: match records, check tolerances, find the first divergence, report it.

    from probes.compare import compare_dumps, format_report, write_html
    report = compare_dumps("eager", "ort")
    print(format_report(report)); write_html(report, "report.html")

Rooms: ``model`` (the result model and the default tolerances), ``reading`` (a dump as one keyed table),
``names`` (the name map), ``align`` (fuzzy pairing of renamed records), ``vector`` (matching and the
tolerance checks on whole columns), ``engine`` (the comparison: record by record where columns cannot
decide, noise, zero gradients, the first divergence), ``text`` (the terminal summary and the
shared sentences), ``html`` and ``plots`` (the HTML page), ``merge`` (the original's merged summaries).
"""

from ..utils.progress import Progress
from .engine import compare_dumps, compare_loaded, compare_records, is_zero_gradient, record_noise
from .html import HtmlConfig, render_html, write_html
from .model import (DEFAULT_ATOL, DEFAULT_NOISE_FACTOR, DEFAULT_RTOL, ZERO_GRAD_NOTE, CompareConfig, Divergence,
                    MetricDiff, RecordDiff, RecordDiffs, Rename, Report, StepSummary, execution_order)
from .align import apply_renames, fuzzy_renames
from .names import NameMap, NameMapError, as_name_map, load_name_map
from .reading import LoadedDump, read_dump
from .terminal import format_report, parse_steps

__all__ = ["DEFAULT_ATOL", "DEFAULT_NOISE_FACTOR", "DEFAULT_RTOL", "ZERO_GRAD_NOTE", "CompareConfig", "Divergence",
           "HtmlConfig", "LoadedDump", "MetricDiff", "NameMap", "NameMapError", "Progress", "RecordDiff", "RecordDiffs",
           "Rename",
           "Report", "StepSummary", "compare_dumps",
           "apply_renames", "as_name_map", "compare_loaded", "compare_records", "execution_order", "format_report",
           "fuzzy_renames", "is_zero_gradient", "load_name_map",
           "parse_steps", "read_dump", "record_noise", "render_html", "write_html"]
