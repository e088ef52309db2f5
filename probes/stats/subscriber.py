"""StatisticsSubscriber: exact per-step statistics of every module output and of its gradient.

    from probes import SubscriberManager, StatisticsSubscriber
    SubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])
    ... train ...
    SubscriberManager.unsubscribe()        # finishes the last step and closes the dump
    records = probes.load_dump("pt_out")   # or: python -m probes show pt_out --step 0

Statistics are computed inside the probe Functions, so they are the same code in eager PyTorch and
in ORTModule. Each record (see ``probes.dump`` for the layout on disk) holds the tensor's shape,
dtype, numel, min/max/mean/std over finite elements, nan/inf/neg/pos/zero counts and samples at
deterministic positions spread over the tensor; ``probes.numerics`` computes them in float64
bucket by bucket, without cloning the tensor.

Tensors that are not dense real tensors (complex, sparse, quantized, nested, DTensor) are summarised
through what they hold; the record's ``"stats_of"`` says what (see ``statistics_view``). Tensors
without readable data (meta, FakeTensor, other ``__torch_dispatch__`` subclasses), and any tensor
whose statistics fail, get a record with ``"unsupported": "<reason>"`` and no statistics, and one
``UnsupportedTensorWarning`` per site, tensor and phase: a probe never stops training.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from ..dump import DumpWriter
from .numerics import TensorSummary, is_dense, is_dispatch_subclass, sample_indices, summarize, take_samples
from ..core import ProbeEvent, SubscriberBase

DEFAULT_BUCKET_SIZE = 1 << 22  # elements; bounds the extra memory of one statistics pass
DEFAULT_SAMPLE_COUNT = 32
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})
_REASON_LENGTH = 300


class UnsupportedTensorWarning(UserWarning):
    """A probe met a tensor it cannot summarise; its records say ``"unsupported"`` instead.

        warnings.simplefilter("error", UnsupportedTensorWarning)   # make such tensors fail a test
    """


class SubscriberClosedWarning(UserWarning):
    """A closed StatisticsSubscriber was still called by its subscription; those records are not written."""


class UnsupportedTensor(TypeError):
    """Raised by ``statistics_view`` for a tensor without data the statistics can read."""


def process_rank() -> int:
    """This process's rank: torch.distributed's when initialised, else the launcher's RANK, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


@functools.lru_cache(maxsize=4096)
def _sample_positions(numel: int, count: int, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """Sample indices for a tensor size, as a list (for the record) and a tensor (for torch.take)."""
    indices = sample_indices(numel, count)
    return indices, torch.tensor(indices, dtype=torch.int64, device=device)


def _is_ordinary(tensor: torch.Tensor) -> bool:
    """A dense, real, readable tensor: summarised as it is (the common case, checked first)."""
    return is_dense(tensor) and not tensor.is_complex()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a DTensor. Its module is loaded once one exists, so nothing is imported here."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # public from torch 2.5
        dtensor = getattr(sys.modules.get(name), "DTensor", None)
        if isinstance(dtensor, type) and isinstance(tensor, dtensor):
            return True
    return False


def layout_name(tensor: torch.Tensor) -> str:
    """The record's ``"layout"``: torch's layout name, or ``nested_strided`` / ``nested_jagged``.

        layout_name(torch.eye(2).to_sparse())   # "sparse_coo"
    """
    name = str(tensor.layout).removeprefix("torch.")
    return f"nested_{name}" if tensor.is_nested else name


def _shape(tensor: torch.Tensor) -> list[int | None] | None:
    """The shape as ints; a ragged (nested) or symbolic dimension is None; None when there is none."""
    try:
        dims = tensor.dim()
    except Exception:
        return None
    shape: list[int | None] = []
    for dim in range(dims):
        try:
            size = tensor.size(dim)
        except Exception:  # an irregular dimension of a strided nested tensor
            size = None
        shape.append(size if isinstance(size, int) else None)
    return shape


def _components(tensor: torch.Tensor) -> torch.Tensor:
    """All elements of a nested tensor's components, flattened and concatenated (a copy)."""
    parts = [part.reshape(-1) for part in tensor.unbind()]
    if not parts:
        return torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return torch.cat(parts)


def _container_view(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """(a strided tensor with data, what it is of) for sparse, nested, DTensor; raises UnsupportedTensor."""
    if is_dispatch_subclass(tensor):
        if _is_dtensor(tensor):
            return tensor.to_local(), "local_shard"
        if tensor.is_nested:
            return _components(tensor), "components"
        if any(cls.__name__ == "FakeTensor" for cls in type(tensor).__mro__):
            raise UnsupportedTensor("FakeTensor: it has no data (made under a FakeTensorMode)")
        raise UnsupportedTensor(f"tensor subclass {type(tensor).__qualname__} (__torch_dispatch__): "
                                "its data is not a plain tensor the statistics can read")
    if tensor.is_meta:
        raise UnsupportedTensor("meta tensor: it has no data")
    # detach(): values() is a view of the sparse tensor, which no view op (view_as_real) can replay.
    if tensor.layout is torch.sparse_coo:
        # Statistics of the tensor's values: an uncoalesced copy is summed like the tensor (never in place).
        return tensor.coalesce().values().detach(), "values"
    if tensor.layout in _SPARSE_LAYOUTS:
        return tensor.values().detach(), "values"
    if tensor.is_nested:
        return _components(tensor), "components"
    if tensor.layout is not torch.strided:
        raise UnsupportedTensor(f"layout {layout_name(tensor)}: not supported")
    return tensor, None


def _element_view(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """(a real tensor, what it is of) for quantized and complex elements."""
    if tensor.is_quantized:
        return tensor.dequantize(), "dequantized"
    if tensor.is_complex():
        # view_as_real refuses a lazily conjugated tensor; resolve_conj copies only then.
        return torch.view_as_real(tensor.resolve_conj()), "real_imag"
    return tensor, None


def statistics_view(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """The dense real tensor whose statistics describe ``tensor``, and the record's ``"stats_of"``.

        values, stats_of = statistics_view(torch.randn(3, dtype=torch.complex64))   # (3, 2) float32, "real_imag"

    ``stats_of`` is None for an ordinary tensor (summarised as it is), else "real_imag" (complex: the
    real and imaginary parts together, ``torch.view_as_real``), "values" (sparse: the stored values,
    of a coalesced copy for COO), "dequantized", "components" (nested: all elements of all components)
    or "local_shard" (DTensor: this rank's shard), joined by "/" when several apply
    ("values/real_imag"). Raises UnsupportedTensor for tensors without readable data.
    """
    if _is_ordinary(tensor):
        return tensor, None
    tensor, outer = _container_view(tensor)
    if outer == "local_shard":  # the shard is a tensor of its own: complex, sparse, ...
        tensor, inner = statistics_view(tensor)
    else:
        tensor, inner = _element_view(tensor)
    return tensor, "/".join(label for label in (outer, inner) if label) or None


def tensor_record(tensor: torch.Tensor, *, bucket_size: int = DEFAULT_BUCKET_SIZE, run_on_cpu: bool = False,
                  sample_count: int = DEFAULT_SAMPLE_COUNT) -> dict[str, Any]:
    """The statistics part of a record: shape, dtype, numel, summary statistics and samples.

        record = tensor_record(torch.randn(4, 4))

    For a tensor that is not dense and real, also ``"layout"`` (when not strided) and ``"stats_of"``;
    numel, the counts, the samples and their indices are then those of ``statistics_view(tensor)``.
    Raises for tensors that cannot be summarised (see ``unsupported_record``).
    """
    values, stats_of = statistics_view(tensor)
    summary: TensorSummary = summarize(values, bucket_size=bucket_size, run_on_cpu=run_on_cpu)
    indices, index_tensor = _sample_positions(values.numel(), sample_count, values.device)
    record: dict[str, Any] = {
        "shape": list(tensor.shape) if stats_of is None else _shape(tensor),
        "dtype": str(tensor.dtype).removeprefix("torch."),
    }
    if stats_of is not None:
        if tensor.layout is not torch.strided or tensor.is_nested:
            record["layout"] = layout_name(tensor)
        record["stats_of"] = stats_of
    record.update(summary.to_dict())
    record["samples"] = take_samples(values, index_tensor)
    record["sample_indices"] = list(indices)
    return record


def unsupported_reason(error: BaseException) -> str:
    """A one-line reason for a record's ``"unsupported"`` field.

        unsupported_reason(UnsupportedTensor("meta tensor: it has no data"))   # "meta tensor: it has no data"
    """
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if not isinstance(error, UnsupportedTensor):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= _REASON_LENGTH else text[: _REASON_LENGTH - 3] + "..."


def unsupported_record(tensor: torch.Tensor, reason: str) -> dict[str, Any]:
    """The statistics part of a record for a tensor without statistics: what is known of it, and why.

        unsupported_record(torch.empty(2, device="meta"), "meta tensor: it has no data")
    """
    record: dict[str, Any] = {"shape": _shape(tensor), "dtype": None, "layout": None}
    for key, describe in (("dtype", lambda t: str(t.dtype).removeprefix("torch.")), ("layout", layout_name)):
        try:
            record[key] = describe(tensor)
        except Exception:  # a broken subclass: keep what could be read
            pass
    record["stats_of"] = None
    record["unsupported"] = reason
    return record


class StatisticsSubscriber(SubscriberBase):
    """Dumps statistics of module outputs (forward) and their gradients (backward), per rank and step.

    Args:
        output_dir: where the dump goes (``<output_dir>/rank_<r>/step_<N>.jsonl``).
        start_step, end_step: record steps in ``[start_step, end_step)``.
        override_output_dir: replace this rank's earlier dump in ``output_dir``.
        run_on_cpu: move one bucket at a time to the CPU to compute (saves device memory).
        bucket_size: elements per statistics pass; bounds the extra memory.
        sample_count: how many samples to keep per tensor.
        observe_inputs: also record module inputs.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        start_step: int | None = None,
        end_step: int | None = None,
        override_output_dir: bool = False,
        run_on_cpu: bool = False,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        sample_count: int = DEFAULT_SAMPLE_COUNT,
        observe_inputs: bool = False,
    ) -> None:
        super().__init__(start_step, end_step)
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive int (elements), got {bucket_size!r}")
        if not isinstance(sample_count, int) or sample_count < 0:
            raise ValueError(f"sample_count must be a non-negative int, got {sample_count!r}")
        self.output_dir = Path(output_dir)
        self.run_on_cpu = run_on_cpu
        self.bucket_size = bucket_size
        self.sample_count = sample_count
        self.observe_inputs = observe_inputs
        self.rank = process_rank()
        self._writer = DumpWriter(self.output_dir, rank=self.rank, override=override_output_dir)
        self._closed = False
        self._warned_closed = False
        self._warned_unsupported: set[tuple[str, str, int, str]] = set()

    def on_forward(self, event: ProbeEvent, tensors: Sequence[torch.Tensor]) -> None:
        if self._closed:
            if tensors:
                self._warn_closed(event.step)
            return
        for index, tensor in enumerate(tensors):
            self._write(event, index, tensor)

    def on_backward(self, event: ProbeEvent, grads: Sequence[torch.Tensor | None]) -> None:
        if self._closed:
            if any(grad is not None for grad in grads):
                self._warn_closed(event.step)
            return
        for index, grad in enumerate(grads):
            if grad is not None:
                self._write(event, index, grad)

    def on_step_end(self, step: int) -> None:
        # After close() there is nothing to finish: close() finished every step that had records,
        # and records that arrived later were dropped with a warning.
        if not self._closed:
            self._writer.finish_step(step)

    def flush(self) -> None:
        """Block until every record queued so far is on disk."""
        self._writer.flush()

    def close(self) -> None:
        """Finish every step written so far and stop the writer; idempotent.

        Closing by hand before the subscription ends is allowed: later calls write nothing and warn once.
        """
        if self._closed:
            return
        self._closed = True
        self._writer.close()

    def _warn_closed(self, step: int) -> None:
        if self._warned_closed:
            return
        self._warned_closed = True
        warnings.warn(
            f"probes: StatisticsSubscriber({str(self.output_dir)!r}) was closed before its subscription ended; "
            f"records of step {step} and later are not written (the dump keeps what was written before "
            "close()). End the subscription instead: SubscriberManager.unsubscribe() closes its subscribers.",
            SubscriberClosedWarning,
            stacklevel=2,
        )

    def _statistics(self, event: ProbeEvent, index: int, tensor: torch.Tensor) -> dict[str, Any]:
        """tensor_record(tensor), or on any failure an unsupported record (warned once per site, index, phase)."""
        try:
            return tensor_record(tensor.detach(), bucket_size=self.bucket_size, run_on_cpu=self.run_on_cpu,
                                 sample_count=self.sample_count)
        except Exception as error:  # a probe is an observer: nothing about a tensor may stop training
            reason = unsupported_reason(error)
        key = (event.site.name, event.site.kind, index, event.phase)
        if key not in self._warned_unsupported:
            self._warned_unsupported.add(key)
            warnings.warn(
                f"probes: no statistics for {event.record_name(index)} ({event.phase}): {reason}. "
                "Its records have \"unsupported\" set and no statistics; this warning is not repeated.",
                UnsupportedTensorWarning,
                stacklevel=2,
            )
        return unsupported_record(tensor, reason)

    def _write(self, event: ProbeEvent, index: int, tensor: torch.Tensor) -> None:
        site = event.site
        record = {
            "step": event.step,
            "rank": self.rank,
            "name": event.record_name(index),
            "phase": event.phase,
            "seq": event.seq,
            "tensor_index": index,
            "module": site.name,
            "module_class": site.module_class,
            "kind": site.kind,
            "depth": site.depth,
            "legacy_name": site.legacy_name(index),
        }
        record.update(self._statistics(event, index, tensor))
        self._writer.write(event.step, record)  # outside _statistics: dump errors reach the training thread
