"""Exports of a probes dump for other tools: JSON Lines, CSV, the original onnxruntime hooks' files, TensorBoard.

    export_dump("pt_out", "pt.csv", format="csv")           # or: probes export pt_out --format csv --output pt.csv
    write_tensorboard("pt_out", "tb", modules=["blocks.*"])  # or: probes tensorboard pt_out --logdir tb
    StatisticsSubscriber("pt_out", on_step_written=LiveTensorBoard("tb"))   # live, as the run goes

Every export reads the dump through ``probes.dump.DumpReader`` (finished steps only, each checked
whole), step by step, and writes atomically: a temporary sibling renamed over the output at the end.
The rooms: ``output`` (selection, output checks, atomic writes), ``text`` (JSON Lines, CSV), ``ort``
(the original layout), ``tensorboard``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from .ort_layout import export_ort_layout
from .output import ExportSummary
from .tensorboard import LiveTensorBoard, write_tensorboard
from .tabular import export_csv, export_jsonl

__all__ = [
    "ExportSummary", "LiveTensorBoard", "export_dump", "write_tensorboard",
]

_EXPORTERS = {"jsonl": export_jsonl, "csv": export_csv, "ort": export_ort_layout}
FORMATS = tuple(_EXPORTERS)


def export_dump(dump: str | Path, output: str | Path, *, format: str, overwrite: bool = False,
                rank: int | None = None, progress: bool | TextIO = False) -> ExportSummary:
    """Writes ``dump`` to ``output`` in ``format`` ("jsonl", "csv" or "ort"); ``str()`` of the result says what.

    Raises FileExistsError for an existing output unless ``overwrite``, ValueError for an unknown format,
    an output inside the dump or a rank the dump lacks, DumpFormatError for a damaged dump.
    """
    if format not in _EXPORTERS:
        raise ValueError(f"unknown export format {format!r}; choose from {', '.join(FORMATS)}")
    return _EXPORTERS[format](dump, output, overwrite=overwrite, rank=rank, progress=progress)
