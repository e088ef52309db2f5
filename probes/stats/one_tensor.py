"""The tensor's part of a statistics record: what the tensor is, its statistics and samples, or why there are none.

    record: Record = {"step": 0, "rank": 0, "name": "fc1.output.0", "phase": "forward", "seq": 0,
                      **tensor_record(torch.randn(4, 4))}

``tensor_record`` and ``unsupported_record`` return ``probes.dump.TensorFields``, a record without the
keys that say where and when (step, rank, name, phase, seq, ...): the caller adds them.
"""

from __future__ import annotations

import os

import torch

from ..dump.columns import table_to_records
from ..dump.record import TensorFields
from ..dump.rowblock import NAME_FIELDS
from .numerics import DEFAULT_BUCKET_SIZE
from .rows import StepRows, unsupported_description
from .views import UnsupportedTensor

__all__ = ["DEFAULT_BUCKET_SIZE", "DEFAULT_SAMPLE_COUNT", "process_rank", "tensor_record", "unsupported_reason",
           "unsupported_record"]

DEFAULT_SAMPLE_COUNT = 32
_REASON_LENGTH = 300


def process_rank() -> int:
    """This process's rank: torch.distributed's when initialised, else the launcher's RANK, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


_IDENTITY = ("step", "rank", "phase", "seq", *NAME_FIELDS)


def tensor_record(tensor: torch.Tensor, *, bucket_size: int = DEFAULT_BUCKET_SIZE, run_on_cpu: bool = False,
                  sample_count: int = DEFAULT_SAMPLE_COUNT, hash: bool = False) -> TensorFields:
    """The statistics part of a record: shape, dtype, numel, summary statistics and samples.

        record = tensor_record(torch.randn(4, 4))

    For a tensor that is not dense and real, also ``"layout"`` (when not strided) and ``"stats_of"``;
    numel, the counts, the samples and their indices are then those of ``statistics_view(tensor)``.
    ``hash``: also ``"hash"``, the 64-bit hash of those bytes (``probes.stats.hashing``).
    Raises for tensors that cannot be summarised (see ``unsupported_record``). The same path as the
    subscriber's records (``probes.stats.rows``): a row, its Arrow table, read back at once.
    """
    rows = StepRows(rank=0, sample_count=sample_count, bucket_size=bucket_size, run_on_cpu=run_on_cpu, hash=hash)
    error = rows.add_named(("", 0, "", "", "output", 0, "", None), 0, "forward", 0, tensor)
    if error is not None:
        raise error
    return table_to_records(rows.take()[0].to_table().drop_columns(list(_IDENTITY)))[0]  # type: ignore[return-value]


def unsupported_reason(error: BaseException) -> str:
    """A one-line reason for a record's ``"unsupported"`` field.

        unsupported_reason(UnsupportedTensor("meta tensor: it has no data"))   # "meta tensor: it has no data"
    """
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if not isinstance(error, UnsupportedTensor):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= _REASON_LENGTH else text[: _REASON_LENGTH - 3] + "..."


def unsupported_record(tensor: torch.Tensor, reason: str) -> TensorFields:
    """The statistics part of a record for a tensor without statistics: what is known of it, and why.

        unsupported_record(torch.empty(2, device="meta"), "meta tensor: it has no data")
    """
    described = unsupported_description(tensor, reason)
    return {key: getattr(described, key) for key in described.present}  # type: ignore[return-value]
