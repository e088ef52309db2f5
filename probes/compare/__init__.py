"""Comparing two dumps: match records, check tolerances, find the first divergence, report it.

    from probes.compare import compare_dumps, format_report, write_html
    report = compare_dumps("eager", "ort")
    print(format_report(report)); write_html(report, "report.html")

Everything else is imported from its room (``from probes.compare.options import CompareConfig``).
Rooms: ``options`` (tolerances, filters, the compared statistic groups), ``reading`` (a dump as one keyed
table), ``names`` (the name map), ``align`` (fuzzy pairing of renamed records), ``opalign`` (operations
aligned where two runs' decompositions differ), ``opfinding`` (diverged operations and their inputs),
``rules`` (the comparison rules, once, on arrays: tolerance, difference, ratio, sample pairing), ``pairs``
(both sides of matched pairs as arrays), ``metrics`` (every metric of every pair, the noise level), ``vector``
(matching, every pair's verdict), ``details`` (the RecordDiff objects a report shows), ``engine`` (the
comparison: noise, zero gradients, the first divergence; ``compare_records`` for records at hand),
``results``, ``matched`` and ``report`` (the result model and its JSON), ``values`` (how values print and go
to JSON), ``terminal`` (the terminal summary and the shared sentences), ``html`` and ``plots`` (the HTML
page), ``merge`` (the original's merged summaries).
"""

from .windows import compare_dumps
from .html import write_html
from .names import NameMap, NameMapError, load_name_map
from .report import Report
from .terminal import format_report

__all__ = ["NameMap", "NameMapError", "Report", "compare_dumps", "format_report", "load_name_map", "write_html"]
