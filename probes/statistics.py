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
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from .dump import DumpWriter
from .numerics import TensorSummary, sample_indices, summarize, take_samples
from .subscriber import ProbeEvent, SubscriberBase

DEFAULT_BUCKET_SIZE = 1 << 22  # elements; bounds the extra memory of one statistics pass
DEFAULT_SAMPLE_COUNT = 32


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


def tensor_record(tensor: torch.Tensor, *, bucket_size: int = DEFAULT_BUCKET_SIZE, run_on_cpu: bool = False,
                  sample_count: int = DEFAULT_SAMPLE_COUNT) -> dict[str, Any]:
    """The statistics part of a record: shape, dtype, numel, summary statistics and samples."""
    summary: TensorSummary = summarize(tensor, bucket_size=bucket_size, run_on_cpu=run_on_cpu)
    indices, index_tensor = _sample_positions(tensor.numel(), sample_count, tensor.device)
    return {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        **summary.to_dict(),
        "samples": take_samples(tensor, index_tensor),
        "sample_indices": list(indices),
    }


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

    def on_forward(self, event: ProbeEvent, tensors: Sequence[torch.Tensor]) -> None:
        for index, tensor in enumerate(tensors):
            self._write(event, index, tensor)

    def on_backward(self, event: ProbeEvent, grads: Sequence[torch.Tensor | None]) -> None:
        for index, grad in enumerate(grads):
            if grad is not None:
                self._write(event, index, grad)

    def on_step_end(self, step: int) -> None:
        self._writer.finish_step(step)

    def flush(self) -> None:
        """Block until every record queued so far is on disk."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

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
        record.update(tensor_record(tensor.detach(), bucket_size=self.bucket_size, run_on_cpu=self.run_on_cpu,
                                    sample_count=self.sample_count))
        self._writer.write(event.step, record)
