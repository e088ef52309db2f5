"""Comparing two dumps: match records, check tolerances, find the first divergence, report it.

    from probes.compare import compare_dumps, format_report, write_html
    report = compare_dumps("eager", "ort")
    print(format_report(report)); write_html(report, "report.html")
"""

from .engine import (DEFAULT_ATOL, DEFAULT_NOISE_FACTOR, DEFAULT_RTOL, ZERO_GRAD_NOTE, CompareConfig, Divergence,
                     LoadedDump, MetricDiff, Progress, RecordDiff, Report, StepSummary, compare_dumps, compare_loaded,
                     compare_records, execution_order, format_report, is_zero_gradient, parse_steps,
                     read_dump, record_noise)
from .html import HtmlConfig, render_html, write_html

__all__ = ["DEFAULT_ATOL", "DEFAULT_NOISE_FACTOR", "DEFAULT_RTOL", "ZERO_GRAD_NOTE", "CompareConfig", "Divergence",
           "HtmlConfig", "LoadedDump", "MetricDiff", "Progress", "RecordDiff", "Report", "StepSummary", "compare_dumps",
           "compare_loaded", "compare_records", "execution_order", "format_report", "is_zero_gradient",
           "parse_steps", "read_dump", "record_noise", "render_html", "write_html"]
