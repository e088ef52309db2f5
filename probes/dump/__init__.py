"""Dump I/O for statistics records: a background writer, a reader and a table printer.

Usage:
    writer = DumpWriter("pt_out", rank=0)             # raises now if the directory is unusable
    writer.write(step, block)                         # a RowBlock of statistics rows, or an Arrow table
    writer.finish_step(step)                          # the step becomes visible to readers
    writer.close()
    records = load_dump("pt_out")                     # or: python -m probes show pt_out --step 3
    table = load_table("pt_out")                      # the same records as an Arrow table (.to_pandas())
    reader = DumpReader("pt_out")                     # step by step: reader.step_files(), reader.read(f)

A record's life: a row of statistics on its tensor's device while the step runs (``probes.stats.rows``), a
``RowBlock`` handed to the writer thread, an Arrow table there (``rowblock``, ``columns.SCHEMA``), then a row
of the step's Parquet file. Read back, it is a row of a table (``load_table``) or a dict (``Record``,
``load_dump``). Only "step", "rank", "name", "phase" and "seq" mean something here; every other key is
passed through untouched. Nothing is pickled.

The rooms: ``record`` (the typed record), ``statistics`` (each statistic defined once), ``rowblock``
(records as statistics rows, turned into Arrow on the writer thread), ``columns`` (the Arrow schema, records
to a table and back, Parquet), ``layout`` (the format on disk, directory rules, errors), ``writer`` and
``stepfiles`` (the background writer and the files its thread writes: step files, journals), ``live``
(readers of this process wait for its live writers), ``reader`` (listing, parsing, completeness),
``table``, ``anomaly`` (nan/inf in records), ``legacy`` (the original onnxruntime hooks' text block).
"""

from .anomaly import first_anomaly
from .layout import DumpFormatError, DumpWriteError
from .reader import DumpReader, load_dump, load_table
from .record import Record

__all__ = [
    "DumpFormatError", "DumpReader", "DumpWriteError", "Record", "first_anomaly", "load_dump", "load_table",
]

