"""Tensors of one probe call that share memory: one tensor at several places, or tensors that are views of one another.

A probe hands back a detached alias of each tensor (``functions.passes_through``). For autograd two such
aliases of one memory are independent tensors: an in-place change made through one would reach the other's
values but not its gradient, which would then be wrong (a module returning ``x, x[:, 0]``, then ``x *= 2``
and a use of the second); under torch.compile or ORTModule not even its values. So, for the tensors of one
probe call (a module's outputs, or its inputs):

- one tensor at several places is probed once and comes back as one probed tensor at each place, as the
  module gave one tensor: its other places pass the probe as a detached alias (recorded, not differentiated;
  dynamo also refuses one tensor at two inputs of a Function), its gradient is recorded at its first place;
- floating-point tensors that are views of one another (``x`` and ``x[:, 0]``, two views of one base) are
  *read*: each passes the probe detached, so it gets a forward record, and the probe's outputs at those places
  are dropped: the caller gets the module's own tensors, views of one another as the module made them, with
  their autograd history. They get no gradient record, on any backend: rebuilding the views from a probed base
  would differentiate them in eager mode, but a compiled graph cannot (dynamo cannot read a view's storage
  offset), and every backend keeps the same records. The tensors beside them are probed as usual.
  Integer tensors need no such care (no gradient, so no wrong one).

    shared = find(tensors)                     # None when no two tensors share memory
    shared.read                                # the places of views of one another (forward record only)
    shared.read_only                           # every place is read: none of the probe's outputs is used
    outputs = shared.apply(tensors, probe)     # probe(every tensor, as it should pass) -> what the caller gets

A probe call whose outputs are all dropped is no consumer of anything for a graph: an exported graph (ORTModule's
TorchScript trace) would lose it, so the manager carries such outputs to the step boundary there. A compiled
graph keeps it (its ops mutate a token).

Everything here is traceable by dynamo (identity, ``_base``, dtypes, ``detach``): it runs while dynamo traces
the hooks, as in eager PyTorch and in ORTModule's export.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class SharedMemory:
    """Which places of one probe call repeat an earlier tensor, and which are only read (views of one another).
    (A plain class of plain containers: dynamo traces it.)"""

    def __init__(self, first: dict[int, int], read: tuple[int, ...], places: int) -> None:
        self.first = first  # a place -> the first place of the same tensor
        self.read = read  # places whose floating-point tensors are views of one another
        self.places = places
        self.read_only = len(read) == places  # no place's probed tensor goes on

    def apply(self, tensors: Sequence[torch.Tensor],
              probe: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """What the caller gets when ``probe`` passes every place's tensor (detached where it repeats an earlier
        tensor or is read): the first place's probed tensor at each repeated place, the module's own tensor at
        each read place."""
        probed = probe([tensors[place].detach() if place in self.first or place in self.read else tensors[place]
                        for place in range(len(tensors))])
        return [tensors[place] if place in self.read else probed[self.first.get(place, place)]
                for place in range(len(tensors))]

    def unread(self) -> "SharedMemory | None":
        """The same places, none only read (for a call after which no view relation can matter); None when no
        place repeats another."""
        return SharedMemory(self.first, (), self.places) if self.first else None


def find(tensors: Sequence[torch.Tensor]) -> SharedMemory | None:
    """The places of ``tensors`` that share memory, or None when none do."""
    if len(tensors) < 2:
        return None
    first: dict[int, int] = {}
    unique: list[int] = []
    for place, tensor in enumerate(tensors):
        for other in unique:
            if tensors[other] is tensor:
                first[place] = other
                break
        else:
            unique.append(place)
    read: set[int] = set()
    roots = [_root(tensors[place]) for place in unique]
    for position, place in enumerate(unique):
        group = [place] + [unique[later] for later in range(position + 1, len(unique)) if roots[later] is roots[position]]
        if len(group) > 1 and any(_differentiable(tensors[member]) for member in group):
            read.update(group)
    read.update(place for place, earlier in first.items() if earlier in read)
    if not first and not read:
        return None
    return SharedMemory(first, tuple(sorted(read)), len(tensors))


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``tensor`` views (itself when it is no view)."""
    return tensor if tensor._base is None else tensor._base


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()
