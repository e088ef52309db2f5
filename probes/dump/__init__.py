"""Dump I/O for statistics records: a background writer, a reader and a table printer.

Usage:
    writer = DumpWriter("pt_out", rank=0)             # raises now if the directory is unusable
    writer.write(step, {"name": "fc1", "phase": "forward", "seq": 0, "mean": 0.1})
    writer.finish_step(step)                          # the step becomes visible to readers
    writer.close()
    records = load_dump("pt_out")                     # or: python -m probes show pt_out --step 3
    table = load_table("pt_out")                      # the same records as an Arrow table (.to_pandas())
    reader = DumpReader("pt_out")                     # step by step: reader.step_files(), reader.read(f)

A record (``Record``) is a plain JSON-ready dict; on disk a row of a Parquet step file (``columns``). Only "step", "rank", "name", "phase" and "seq" mean
something here; every other key is passed through untouched. Nothing is pickled.

The rooms: ``record`` (the typed record), ``statistics`` (each statistic defined once), ``rowblock``
(records as statistics rows, turned into columns on the writer thread), ``columns`` (records as Arrow tables, Parquet), ``layout`` (the format on disk, directory rules, errors),
``writer`` and ``stepfiles`` (the background writer and the files its thread writes), ``live`` (readers
of this process wait for its live writers), ``reader`` (listing, parsing, completeness), ``table``, ``anomaly`` (nan/inf in records),
``legacy`` (the original onnxruntime hooks' text block).
"""

from .anomaly import Anomaly, first_anomaly, record_anomaly
from .layout import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, DumpFormatError, DumpLayout, DumpWriteError,
                     safe_component)
from .legacy import legacy_block, legacy_file_name
from .live import flush_writers
from .reader import DumpReader, StepFile, list_steps, load_dump, load_table
from .record import Record, RecordKey, TensorFields, record_key
from .table import format_records
from .writer import DumpWriter, WriterConfig

__all__ = [
    "Anomaly",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "DumpFormatError",
    "DumpLayout",
    "DumpReader",
    "DumpWriteError",
    "DumpWriter",
    "Record",
    "RecordKey",
    "TensorFields",
    "StepFile",
    "WriterConfig",
    "first_anomaly",
    "flush_writers",
    "format_records",
    "legacy_block",
    "legacy_file_name",
    "list_steps",
    "load_dump",
    "load_table",
    "record_anomaly",
    "record_key",
    "safe_component",
]

