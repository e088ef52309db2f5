"""Which tensors of each probe call eager autograd differentiates, for the probes ORTModule's graph runs.

Eager autograd differentiates a tensor only when it requires grad. Inside ORT's graph that flag is ORT's,
and ORT 1.19 takes more for differentiable: every parameter, frozen or not (its export lists them all as
requiring grad), and every output of a PythonOp when any input is (its gradient builder cannot see
into one). So probes get inputs requiring grad where eager's do not: a frozen base model's activations
in front of trainable adapters, a constant position embedding, T5's position bias beside a hidden
state. Their gradients are real numbers in ORT's graph, and a probe reporting them would say the model
computed gradients it never computes.

The truth comes from an eager run of the model: ORTModule's output-schema run, one eager forward of
(a deep copy of) the model before each export. The manager runs the root forward of that run with grad
enabled (ORT runs it under ``no_grad``), so each probe call sees which of its tensors require grad, as in
training. Those flags are kept per (site, call index within the forward), the key the ORT run's
records are named by, and the ORT run reports None for the gradients of the others. Training is
unchanged: the probe still returns to ORT every gradient ORT's graph needs.

    with tracker.differentiable.learning():   # around ORT's schema run of the root forward
        ...                                   # TensorProbe.forward: tracker.differentiable.learn(site, tensors)
    grads = tracker.differentiable.reported(forward_event, grads)   # as eager's; None: eager has no backward there
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from exporters.adapters import ort_internals

from .sites import ProbeEvent, ProbeSite


class EagerDifferentiable:
    """Per (site, call): which tensors required grad in the last eager schema run (see the module doc)."""

    def __init__(self) -> None:
        self._flags: dict[tuple[ProbeSite, int], tuple[bool, ...]] = {}
        self._learning: dict[tuple[ProbeSite, int], tuple[bool, ...]] | None = None
        self._calls: dict[ProbeSite, int] = {}
        self._inside_ort: tuple[int, bool] | None = None  # (step, whether ORT's graph runs its probes)

    def clear(self) -> None:
        """Forget what was learnt (a new subscription has new sites)."""
        self._flags.clear()
        self._learning = None
        self._calls.clear()
        self._inside_ort = None

    @contextlib.contextmanager
    def learning(self) -> Iterator[None]:
        """Around an eager run of the root forward that stands for the exported graph: grad enabled, each probe
        call's flags learnt; they replace the earlier ones when the run completes."""
        self._learning, self._calls = {}, {}
        try:
            with torch.enable_grad():
                yield
            self._flags = self._learning
        finally:
            self._learning = None
            self._calls = {}

    def learn(self, site: ProbeSite, tensors: Sequence[torch.Tensor]) -> None:
        """A probe call of the run being learnt (nothing outside ``learning()``)."""
        if self._learning is None:
            return
        call = self._calls.get(site, 0)
        self._calls[site] = call + 1
        self._learning[(site, call)] = tuple(tensor.requires_grad for tensor in tensors)

    def reported(self, forward: ProbeEvent, grads: Sequence[torch.Tensor | None]) -> Sequence[torch.Tensor | None] | None:
        """``grads`` of the probe call ``forward`` as eager computes them: None for a tensor eager does not
        differentiate, and no backward at all (None) when it differentiates none of them. Only inside ORT's
        graph and where a learnt run saw the same call; otherwise ``grads`` as they are."""
        if not self._flags:
            return grads
        flags = self._flags.get((forward.site, forward.call))
        if flags is None or all(flags) or len(flags) != len(grads) or not self._runs_inside_ort(forward.step):
            return grads
        if not any(flags):
            return None
        return tuple(grad if differentiable else None for grad, differentiable in zip(grads, flags))

    def _runs_inside_ort(self, step: int) -> bool:
        # One stack walk per step: the model runs either in ORT's graph or eagerly for a whole step.
        if self._inside_ort is None or self._inside_ort[0] != step:
            self._inside_ort = (step, ort_internals.inside_ort_graph())
        return self._inside_ort[1]
