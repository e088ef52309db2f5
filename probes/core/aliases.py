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
  refused: the call is not probed, everything goes on as the module made it, and the manager warns once.
  Rebuilding the views from the probed base would keep their records, but a compiled graph cannot (dynamo
  cannot read a view's storage offset) and every backend must keep the same records; a partial call would
  leave ORT's PythonOp without a used output where all are refused. The step boundary, which records
  nothing, passes the other tensors. Integer tensors need no such care (no gradient, so no wrong one).

    shared = find(tensors)                     # None when no two tensors share memory
    shared.refused                             # the places of views of one another (then: do not probe)
    outputs = shared.apply(tensors, probe)     # probe(tensors it should pass) -> what the caller gets

Everything here is traceable by dynamo (identity, ``_base``, dtypes, ``detach``): it runs while dynamo traces
the hooks, as in eager PyTorch and in ORTModule's export.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch

from exporters import _torch_compat


class SharedMemory:
    """Which places of one probe call repeat an earlier tensor, and which are left as the module made them.
    (A plain class of plain containers: dynamo traces it.)"""

    def __init__(self, first: dict[int, int], refused: tuple[int, ...]) -> None:
        self.first = first  # a place -> the first place of the same tensor
        self.refused = refused  # places whose floating-point tensors are views of one another

    def apply(self, tensors: Sequence[torch.Tensor],
              probe: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """What the caller gets when ``probe`` passes the tensors it should: the first place's probed tensor at
        each repeated place (which passes a detached alias), the module's own tensor at each refused place
        (which does not pass)."""
        places = [place for place in range(len(tensors)) if place not in self.refused]
        probed = dict(zip(places, probe([tensors[place].detach() if place in self.first else tensors[place]
                                         for place in places])))
        return [tensors[place] if place in self.refused else probed[self.first.get(place, place)]
                for place in range(len(tensors))]


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
    refused: set[int] = set()
    roots = [_root(tensors[place]) for place in unique]
    for position, place in enumerate(unique):
        group = [place] + [unique[later] for later in range(position + 1, len(unique)) if roots[later] is roots[position]]
        if len(group) > 1 and any(_differentiable(tensors[member]) for member in group):
            refused.update(group)
    refused.update(place for place, earlier in first.items() if earlier in refused)
    if not first and not refused:
        return None
    return SharedMemory(first, tuple(sorted(refused)))


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``tensor`` views (itself when it is no view)."""
    return tensor if tensor._base is None else tensor._base


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


class RefusalWarnings:
    """The warnings about refused places: one per subscription and site (process-wide, as ``warn`` is also
    called while dynamo traces, which it does once per compilation)."""

    def __init__(self) -> None:
        self._warned: set[tuple[int, str, str]] = set()

    def warn(self, subscription: int, site: str, kind: str, places: tuple[int, ...]) -> bool:
        if (subscription, site, kind) in self._warned:
            return False
        self._warned.add((subscription, site, kind))
        listed = ", ".join(f"{site}.{kind}.{place}" for place in places)
        warnings.warn(f"probes: {site!r} {kind} tensors share memory, views of one another ({listed}): this "
                      f"{kind} is not probed (no record), so that an in-place change of one of them reaches the "
                      "others as without probes. This warning is not repeated.", stacklevel=2)
        return True


REFUSALS = RefusalWarnings()


@_torch_compat.constant_while_tracing
def warn_refused(subscription: int, site: str, kind: str, places: tuple[int, ...]) -> bool:
    """``REFUSALS.warn``; while dynamo traces it is called then, not put in the graph."""
    return REFUSALS.warn(subscription, site, kind, places)
