"""A record as the original onnxruntime hooks' text block (their StatisticsSubscriber's file layout).

    text = legacy_block(record)                 # "Linear_1_0th_output forward run [fc1.output.0] shape: ..."
    text = legacy_block(record, with_name=False)  # the original's header exactly, for ``probes export --format ort``

Used by ``probes merge`` (per-step summaries) and ``probes export --format ort`` (per-record files), so
that scripts written against the original's output keep reading ours. One deliberate difference: the
samples line shows the values the dump kept, with their flat indices (the original printed the first
128 elements).
"""

from __future__ import annotations

from typing import Any

from .record import Record

__all__ = ["legacy_block", "legacy_file_name"]

SEPARATOR = "=" * 16


def _shape_text(shape: Any) -> str:
    if isinstance(shape, list):
        return f"torch.Size([{', '.join(str(size) for size in shape)}])"
    return str(shape)


def legacy_file_name(record: Record) -> str:
    """The original's file name of a record: ``<legacy name>_forward`` or ``<legacy name>_backward``."""
    return f"{record.get('legacy_name') or record['name']}_{record.get('phase', '')}"


def legacy_block(record: Record, *, with_name: bool = True) -> str:
    """One record as the original's text block (header, moments, counts, samples, signs, separator).

    ``with_name`` adds the record's qualified name in brackets after the original's display name.
    """
    phase = record.get("phase", "")
    legacy = record.get("legacy_name") or record["name"]
    depth = record.get("depth")
    # The original counted the outermost module as depth 1; a record's depth is 0 there.
    indent = ">" * (depth + 1) if isinstance(depth, int) and depth >= 0 else ""
    numel = record.get("numel")
    name = f" [{record['name']}]" if with_name else ""
    return (
        f"{indent}{legacy} {phase} run{name} shape: {_shape_text(record.get('shape'))} "
        f"dtype: torch.{record.get('dtype')} size: torch.Size([{numel}]) \n"
        f"min: {record.get('min')} max: {record.get('max')}, mean: {record.get('mean')}, std: {record.get('std')} \n"
        f"nan: {record.get('nan')}, inf: {record.get('inf')}\n"
        f"samples(at flat indices {record.get('sample_indices', [])}): {record.get('samples', [])}\n"
        f"neg: {record.get('neg')}, pos: {record.get('pos')}, zero: {record.get('zero')},\n"
        f"{SEPARATOR}\n"
    )
