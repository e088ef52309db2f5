"""Records for tests that write dumps, through the writer's real hand-over: a RowBlock of statistics rows
(``row_block``, what the subscriber hands it) or an Arrow table (``write_record``, a record of any values).

    write_record(writer, 0, {"name": "fc.output.0", "phase": "forward", "seq": 0, "mean": 0.5})
    writer.write(0, row_block(0, [torch.randn(4)], names=["fc.output.0"]))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from probes.dump.columns import records_to_table
from probes.dump.rowblock import RecordNames
from probes.dump.writer import DumpWriter


def write_record(writer: DumpWriter, step: int, record: Mapping[str, Any]) -> None:
    """One record of ``step`` as a one-row table of the dump's schema (a value without a column goes to
    ``extra``, as JSON: one that is not JSON raises here)."""
    writer.write(step, records_to_table([record], step=step, rank=writer.config.rank))


def row_block(step: int, tensors: Sequence[Any], *, names: Sequence[str] | None = None, rank: int = 0,
              phase: str = "forward", sample_count: int = 32):
    """The records of ``tensors`` as the subscriber makes them: statistics rows (``StepRows``), one RowBlock."""
    from probes.stats.rows import StepRows

    rows = StepRows(rank=rank, sample_count=sample_count)
    for seq, tensor in enumerate(tensors):
        name = names[seq] if names is not None else f"layer{seq}.output.0"
        error = rows.add_named(RecordNames(name, 0, name.rsplit(".output", 1)[0], "Linear", "output", 1,
                                           f"Linear_{seq}_0th_output", None), step, phase, seq, tensor)
        assert error is None, error
    (block,) = rows.take()
    return block
