"""Exports of a probes dump for other tools: JSON Lines, CSV, the original onnxruntime hooks' files, TensorBoard.

    export_dump("pt_out", "pt.csv", format="csv")           # or: probes export pt_out --format csv --output pt.csv
    write_tensorboard("pt_out", "tb", modules=["blocks.*"])  # or: probes tensorboard pt_out --logdir tb
    StatisticsSubscriber("pt_out", on_step_written=LiveTensorBoard("tb"))   # live, as the run goes

Every export reads the dump through ``probes.dump.DumpReader`` (finished steps only, each checked
whole), step by step, and writes atomically: a temporary sibling renamed over the output at the end.
The rooms: ``output`` (``ExportOptions``, selection, output checks, atomic writes), ``tabular`` (JSON Lines,
CSV), ``ort_layout`` (the original layout), ``tensorboard`` (and its options).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..utils.flags import check_keywords, takes_options
from .ort_layout import write_ort_layout
from .output import ExportOptions, ExportSummary
from .tensorboard import LiveTensorBoard, write_tensorboard
from .tabular import write_text

__all__ = [
    "ExportSummary", "LiveTensorBoard", "export_dump", "write_tensorboard",
]

_EXPORTERS = {"jsonl": write_text, "csv": write_text, "ort": write_ort_layout}  # by ExportOptions' FORMATS


@takes_options(ExportOptions)
def export_dump(dump: str | Path, output: str | Path, **options: Any) -> ExportSummary:
    """Writes ``dump`` to ``output`` in ``format`` ("jsonl", "csv" or "ort"); ``str()`` of the result says what.

    The keywords are ``ExportOptions``' fields, listed below (``probes export``'s flags; ``output`` is its
    ``--output``). Raises FileExistsError for an existing output unless ``overwrite``, ValueError for an unknown
    format, an output inside the dump or a rank the dump lacks, DumpFormatError for a damaged dump.
    """
    check_keywords(ExportOptions, options, "export_dump")
    chosen = ExportOptions(dump=dump, output=output, **options)
    return _EXPORTERS[chosen.format](chosen)
