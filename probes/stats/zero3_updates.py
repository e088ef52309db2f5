"""Parameter records of a DeepSpeed ZeRO-3 engine: each rank's shards of the fp32 master copy, merged exactly.

    updates = Zero3Updates(shards)                      # shards: a probes.stats.shards.ShardGroups
    owner = updates.owner_of(optimizer, parameters)     # in a torch optimizer step hook: the ZeRO-3 optimizer, or None
    stepping = updates.shards(owner, optimizer)         # this rank's shards of what steps now (.last: the step's end)
    updates.add(names, step, "grad", seq, shard.grad, shard)   # pre-hook: grad; post-hook: master, state
    shards.flush()                                      # after the last sub-group: one all_gather, records in rows

A ZeRO-3 engine steps a torch optimizer over flat fp32 partitions, once per sub-group: torch's global step
hooks (``probes.stats.parameters``) see that inner optimizer, whose parameters name no model parameter.
``exporters.adapters.deepspeed_internals`` finds its ZeRO-3 optimizer and this rank's shard of each model parameter (in the
pre-hook the gradient the update uses, after unscaling and clipping; in the post-hook the updated master copy
and optimizer state); ``add`` computes a shard's row (``probes.stats.shards``). After the engine's last
sub-group, one ``all_gather`` per process group merges every rank's rows into one record per tensor, on every
rank: the statistics of the whole tensor, which is never gathered.

Every rank must record the same tensors in the same order (the selection is the same everywhere): the merge
is a collective. A merged record has no ``hash`` (the hash is of bytes one rank holds whole).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from exporters.adapters import deepspeed_internals

from ..dump.rowblock import RecordNames
from .shards import ShardGroups

__all__ = ["Zero3Updates"]

_NOT_ZERO3 = object()


class Zero3Updates:
    """The shard rows of one subscriber's parameter records under ZeRO-3 (see the module docstring)."""

    def __init__(self, shards: ShardGroups) -> None:
        self._owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # inner optimizer -> owner or _NOT_ZERO3
        self._shards = shards

    def owner_of(self, optimizer: torch.optim.Optimizer, parameters: Callable[[], Iterable[torch.Tensor]]) -> Any:
        """The ZeRO-3 optimizer whose inner torch optimizer is ``optimizer`` (cached), or None."""
        owner = self._owners.get(optimizer)
        if owner is None:
            owner = deepspeed_internals.zero3_optimizer_of(optimizer, parameters()) or _NOT_ZERO3
            self._owners[optimizer] = owner
        return None if owner is _NOT_ZERO3 else owner

    def shards(self, owner: Any, optimizer: torch.optim.Optimizer) -> deepspeed_internals.Zero3Stepping:
        """This rank's shards of the sub-groups ``optimizer`` steps now."""
        return deepspeed_internals.zero3_stepping(owner, optimizer)

    def add(self, names: RecordNames, step: int, phase: str, seq: int, tensor: torch.Tensor,
            shard: deepspeed_internals.Zero3Shard) -> BaseException | None:
        """The row of one shard; merged with the other ranks' at the shards' flush. The error of failed statistics."""
        return self._shards.add(names, step, phase, seq, tensor, full_shape=shard.full_shape, bounds=shard.bounds,
                                rank=shard.rank, group=shard.group)
