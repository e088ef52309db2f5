"""A dump as one text file: JSON Lines (one strict JSON object per record) or CSV (one row per record).

    write_text(ExportOptions(dump="pt_out", output="pt.csv", format="csv"))    # what export_dump calls
    # pandas.read_csv("pt.csv") reads it as it is

Records come in the dump's order: rank, step, then the order the step file holds. JSON Lines keeps
every key of a record; a NaN or infinite number, which strict JSON cannot hold, is written as the
string "NaN", "Infinity" or "-Infinity". CSV has one named column per field of ``probes.dump.Record``
(lists such as ``shape`` and ``samples`` as JSON text, None as an empty cell, floats in Python's exact
``repr``: nan, inf) and a last column ``extra`` with any other keys as a JSON object.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from typing import Any, TextIO

from ..dump import Record
from ..dump.record import REQUIRED_FIELDS
from .output import ExportOptions, ExportSummary, atomic_output, check_output, select_files

__all__ = ["CSV_COLUMNS", "write_text"]

# Where and when first, then every other field a record can have, in the record type's own order.
CSV_COLUMNS: tuple[str, ...] = (*REQUIRED_FIELDS,
                                *(key for key in Record.__annotations__ if key not in REQUIRED_FIELDS), "extra")
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _strict(value: Any) -> Any:
    """``value`` with every NaN and infinity replaced by its JSON-safe name."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _NON_FINITE[value]
    if isinstance(value, list):
        return [_strict(item) for item in value]
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    return value


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(_strict(value), separators=(",", ":"))
    return value


def _jsonl_lines(records: Iterable[Record], out: TextIO) -> None:
    for record in records:
        out.write(json.dumps(_strict(record), allow_nan=False) + "\n")


def _csv_rows(records: Iterable[Record], out: TextIO) -> None:
    known = set(CSV_COLUMNS)
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for record in records:
        extra = {key: value for key, value in record.items() if key not in known}
        row = {**record, "extra": extra or None}
        writer.writerow([_csv_cell(row.get(column)) for column in CSV_COLUMNS])


def write_text(options: ExportOptions) -> ExportSummary:
    """Writes the records of ``options.dump`` to ``options.output`` as JSON Lines or CSV (``options.format``)."""
    write = {"jsonl": _jsonl_lines, "csv": _csv_rows}[options.format]
    check_output(options.output, options.dump, overwrite=options.overwrite)
    reader, files = select_files(options.dump, rank=options.rank)
    count = 0

    def records() -> Iterable[Record]:
        nonlocal count
        for _, step_records in reader.read_each(files, progress=options.progress, label=f"exporting {options.dump}"):
            count += len(step_records)
            yield from step_records

    with atomic_output(options.output) as temporary, temporary.open("w", encoding="utf-8", newline="") as out:
        write(records(), out)
    return ExportSummary.of(options.format, options.output, count, files)

