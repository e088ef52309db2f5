"""Records of DTensors (FSDP2's parameters, gradients and optimizer state): of the whole tensor, never gathered.

    shards = ShardGroups(step_rows)                     # probes.stats.shards
    dtensors = DTensorRecords(step_rows, shards)
    if is_dtensor(tensor):                              # probes.stats.views
        error = dtensors.add(names, step, "param", seq, tensor)   # None, or why it has no statistics
    shards.flush()                                      # at the step's end, on every rank: the records go to step_rows

``torch.distributed.fsdp.fully_shard`` (FSDP2) makes each parameter a DTensor with one ``Shard(0)`` placement on
a 1-D device mesh; its gradient and the optimizer's state of it (Adam's ``exp_avg``, ``exp_avg_sq``) are alike.
Each rank holds rows ``[start, end)`` of dim 0, as ``torch.chunk`` splits them (uneven: the last ranks may hold
fewer, or none), so a contiguous range of the flattened tensor: ``add`` computes this rank's shard's row
into the caller's ``probes.stats.shards.ShardGroups``, whose ``flush`` gathers the rows of every rank of the mesh
(one all_gather per mesh, per step) and merges them exactly into the record of the whole tensor, the same on
every rank; its ``shape`` is the full shape, and it has no ``hash`` (no rank holds the whole tensor's bytes).

By placement:

- one ``Shard(0)`` on a 1-D mesh: merged across the mesh's ranks, as above;
- ``Replicate()`` on every mesh dimension: the local tensor is the whole tensor; recorded as it is;
- anything else (another dim, ``Partial``, a 2-D mesh as in HSDP or FSDP with tensor parallelism): a record
  without statistics saying which placement, and the error returned (the caller warns once).

The flush is a collective: every rank must add the same tensors in the same order (the same selection
everywhere). The shard each rank holds is known from its placement alone; nothing is read back to the host.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ..dump.rowblock import RecordNames
from .rows import StepRows
from .shards import ShardGroups
from .views import UnsupportedTensor

__all__ = ["DTensorRecords", "chunk_bounds"]


@functools.lru_cache(maxsize=4096)
def chunk_bounds(shape: tuple[int, ...], world: int) -> tuple[tuple[int, int], ...]:
    """Per rank, the ``(start, end)`` of the flattened elements its ``Shard(0)`` holds (``torch.chunk`` on dim 0).

        chunk_bounds((7, 5), 2)   # ((0, 20), (20, 35))
        chunk_bounds((1,), 2)     # ((0, 1), (1, 1)): rank 1 holds nothing
    """
    rows, per_row = shape[0], math.prod(shape[1:])
    chunk = -(-rows // world)  # ceil: torch.chunk's chunk size
    return tuple((min(rank * chunk, rows) * per_row, min((rank + 1) * chunk, rows) * per_row) for rank in range(world))


class DTensorRecords:
    """The records of one subscriber's DTensors (see the module docstring): whole ones go to ``rows``, sharded ones
    to ``shards`` (flushed by the caller)."""

    def __init__(self, rows: StepRows, shards: ShardGroups) -> None:
        self._rows = rows
        self._shards = shards

    def add(self, names: RecordNames, step: int, phase: str, seq: int, tensor: Any) -> BaseException | None:
        """The record of DTensor ``tensor`` (sharded: merged at the shards' flush); the error when it has no statistics."""
        placements, mesh = tuple(tensor.placements), tensor.device_mesh
        if all(placement.is_replicate() for placement in placements):
            return self._rows.add_named(names, step, phase, seq, tensor.to_local())
        if mesh.ndim == 1 and type(placements[0]).__name__ == "Shard" and placements[0].is_shard(dim=0) \
                and tensor.dim() > 0:  # _StridedShard (FSDP with TP) is a Shard of another layout: not here
            return self._shards.add(names, step, phase, seq, tensor.to_local(), full_shape=tuple(tensor.shape),
                                    bounds=chunk_bounds(tuple(tensor.shape), mesh.size()),
                                    rank=mesh.get_local_rank(), group=mesh.get_group())
        reason = (f"DTensor placements {placements} on a {mesh.ndim}-D mesh: probes records one Shard(0) on a 1-D mesh "
                  "(FSDP2's) or Replicate(), not this one")
        self._rows.add_unsupported_named(names, step, phase, seq, tensor, reason)
        return UnsupportedTensor(reason)
