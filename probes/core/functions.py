"""The autograd Functions the manager inserts into a model's forward.

Both are identities on their tensors. Being autograd Functions, they are carried into an exported
ONNX graph as ``com.microsoft::PythonOp`` (see ``exporters/``), so ORT calls the same ``forward`` and
``backward`` on every step that eager PyTorch calls. Their non-tensor arguments are passed by pointer
and are therefore live state, not constants frozen at export.

    outputs = TensorProbe.apply(SiteBinding(tracker, site), *tensors)   # per-step "forward" / "backward" events
    outputs = StepBoundary.apply(tracker, *tensors)                     # end of the root module's forward; its
                                                                        # backward makes the step close when that
                                                                        # backward pass ends

``tracker`` is the subscription's ``probes.core.steps.StepTracker``, which both report to through its
public calls; ``site`` is plain data (``ProbeSite``) naming where the probe sits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from exporters import register_probe_function
from exporters.adapters import ort_internals, torch_internals

from .sites import ProbeSite

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
    # ORT needs a tensor for every gradient its graph routes through a probe (see ``grads_for_inputs``).
    ctx.shapes = None if len(inputs) < 2 else [
        (tensor.shape, tensor.dtype, tensor.device) if tensor.requires_grad else None for tensor in inputs]


def grads_for_inputs(ctx: Any, grads: Sequence[torch.Tensor | None]) -> Sequence[torch.Tensor | None]:
    """The gradients a probe's backward returns for its tensor inputs: ``grads``, except under ORTModule.

    A module output that gets no gradient (unused downstream, as a decoder's last cache or position bias)
    reaches the probe's backward as None. Eager autograd takes None as zero; ORT's graph does not: the
    input's gradient is a declared output of the PythonOpGrad node, summed with the input's other
    gradients, and a None leaves that sum without an input ("Missing Input" in a later node). So inside
    ORT's graph a missing gradient of an input that requires one is returned as zeros.
    """
    shapes = getattr(ctx, "shapes", None)
    if shapes is None or all(grad is not None for grad in grads) or not ort_internals.inside_ort_graph():
        return grads
    return tuple(torch.zeros(shape[0], dtype=shape[1], device=shape[2]) if grad is None and shape is not None
                 else grad for grad, shape in zip(grads, shapes))


def differentiated(ctx: Any, grads: Sequence[torch.Tensor | None]) -> Sequence[torch.Tensor | None]:
    """The gradients a probe reports: None for a tensor that did not require grad in its forward.

    Eager autograd never computes those. ORT may: it differentiates a PythonOp's outputs as a whole, so
    a tensor that needs no gradient, passed through a probe beside one that does, gets one downstream.
    """
    shapes = getattr(ctx, "shapes", None)
    if shapes is None or None not in shapes:
        return grads
    return tuple(None if shape is None else grad for grad, shape in zip(grads, shapes))


def passes_through(tensor: torch.Tensor) -> torch.Tensor:
    """What a probe Function returns for ``tensor``: a detached alias, the same data under a new tensor.

    Returning the input itself would make autograd return a view created in a custom Function, which no
    in-place op may modify afterwards (``loss *= scale`` in a training loop, ``hidden += residual`` in a
    model): "Output 0 of TensorProbeBackward is a view and is being modified inplace". An alias is not a
    view for autograd; it shares the input's version counter, so autograd still sees in-place changes.
    Sparse and jagged tensors, which support no view, need it as well.
    """
    return tensor.detach()


def can_probe(tensor: torch.Tensor) -> bool:
    """Whether a tensor can pass through a probe Function (a strided nested tensor cannot: it has no
    sizes autograd can record); such tensors are left as they are, unobserved."""
    return not (tensor.is_nested and tensor.layout == torch.strided)


@dataclass(frozen=True, eq=False)
class SiteBinding:
    """One site bound to its subscription: a TensorProbe's one non-tensor argument, the ``ProbeSite`` where it sits
    and the ``StepTracker`` it reports to (as ``probes.zero3.gathering.ModuleBinding`` binds a module for its
    Functions).

    One per site and subscription, made by the manager. One argument, passed to ORT as one pointer.
    """

    tracker: "StepTracker"
    site: ProbeSite


class TensorProbe(torch.autograd.Function):
    """Identity that reports its tensors (forward) and their gradients (backward) to subscribers."""

    @staticmethod
    def forward(ctx: Any, probe: SiteBinding, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.event = None
        if not ort_internals.is_exporting():
            tracker = probe.tracker
            if tracker.observed_now():  # left-out steps record nothing (under ORT: a graph builder keeps this graph)
                ctx.tracker = tracker
                ctx.event = tracker.probe_forward(probe.site, tensors)
        elif isinstance(probe, SiteBinding):  # ORT's eager schema run: which tensors eager differentiates
            probe.tracker.differentiable.learn(probe.site, tensors)  # (probes.core.differentiable)
        outputs = tuple(passes_through(tensor) for tensor in tensors)
        mark_frozen(ctx, outputs, tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.event is not None:
            ctx.tracker.probe_backward(ctx.event, differentiated(ctx, grads))
        return (None, *grads_for_inputs(ctx, grads))


class StepBoundary(torch.autograd.Function):
    """Identity on the root module's outputs whose forward ends the step's forward pass."""

    @staticmethod
    def forward(ctx: Any, tracker: "StepTracker", *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.tracker = None if ort_internals.is_exporting() else tracker
        if ctx.tracker is not None:
            tracker.forward_returned()
        outputs = tuple(passes_through(tensor) for tensor in tensors)
        mark_frozen(ctx, outputs, tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.tracker is not None:
            ctx.tracker.backward_reached_root()
        return (None, *grads_for_inputs(ctx, grads))


def _describe_site(non_tensor_args: Sequence[Any]) -> str:
    """A TensorProbe's site name, for its PythonOp's ``comment`` attribute."""
    probe = non_tensor_args[0] if non_tensor_args else None
    if not isinstance(probe, SiteBinding):
        return ""
    site = probe.site
    return site.name if site.kind == "inspect" else f"{site.name}.{site.kind}"


def _describe_step_boundary(non_tensor_args: Sequence[Any]) -> str:
    return "step_boundary"


# ``TensorProbe.apply`` and ``StepBoundary.apply``, less the Python wrapper's per-call work (see there).
apply_probe = torch_internals.function_applier(TensorProbe)
apply_boundary = torch_internals.function_applier(StepBoundary)

# The probe Functions tell the exporters how to export them; exporters/ knows nothing of probes.
register_probe_function(TensorProbe, describe=_describe_site)
register_probe_function(StepBoundary, describe=_describe_step_boundary)
