"""``ZeROOffloadSubscriber``: DeepSpeed ZeRO-3's per-module parameter hooks as a probes subscriber.

    subscriber = ZeROOffloadSubscriber(engine.optimizer.parameter_offload)   # usually made by the patch

Its graph-building calls wrap every module DeepSpeed manages in ``ZeroPreForward``/``ZeroPostForward``
(``probes.zero3.gathering``), which do the gathering and releasing on every step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from exporters.adapters import deepspeed_internals, ort_internals
from exporters.handles import Handle

from ..core import ProbeSite, SubscriberBase, wrappers
from ..utils.exit import exiting
from ..utils.names import ROOT_NAME
from ..utils.tree import TensorLeaves
from .gathering import ModuleBinding, NoContext, ZeroPostForward, ZeroPreForward

class DeepCopiedModuleError(RuntimeError):
    """A ZeRO-3 hook ran on a copy of the model (ORTModule's deep copy before export)."""


class ZeROOffloadSubscriber(SubscriberBase):
    """Does DeepSpeed ZeRO-3's parameter gather/release around every module, as probe Functions.

        subscriber = ZeROOffloadSubscriber(engine.optimizer.parameter_offload)

    Usually created by ``configure_ort_compatible_zero_stage3``; pass it to a ``SubscriberManager``
    only for an offload whose own hooks were not installed.
    """

    def __init__(self, offloader: Any) -> None:
        super().__init__(None, None)
        deepspeed_internals.require_deepspeed()
        self.offloader = offloader
        # An ORTModule given to deepspeed.initialize reports its wrapped model's children as its own:
        # the wrapped model is the root whose forward the hooks see.
        root = wrappers.unwrap(deepspeed_internals.offload_root(offloader))
        managed = deepspeed_internals.prepare_modules(offloader, root)
        # Indexed like the manager's sites (the order of the manager's module walk); None inside a ZeRO-3 leaf module.
        self._bindings: list[ModuleBinding | None] = [
            ModuleBinding(offloader, module, name or ROOT_NAME, module is root) if id(module) in managed else None
            for name, module in wrappers.user_named_modules(root)
        ]
        self.closed = False
        # The handle through which a DeepSpeed engine holds these hooks (set by probes.zero3.patch; None
        # for a subscriber made by hand). DeepSpeed removes it on engine destroy; while it is active the
        # hooks are the live engine's, and closing them leaves the engine without parameter gathering.
        self.engine_handle: Handle | None = None

    def binding(self, site: ProbeSite, module: torch.nn.Module) -> ModuleBinding | None:
        if site.module_index >= len(self._bindings):
            return None
        binding = self._bindings[site.module_index]
        if binding is not None and module is not binding.module:
            raise DeepCopiedModuleError(
                f"ZeRO-3 hook for {site.name!r} ran on a copy of the model, whose parameters are empty "
                "partitions without DeepSpeed's bookkeeping. ORTModule deep-copies the model before export "
                "unless ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT=0; set it (probes' ORT adapter does so for "
                "ZeRO-3 models it knows about)."
            )
        return binding

    def pre_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        binding = self.binding(site, module)
        if binding is None:
            return args, kwargs
        binding.params = tuple(deepspeed_internals.module_params(binding.module))
        leaves = TensorLeaves.of((args, kwargs))
        # The empty partitions become the Function's inputs so that an exported graph ties each
        # full-size output to its parameter's graph input. Detached: no gradient edge to the
        # parameter is made while it is empty (its full-size gradient would not match).
        placeholders = [param.detach() for param in binding.params]
        if not leaves.positions and not placeholders:
            # Nothing to carry a Function (eager-only): gather directly.
            ZeroPreForward.forward(NoContext(), binding, 0)
            return args, kwargs
        return leaves.rebuild(ZeroPreForward.apply(binding, len(leaves.positions), *leaves.tensors, *placeholders))

    def post_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, outputs: Any):
        binding = self.binding(site, module)
        if binding is None:
            return outputs
        leaves = TensorLeaves.of(outputs)
        if not leaves.positions:
            if ort_internals.is_exporting():
                warnings.warn(f"{site.name!r} returns no tensor: under ORTModule its ZeRO-3 parameters are released "
                              "only at the end of backward", stacklevel=2)
            deepspeed_internals.release_after_forward(binding.offload, binding.module, ())
            return outputs
        return leaves.rebuild(ZeroPostForward.apply(binding, *leaves.tensors))

    def close(self) -> None:
        # Closed while an engine still holds these hooks, and not at exit (subscribing the model again
        # replaced this subscription, or unsubscribe() by hand): the live engine lost its parameter hooks.
        held_by_engine = self.engine_handle is not None and self.engine_handle.active
        if held_by_engine and not self.closed and not exiting():
            warnings.warn(
                "the ZeRO-3 parameter hooks of a live DeepSpeed engine were unsubscribed (was the model subscribed "
                "again? that replaces the subscription); pass extra subscribers with "
                "configure_ort_compatible_zero_stage3(debug=True) instead",
                RuntimeWarning,
                stacklevel=2,
            )
        self.closed = True
