"""The tensor leaves of a nested structure (torch's pytree), to pass through one autograd Function
and put back in place.

    leaves = TensorLeaves.of((args, kwargs))
    outputs = MyFunction.apply(state, *leaves.tensors)
    args, kwargs = leaves.rebuild(outputs)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from exporters.adapters.torch_internals import pytree


def _any_tensor(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor)


@dataclass
class TensorLeaves:
    """A flattened structure and the positions of its selected tensor leaves."""

    leaves: list[Any]
    spec: Any  # pytree's spec; None for a flat tuple
    positions: list[int]

    @classmethod
    def of(cls, structure: Any, select: Callable[[Any], bool] = _any_tensor) -> "TensorLeaves":
        """Flattens ``structure``; ``select(leaf)`` picks the leaves to replace (default: every tensor)."""
        if _flat_tuple(structure) and not torch.compiler.is_compiling():  # a module's (hidden, None): no pytree
            leaves, spec = list(structure), None
        else:
            leaves, spec = pytree.tree_flatten(structure)
        return cls(leaves, spec, [i for i, leaf in enumerate(leaves) if select(leaf)])

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.positions]

    def rebuild(self, replacements: Sequence[Any]) -> Any:
        """The structure with the selected leaves replaced, in order, by ``replacements``."""
        leaves = list(self.leaves)
        for position, value in zip(self.positions, replacements):
            leaves[position] = value
        return tuple(leaves) if self.spec is None else pytree.tree_unflatten(leaves, self.spec)


_SCALAR_TYPES = (type(None), bool, int, float, str)


def lone_tensor(structure: tuple) -> int | None:
    """The place of the one leaf of a plain tuple that is exactly ``torch.Tensor`` (no subclass), its other items
    scalars (a module's ``(hidden, None)``), else None: the tuple whose leaves are its items with one tensor.

        lone_tensor((hidden, None))   # 0
    """
    place = None
    for index, item in enumerate(structure):
        kind = type(item)
        if kind is torch.Tensor:
            if place is not None:
                return None
            place = index
        elif kind not in _SCALAR_TYPES:
            return None
    return place


def _flat_tuple(structure: Any) -> bool:
    """A plain tuple of tensors and scalars: its leaves are its items, in order (what pytree would give)."""
    return type(structure) is tuple and all(type(item) in _SCALAR_TYPES or isinstance(item, torch.Tensor)
                                            for item in structure)
