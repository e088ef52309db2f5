"""The autograd Functions the manager inserts into a model's forward.

Both are identities on their tensors. Being autograd Functions, they are carried into an exported
ONNX graph as ``com.microsoft::PythonOp`` (see ``exporters/``), so ORT calls the same ``forward`` and
``backward`` on every step that eager PyTorch calls. Their first argument is passed by pointer and
is therefore live state, not a constant frozen at export.

    outputs = TensorProbe.apply(site, *tensors)        # per-step on_forward / on_backward calls
    outputs = StepBoundary.apply(tracker, *tensors)    # end of the root module's forward; its backward
                                                       # makes the step close when that backward pass ends

Both report to the subscription's ``probes.core.steps.StepTracker`` through its public calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from exporters import _ort_compat, register_probe_function

from .subscriber import ProbeSite

if TYPE_CHECKING:
    from .steps import StepTracker


def mark_frozen(ctx: Any, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """For a Function whose output i passes its tensor input i: output i stays non-differentiable when
    input i did not require grad (a Function's outputs otherwise require grad when any input does), and
    gradients that never arrive stay None instead of being materialised as zeros."""
    ctx.set_materialize_grads(False)
    frozen = [output for output, tensor in zip(outputs, inputs) if not tensor.requires_grad]
    if frozen:
        ctx.mark_non_differentiable(*frozen)


def _passes_through(tensor: torch.Tensor) -> torch.Tensor:
    # A Function returning its input makes autograd take a view of it, which sparse and jagged tensors
    # do not support; a detached alias carries the same data (gradients still flow through backward).
    if tensor.layout != torch.strided or tensor.is_nested:
        return tensor.detach()
    return tensor


def can_probe(tensor: torch.Tensor) -> bool:
    """Whether a tensor can pass through a probe Function (a strided nested tensor cannot: it has no
    sizes autograd can record); such tensors are left as they are, unobserved."""
    return not (tensor.is_nested and tensor.layout == torch.strided)


class TensorProbe(torch.autograd.Function):
    """Identity that reports its tensors (forward) and their gradients (backward) to subscribers."""

    @staticmethod
    def forward(ctx: Any, site: "ProbeSite", *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.event = None if _ort_compat.is_exporting() else site.manager.steps.probe_forward(site, tensors)
        outputs = tuple(_passes_through(tensor) for tensor in tensors)
        mark_frozen(ctx, outputs, tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.event is not None:
            ctx.event.site.manager.steps.probe_backward(ctx.event, grads)
        return (None, *grads)


class StepBoundary(torch.autograd.Function):
    """Identity on the root module's outputs whose forward ends the step's forward pass."""

    @staticmethod
    def forward(ctx: Any, tracker: "StepTracker", *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.tracker = None if _ort_compat.is_exporting() else tracker
        if ctx.tracker is not None:
            tracker.forward_returned()
        outputs = tuple(_passes_through(tensor) for tensor in tensors)
        mark_frozen(ctx, outputs, tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.tracker is not None:
            ctx.tracker.backward_reached_root()
        return (None, *grads)


def _describe_site(non_tensor_args: Sequence[Any]) -> str:
    """A TensorProbe's site name, for its PythonOp's ``comment`` attribute."""
    site = non_tensor_args[0] if non_tensor_args else None
    if not isinstance(site, ProbeSite):
        return ""
    return site.name if site.kind == "inspect" else f"{site.name}.{site.kind}"


def _describe_step_boundary(non_tensor_args: Sequence[Any]) -> str:
    return "step_boundary"


# The probe Functions tell the exporters how to export them; exporters/ knows nothing of probes.
register_probe_function(TensorProbe, describe=_describe_site)
register_probe_function(StepBoundary, describe=_describe_step_boundary)
