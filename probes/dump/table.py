"""Records as a text table for the terminal (``python -m probes show``).

    print(format_records(load_dump("pt_out")))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..utils.tables import printable, text_table
from .hashes import HASH, hex_hash
from .record import Record
from .statistics import names
from .trainer_steps import TrainerStep

__all__ = ["format_records"]

_COLUMNS = ("step", "phase", "seq", "name", "shape", "dtype", *names(shown=True))
_LEFT_ALIGNED = frozenset({"phase", "name", "shape", "dtype"})


def _cell(record: Record, key: str) -> str:
    if key not in record:
        return ""
    value = record[key]  # type: ignore[literal-required]
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if key == HASH:
        return hex_hash(value)
    if key == "shape" and isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(size) for size in value) + "]"
    return printable(value)  # names come from the model: no control characters to the terminal


def format_records(records: Iterable[Record],
                   trainer_steps: Mapping[int, Mapping[int, TrainerStep]] | None = None) -> str:
    """A text table, one line per record: step, phase, seq, name, shape, dtype, then the statistics
    ``probes show`` shows (``probes.dump.statistics``: mean, min, max, nan, inf, std, norm), and the hash
    (hex) when a record has one.

    A rank column comes first when the records span several ranks; with ``trainer_steps``
    (``read_trainer_steps``: rank -> step -> ``TrainerStep``) the trainer's step and micro-batch follow
    the step. No trailing newline.
    """
    records = list(records)
    columns = list(_COLUMNS)
    if any(record.get(HASH) is not None for record in records):
        columns.append(HASH)
    rows = [[_cell(record, column) for column in columns] for record in records]
    if trainer_steps:
        columns[1:1] = ["trainer_step", "micro_step"]
        for row, record in zip(rows, records):
            entry = trainer_steps.get(record.get("rank"), {}).get(record.get("step"))  # type: ignore[arg-type]
            row[1:1] = ["-", "-"] if entry is None else \
                ["-" if entry.trainer_step is None else str(entry.trainer_step), str(entry.micro_step)]
    if len({record.get("rank") for record in records}) > 1:
        columns.insert(0, "rank")
        for row, record in zip(rows, records):
            row.insert(0, _cell(record, "rank"))
    right = {index for index, column in enumerate(columns) if column not in _LEFT_ALIGNED}
    return "\n".join(text_table(columns, rows, right=right))
