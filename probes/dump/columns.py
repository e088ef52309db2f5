"""The columnar form of records: one Arrow schema, records to a table and back, Parquet step files.

    table = records_to_table(records)          # one row per record, the columns of SCHEMA
    write_parquet(path, table)                 # what a finished step of a Parquet dump is
    table = read_parquet(path)                 # any Parquet reader (pandas, polars, DuckDB, Spark) reads it too
    records = table_to_records(table)          # the same records again, key for key, value for value

Each record key the statistics subscriber writes has a typed column of the same name. The round trip
is exact: a key absent from a record is null in its column; a key present with the value None is listed
in the row's ``nulls``; an integer ``min``/``max``/``samples`` (integer tensors) goes to its ``*_int``
twin (the float column holds the same value as a float, for analysis); any other key, or a value whose
type is not its column's, goes to the row's ``extra`` (a JSON object). Read by column name, never by
position. The encodings keep a record with 32 samples near 230 bytes (zstd; floats byte-stream-split, so
a float32 value held as a float64 costs little more than 4 bytes; increasing indices delta-packed).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pa_dataset
import pyarrow.parquet as pq

from .record import Record
from .statistics import STATISTICS

__all__ = ["NUMBER_COLUMNS", "PARQUET_FORMAT", "SCHEMA", "NotAStepFile", "footer_records", "read_parquet",
           "records_to_table", "table_to_records", "write_parquet"]

_INT, _FLOAT, _STR = pa.int64(), pa.float64(), pa.string()
_INTS, _FLOATS, _STRS = pa.list_(_INT), pa.list_(_FLOAT), pa.list_(_STR)

# In the order the statistics subscriber writes a record's keys, so a round trip keeps that order too.
_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("step", _INT), ("rank", _INT), ("name", _STR), ("phase", _STR), ("seq", _INT), ("tensor_index", _INT),
    ("module", _STR), ("module_class", _STR), ("kind", _STR), ("depth", _INT), ("legacy_name", _STR),
    ("inputs", _STRS),  # an op record's tensor arguments: the record names they were ("" where none)
    ("shape", _INTS), ("dtype", _STR), ("layout", _STR), ("stats_of", _STR), ("unsupported", _STR),
    *((stat.name, _INT if stat.column == "int" else _FLOAT) for stat in STATISTICS),  # "number": a float + twin
    ("samples", _FLOATS), ("sample_indices", _INTS),
    ("hash", _INT),  # the tensor's 64-bit hash as int64 bits (``hash=True``; null otherwise: optional)
)
# int or float in a record: each has an "<name>_int" twin
NUMBER_COLUMNS = (*(stat.name for stat in STATISTICS if stat.column == "number"), "samples")
_TWINS = {name: _INTS if name == "samples" else _INT for name in NUMBER_COLUMNS}
SCHEMA = pa.schema([pa.field(name, kind) for name, kind in _FIELDS]
                   + [pa.field(f"{name}_int", kind) for name, kind in _TWINS.items()]
                   + [pa.field("nulls", pa.list_(_STR)), pa.field("extra", _STR)])

_FLOAT_ENCODED = [name for name, kind in _FIELDS if kind in (_FLOAT, _FLOATS)]
_DELTA_ENCODED = ["sample_indices", "seq"]
_DICTIONARY = ["phase", "module_class", "kind", "dtype", "layout", "stats_of", "unsupported"]
_ENCODINGS = {**{name: "BYTE_STREAM_SPLIT" for name in _FLOAT_ENCODED},
              **{name: "DELTA_BINARY_PACKED" for name in _DELTA_ENCODED}}
_ZSTD = {"samples", "sample_indices", "name", "module", "legacy_name", "inputs", "extra"}
_ALWAYS = {"step", "rank", "name", "phase"}  # kept even when null: a step file says what it is


RECORDS_KEY = "probes.records"  # the footer's key-value metadata: how many records the step has (completeness)
_LOW, _HIGH = -(1 << 63), 1 << 63  # what an int64 column holds (a uint64 tensor's max goes to ``extra``)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and value.__class__ is not bool and _LOW <= value < _HIGH


def _ints(values: list) -> bool:
    return all(_LOW <= value < _HIGH for value in values)


_INT_CODE, _FLOAT_CODE, _STR_CODE, _FLOATS_CODE, _INTS_CODE, _STRS_CODE = range(6)
_CODES = {_INT: _INT_CODE, _FLOAT: _FLOAT_CODE, _STR: _STR_CODE, _FLOATS: _FLOATS_CODE, _INTS: _INTS_CODE,
          _STRS: _STRS_CODE}
_CODE = {name: _CODES[kind] for name, kind in _FIELDS}
_FLOAT_TYPES, _INT_TYPES, _STR_TYPES = frozenset({float}), frozenset({int, type(None)}), frozenset({str})


def records_to_table(records: Sequence[Mapping[str, Any]], *, step: int | None = None,
                     rank: int | None = None) -> pa.Table:
    """The records as one table of ``SCHEMA`` (see the module docstring for how every value is kept).

    ``step``, ``rank``: the values of records without those keys (a step file then stands on its own).
    """
    columns: dict[str, list[Any]] = {field.name: [None] * len(records) for field in SCHEMA}
    for row, record in enumerate(records):
        nulls: list[str] = []
        extra: dict[str, Any] = {}
        # One type test per key (the writer thread runs this for every record, the GIL held).
        for key, value in record.items():
            code = _CODE.get(key)
            if code is None:
                extra[key] = value
            elif value is None:
                nulls.append(key)
            elif code == _FLOAT_CODE:
                if isinstance(value, float):
                    columns[key][row] = value
                elif key in _TWINS and _is_int(value):
                    columns[f"{key}_int"][row], columns[key][row] = value, float(value)
                else:
                    extra[key] = value
            elif code == _INT_CODE:
                if _is_int(value):
                    columns[key][row] = value
                else:
                    extra[key] = value
            elif code == _STR_CODE:
                if isinstance(value, str):
                    columns[key][row] = value
                else:
                    extra[key] = value
            elif value.__class__ is not list:
                extra[key] = value
            else:
                types = set(map(type, value))
                if code == _FLOATS_CODE and types <= _FLOAT_TYPES:
                    columns[key][row] = value
                elif code == _FLOATS_CODE and types == {int} and key in _TWINS and _ints(value):
                    columns[f"{key}_int"][row], columns[key][row] = value, [float(item) for item in value]
                elif code == _INTS_CODE and types <= _INT_TYPES and _ints([item for item in value if item is not None]):
                    columns[key][row] = value
                elif code == _STRS_CODE and types <= _STR_TYPES:
                    columns[key][row] = value
                else:
                    extra[key] = value
        for key, value in (("step", step), ("rank", rank)):
            if key not in record:
                columns[key][row] = value
        if nulls:
            columns["nulls"][row] = nulls
        if extra:
            columns["extra"][row] = json.dumps(extra)  # the JSON Lines format's own rules: non-finite as NaN
    return pa.table({field.name: pa.array(columns[field.name], type=field.type) for field in SCHEMA}, schema=SCHEMA)


def table_to_records(table: pa.Table) -> list[Record]:
    """The records of a table of ``SCHEMA`` (or of some of its columns), exactly as they were written."""
    names = table.column_names
    data = {name: table.column(name).to_pylist() for name in names}
    ordered = [name for name, _ in _FIELDS if name in data]
    twins = [name for name in _TWINS if f"{name}_int" in data]
    nulls, extra = data.get("nulls"), data.get("extra")
    records: list[Record] = []
    for row in range(table.num_rows):
        record: dict[str, Any] = {}
        listed = nulls[row] if nulls is not None else None
        for name in ordered:
            value = data[name][row]
            if value is not None:
                record[name] = value
            elif listed and name in listed:
                record[name] = None
        for name in twins:
            value = data[f"{name}_int"][row]
            if value is not None:
                record[name] = value
        if extra is not None and extra[row] is not None:
            record.update(json.loads(extra[row]))
        records.append(record)  # type: ignore[arg-type]
    return records  # type: ignore[return-value]


def write_parquet(path: str | os.PathLike, table: pa.Table, *, durable: bool = True) -> None:
    """Writes ``table`` to ``path`` as one Parquet file, its record count in the footer (``footer_records``),
    and fsyncs it unless not ``durable`` (the caller renames it into place).

    Columns null in every row are left out of the file (``read_parquet`` puts them back): each column costs
    a reader time whatever it holds.
    """
    rows = table.num_rows
    kept = table.select([name for name, column in zip(table.column_names, table.columns)
                         if column.null_count < rows or name in _ALWAYS]).replace_schema_metadata(None)
    schema = kept.schema
    compression, encoding = _writer_options(tuple(schema.names), tuple(map(pa.types.is_list, schema.types)))
    # Built in an Arrow buffer (outside the GIL), then written in one call: Parquet writes a file in about 70
    # pieces, and each piece written to a Python file retakes the GIL, which the training thread wants too.
    buffer = pa.BufferOutputStream()
    with pq.ParquetWriter(buffer, schema, compression=compression, use_dictionary=_DICTIONARY,
                          column_encoding=encoding, write_statistics=["step", "rank"], store_schema=False,
                          write_page_checksum=True) as writer:
        writer.write_table(kept)
        writer.add_key_value_metadata({RECORDS_KEY: str(rows)})
    with open(path, "wb") as file:
        file.write(buffer.getvalue())  # larger than the file's buffer: passed on whole, without a copy
        file.flush()
        if durable:
            os.fsync(file.fileno())


def footer_records(metadata: Mapping[bytes, bytes] | None) -> int | None:
    """How many records a step file's footer says it holds (None: a file written before the count was kept)."""
    value = (metadata or {}).get(RECORDS_KEY.encode())
    return int(value) if value is not None and value.isdigit() else None


@functools.lru_cache(maxsize=64)
def _writer_options(names: tuple[str, ...], lists: tuple[bool, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """The Parquet compression and encoding of each column, for these columns (``lists``: which are lists).

    Made once per set of columns (a run's steps share a few): the writer thread builds them holding the GIL.
    """
    # zstd where the bytes are (samples, names); lz4 elsewhere: small columns decode faster with it.
    compression = {f"{name}.list.element" if is_list else name: "zstd" if name in _ZSTD else "lz4"
                   for name, is_list in zip(names, lists)}
    present = set(names)
    return compression, {name: encoding for name, encoding in _ENCODINGS.items() if name in present}


# How probes reads step files with pyarrow.dataset: pages checked against their checksums (flipped bytes).
PARQUET_FORMAT = pa_dataset.ParquetFileFormat(
    default_fragment_scan_options=pa_dataset.ParquetFragmentScanOptions(page_checksum_verification=True))


class NotAStepFile(ValueError):
    """A Parquet file without the columns every step file has."""


def read_parquet(path: str | Path, columns: Sequence[str] | None = None) -> pa.Table:
    """A Parquet step file as a table of ``SCHEMA`` (``columns``: only these). Raises ``pa.ArrowException``.

    Columns the file leaves out are null; the footer's key-value metadata is the table's schema metadata
    (``footer_records`` reads the record count). Arrow's threads off: a step file is small, starting them
    costs more than they save; ParquetFile, not read_table: no dataset discovery.
    """
    wanted = list(SCHEMA.names if columns is None else columns)
    with pq.ParquetFile(path, page_checksum_verification=True) as file:
        present = set(file.schema_arrow.names)
        missing = [name for name in _ALWAYS if name not in present]
        if missing:
            raise NotAStepFile(f"no {', '.join(sorted(missing, key=SCHEMA.names.index))} column")
        table = file.read(columns=[name for name in wanted if name in present], use_threads=False)
        metadata = file.metadata.metadata
    for name in wanted:
        if name not in present and name in SCHEMA.names:
            table = table.append_column(SCHEMA.field(name), pa.nulls(table.num_rows, SCHEMA.field(name).type))
    return table.select([name for name in wanted if name in table.column_names]).replace_schema_metadata(metadata)
