"""Comparing two dumps: match records, check tolerances, find the first divergence, report it.

    from probes.compare import compare_dumps, format_report, write_html
    report = compare_dumps("eager", "ort")
    print(format_report(report)); write_html(report, "report.html")

Everything else is imported from its room (``from probes.compare.options import CompareConfig``). Rooms, in the
order a comparison runs: ``options`` (tolerances, filters, the compared statistic groups, the name map),
``reading`` (a dump as one keyed table), ``operations`` (renamed records and operations paired with their base names;
diverged operations and their inputs), ``pairs`` (matching, both sides of matched pairs as exact arrays, the value
rules), ``evaluation`` (the tolerance, every metric of every pair, the verdicts, the RecordDiff objects a report shows),
``engine`` (one comparison: noise, zero gradients, the first divergence; ``compare_dumps``: a window of steps at
a time, joined), ``results`` and ``recorddiffs`` (the result model, the Report, its JSON), ``terminal`` (the
terminal summary and the shared sentences), ``html`` (the HTML page), ``summaries`` (the original tool's merged
per-step summaries).
"""

from .engine import compare_dumps
from .html import write_html
from .options import NameMap, NameMapError, load_name_map
from .results import Report
from .terminal import format_report

__all__ = ["NameMap", "NameMapError", "Report", "compare_dumps", "format_report", "load_name_map", "write_html"]
