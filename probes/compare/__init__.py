"""Comparing two dumps: match records, check tolerances, find the first divergence, report it.

    from probes.compare import compare_dumps, format_report, write_html
    report = compare_dumps("eager", "ort")
    print(format_report(report)); write_html(report, "report.html")

Everything else is imported from its room (``from probes.compare.options import CompareConfig``).
Rooms, in the order a comparison runs: ``options`` (tolerances, filters, the compared statistic groups),
``reading`` (a dump as one keyed table), ``names`` (the name map), ``align`` (renamed records and operations
paired with their base names), ``pairs`` (matching, and both sides of matched pairs as arrays), ``rules`` (the
comparison rules, once, on arrays), ``evaluation`` (every metric of every pair, the verdicts, the RecordDiff
objects a report shows), ``opfinding`` (diverged operations and their inputs), ``engine`` (one comparison:
noise, zero gradients, the first divergence; ``compare_records`` for records at hand), ``windows``
(``compare_dumps``: a window of steps at a time, joined), ``results``, ``recorddiffs`` and ``report`` (the
result model and its JSON), ``terminal`` (the terminal summary and the shared sentences), ``html`` (the HTML
page), ``summaries`` (the original tool's merged per-step summaries).
"""

from .windows import compare_dumps
from .html import write_html
from .options import NameMap, NameMapError, load_name_map
from .results import Report
from .terminal import format_report

__all__ = ["NameMap", "NameMapError", "Report", "compare_dumps", "format_report", "load_name_map", "write_html"]
