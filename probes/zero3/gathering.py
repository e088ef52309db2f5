"""ZeRO-3's parameter gather and release as autograd Functions: the same Python in eager PyTorch and in ORTModule.

    outputs = ZeroPreForward.apply(binding, input_count, *inputs, *param_placeholders)   # before a module's forward
    outputs = ZeroPostForward.apply(binding, *outputs)                                   # after it

Before a module's forward, ``ZeroPreForward`` gathers the module's partitioned parameters and returns,
besides the module's inputs, the full-size parameters; after it, ``ZeroPostForward`` releases them.
Their backward passes fetch the parameters again before the module's backward and release them
after it. Being autograd Functions inside the forward, they are exported as PythonOps and run on
every step under ORTModule too, where the exported graph consumes ZeroPreForward's full-size outputs
and their gradients are handed to the parameters (and so to DeepSpeed's gradient hooks) in its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from exporters.adapters import deepspeed_internals, torch_internals

from ..core.functions import mark_frozen


@dataclass(eq=False)
class ModuleBinding:
    """One module under ZeRO-3: what its probe Functions act on (passed to them by pointer)."""

    offload: Any  # the engine's DeepSpeedZeRoOffload
    module: torch.nn.Module  # the module DeepSpeed manages (never ORT's export-time copy)
    name: str
    is_root: bool
    params: tuple[torch.nn.Parameter, ...] = ()  # the parameters ZeroPreForward returns full-size
    backward_fetches: int = 0  # backward fetches not yet matched by a backward release


def _hand_off_gradients(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    """Accumulate gradients computed outside PyTorch's graph (by ORT) into the parameters.

    A backward from the parameters themselves runs their AccumulateGrad and with it DeepSpeed's
    post-accumulate-grad hooks, which reduce the gradient into the partitioned gradient buffers.
    """
    pairs = [(param, grad) for param, grad in zip(params, grads) if grad is not None and param.requires_grad]
    if pairs:
        torch.autograd.backward([param for param, _ in pairs], [grad for _, grad in pairs])


class ZeroPreForward(torch.autograd.Function):
    """Gathers a module's parameters; outputs its tensor inputs, then its full-size parameters.

        outputs = ZeroPreForward.apply(binding, input_count, *inputs, *param_placeholders)

    Backward: hands the gradients of the full-size parameters (when a graph consumed them) to the
    parameters, then releases the parameters fetched for the module's backward.
    """

    @staticmethod
    def forward(ctx: Any, binding: ModuleBinding, input_count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch_internals.untraced():
            if binding.is_root:
                deepspeed_internals.start_forward(binding.offload)
            deepspeed_internals.fetch_for_forward(binding.offload, binding.module)
        inputs = tensors[:input_count]
        ctx.binding = binding
        ctx.input_count = input_count
        # Under ORT the placeholders are replaced by one (1,) trigger input that requires a gradient.
        ctx.placeholders = [(t.shape, t.dtype, t.device) for t in tensors[input_count:]]
        mark_frozen(ctx, inputs, inputs)
        return (*inputs, *(param.detach() for param in binding.params))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        binding: ModuleBinding = ctx.binding
        count = ctx.input_count
        _hand_off_gradients(binding.params, grads[count:])
        if binding.backward_fetches > 0:
            binding.backward_fetches -= 1
            deepspeed_internals.release_after_backward(binding.offload, binding.module)
        needs = ctx.needs_input_grad[2 + count:]
        placeholder_grads = (torch.zeros(shape, dtype=dtype, device=device) if need else None
                             for need, (shape, dtype, device) in zip(needs, ctx.placeholders))
        return (None, None, *grads[:count], *placeholder_grads)


class ZeroPostForward(torch.autograd.Function):
    """Releases a module's parameters after its forward; identity on the module's output tensors.

        outputs = ZeroPostForward.apply(binding, *outputs)

    Backward: fetches the parameters again before the module's backward runs.
    """

    @staticmethod
    def forward(ctx: Any, binding: ModuleBinding, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch_internals.untraced():
            deepspeed_internals.release_after_forward(binding.offload, binding.module, outputs)
        ctx.binding = binding
        mark_frozen(ctx, outputs, outputs)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        binding: ModuleBinding = ctx.binding
        deepspeed_internals.fetch_for_backward(binding.offload, binding.module)
        binding.backward_fetches += 1
        return (None, *grads)


class NoContext:
    """Stands in for an autograd ctx when a Function's forward is called without one."""

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


def describe_binding(non_tensor_args: Sequence[Any]) -> str:
    """The module name of a ZeRO-3 Function's binding, for its PythonOp's ``comment`` attribute."""
    binding = non_tensor_args[0] if non_tensor_args else None
    return binding.name if isinstance(binding, ModuleBinding) else ""
