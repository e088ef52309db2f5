"""ORTModule export of models whose ZeRO-3 hooks are probes': the glue to ``exporters.zero3``.

    prepare_ortmodule_export(ort_model)     # the patch calls this when an engine wraps an ORTModule

ORTModule then exports the model itself (not a copy) inside ``partitioned_embedding_export``, and the
exported graph reads the full-size parameters from ``ZeroPreForward``'s outputs (see exporters/zero3.py).
"""

from __future__ import annotations

import weakref

import torch

from exporters import partitioned_embedding_export, register_probe_function
from exporters.adapters import deepspeed_internals, ort_internals
from exporters import zero3 as zero3_export

from .gathering import ZeroPostForward, ZeroPreForward, describe_binding


class _ManagedRoots:
    """The models (the roots the hooks see) whose ZeRO-3 hooks are probes', held weakly.

    Process-wide: the export rewrite sits in ORT's GraphTransitionManager class, shared by every
    ORTModule, and asks of each model it exports whether it is one of these.
    """

    def __init__(self) -> None:
        self._roots: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def add(self, model: torch.nn.Module) -> None:
        self._roots.add(model)

    def __contains__(self, model: object) -> bool:
        return model in self._roots


_MANAGED_ROOTS = _ManagedRoots()


def prepare_ortmodule_export(model: torch.nn.Module) -> None:
    """Let ORTModule export ``model`` (an ORTModule whose ZeRO-3 hooks are probes') and its like."""
    _MANAGED_ROOTS.add(ort_internals.unwrap(model))
    register_probe_function(ZeroPreForward, describe=describe_binding, identity=False)
    register_probe_function(ZeroPostForward, describe=describe_binding)
    zero3_export.install(zero3_export.Zero3ExportSpec(
        is_managed=_MANAGED_ROOTS.__contains__,
        is_partitioned=deepspeed_internals.is_partitioned,
        full_shape=deepspeed_internals.full_shape,
        pre_forward=ZeroPreForward,
        binding_position=0,
        input_count_position=1,
        params_of=lambda binding: binding.params,
        export_context=partitioned_embedding_export,
    ))
