"""The statistics record: one tensor (or gradient) at one site, step and phase; one line of a dump.

Writer, reader, compare, the HTML report and the merge tool all read and write this one type. On
disk it is a JSON object with exactly these keys (dumps written by earlier versions have the same
keys; a reader must not require the optional ones).

    record: Record = {"step": 0, "rank": 0, "name": "fc1.output.0", "phase": "forward", "seq": 3, ...}
    key = record_key(record)        # (rank, step, phase, name): unique within a dump
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict, Union

from ..utils.phases import Phase, phase_rank

Number = Union[int, float]
RecordKey = tuple[int, int, str, str]  # (rank, step, phase, name)

IDENTITY_FIELDS = ("rank", "step", "phase", "name")  # a record's key, unique within a dump
REQUIRED_FIELDS = ("step", "rank", "name", "phase", "seq")  # what the dump format itself relies on


class _RecordBase(TypedDict):
    # Where and when (written for every record).
    step: int
    rank: int
    name: str  # e.g. "blocks.0.attn.output.0"; "#<k>" after the module name from its second call in a step
    phase: Phase
    seq: int  # execution order within the step, all phases on one counter


class TensorFields(TypedDict, total=False):
    """What a record says of its tensor (``probes.stats.tensor_record`` builds this part)."""

    shape: list[int | None] | None
    dtype: str | None  # "float32", ...
    layout: str | None  # only for tensors that are not strided, or not dense and real
    stats_of: str | None  # what the statistics summarise when not the tensor itself ("real_imag", ...)
    unsupported: str  # why there are no statistics (then the statistics keys are absent)
    # Statistics: the registry's (probes.dump.statistics), for type checkers; tests/dump/test_record.py ties the two.
    min: Number | None
    max: Number | None
    mean: float | None
    std: float | None
    norm: float | None  # L2 norm of the finite elements
    m2: float  # sum of squared deviations from the mean, kept so that shards merge exactly
    numel: int
    finite: int
    nan: int  # the five counts are over all elements
    inf: int
    neg: int
    pos: int
    zero: int
    samples: list[Number]  # values at sample_indices (flat, row-major positions)
    sample_indices: list[int]
    hash: int  # with hash=True: the 64-bit hash of the tensor's bytes, int64 bits (probes.dump.hashes)


class Record(_RecordBase, TensorFields, total=False):
    """One statistics record: where and when (always present), the site, and ``TensorFields``."""

    tensor_index: int
    module: str  # the module's qualified name ("<root>" for the root), or the inspect name
    module_class: str
    kind: Literal["input", "output", "inspect", "op"]  # "op": an operation inside a module (name "<module>/<op>:<k>...")
    depth: int
    legacy_name: str  # the original onnxruntime hooks' "<Class>_<index>_<i>th_output"
    inputs: list[str]  # an op record's tensor arguments, in order: the record names they were ("" where none)


def record_key(record: Record) -> RecordKey:
    """(rank, step, phase, name): what identifies a record within a dump, and across two runs."""
    return record["rank"], record["step"], record["phase"], record["name"]


def execution_order(step: int, phase: str, seq: Any, rank: int) -> tuple[int, int, int, int]:
    """Sort key of the execution order across ranks: step, phase (forward ... optim: ``phase_rank``), seq, rank."""
    return step, phase_rank(phase), seq if isinstance(seq, int) else 0, rank
