"""The subscriber interface: what a probe observes, and when.

A subscriber gets two kinds of calls.

*Graph-building calls* run inside the PyTorch module hooks the manager registers. In eager mode
they run on every forward; under ORTModule only while ORT exports the model, because afterwards ORT
runs the exported graph and no module hook fires. Anything meant to happen on every step must
therefore be done by an autograd Function that these calls insert; ORT carries such a Function
into its graph as a PythonOp and calls its Python code on every step:

- ``pre_forward_module_apply(site, module, args, kwargs) -> (args, kwargs)``
- ``post_forward_module_apply(site, module, args, outputs) -> outputs``
- ``pre_forward_outmost_module_apply`` / ``post_forward_outmost_module_apply``: same, root only.

*Per-step calls* come from the manager's own probe Function, in eager PyTorch and in ORT alike,
only for the steps, sites and phases the subscriber selects (``start_step``/``end_step``,
``every_n_steps``/``steps``, ``modules``/``exclude_modules``, ``phases``, ``ops``: ``probes.core.selection``)
and never during an export:

- ``on_forward(event, tensors)``: the tensors of a module's outputs (``event.site.kind ==
  "output"``), of its inputs (``"input"``, only if ``observe_inputs``), of an
  ``inspect_activation`` call (``"inspect"``) or of an operation inside a module selected by ``ops``
  (``"op"``); ``tensors[i]`` is the i-th tensor of the flattened
  structure, named ``event.record_name(i)``.
  A forward recomputed by activation checkpointing is not reported, unless ``observe_recompute``
  (then with ``event.phase == "recompute"``).
- ``on_backward(event, grads)``: their gradients (None where a tensor got no gradient).
- ``on_forward_end(step)``: the root module's forward returned (the step's forward records are all in).
- ``on_step_end(step)``: the step is complete (its backward is done); flush what it produced.
- ``on_site_failed(event, reason)``: an ``on_forward``/``on_backward`` call raised; that site is switched
  off for this subscriber (one ``ProbeFailureWarning``), and training goes on.

Two calls ignore the selection:

- ``on_subscribe(model)``: once, from ``SubscriberManager.subscribe``, before any other call: the user's
  module with its wrappers removed (``probes.core.wrappers``), for a subscriber that reads more than the
  probed tensors (``StatisticsSubscriber(parameters=True)`` lists the parameters and their names).
- ``on_step_start(step)``: a step opened (its first probe fired), for every step, selected or not: a
  subscriber that finishes a step after its end (the optimizer's update comes after the backward) learns
  here that the previous step is over. It must be cheap; an error there is one ``ProbeFailureWarning``.

``on_forward_end`` and ``on_step_end`` may raise an error whose class sets ``stops_training = True`` (the
anomaly sentinel does, to stop training): every other subscriber still gets its call first, then the first
such error is raised where the phase ended (out of the model's forward, out of ``backward()``). Any other
error raised there is one ``ProbeFailureWarning``: a probe never stops training by accident.

Usage::

    class PrintShapes(SubscriberBase):
        def on_forward(self, event, tensors):
            print(event.step, event.record_name(0), tuple(tensors[0].shape))
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterable, Sequence

import torch

from .selection import Selection
from .sites import ProbeEvent, ProbeSite

__all__ = ["ProbeEvent", "ProbeSite", "SubscriberBase"]

_GRAPH_BUILDING_CALLS = ("pre_forward_module_apply", "post_forward_module_apply", "pre_forward_outmost_module_apply",
                         "post_forward_outmost_module_apply")


class SubscriberBase:
    """Base class of every subscriber; override the calls you need (all default to no-ops).

    Which steps, sites and phases get per-step calls (``probes.core.selection``; all by default):

    - ``start_step``, ``end_step``: steps in ``[start_step, end_step)``; ``None`` means 0 and unbounded.
    - ``every_n_steps``: only ``start_step``, ``start_step + n``, ... (or ``steps``: only those listed).
    - ``modules``, ``exclude_modules``: glob patterns (or ``"re:<regex>"``) matched against each
      module's qualified name (the root is ``"<root>"``) and its class name; inspect sites by name.
    - ``phases``: ``"forward"``, ``"backward"`` or both (None).
    - ``ops``: patterns of the modules whose every torch operation gets a record (``<module>/<op>:<k>``,
      site kind ``"op"``; ``probes.core.ops``); None: none.

    Usage::

        PrintShapes(every_n_steps=100, modules=["blocks.*.attn"], phases="forward")

    Left-out steps still count (step numbers do not change) and get no call at all, ``on_step_end``
    included; a site no subscriber wants gets no probe.
    """

    observe_inputs: bool = False  # also probe module inputs (outputs and inspect calls always)
    observe_recompute: bool = False  # also get forwards recomputed by activation checkpointing (phase "recompute")
    selection: Selection = Selection()  # subclasses that never call __init__ record everything

    def __init__(self, start_step: int | None = None, end_step: int | None = None, *,
                 every_n_steps: int | None = None, steps: Iterable[int] | None = None,
                 modules: str | Sequence[str] | None = None, exclude_modules: str | Sequence[str] | None = None,
                 phases: str | Sequence[str] | None = None, ops: str | Sequence[str] | None = None) -> None:
        self.selection = Selection.of(start_step, end_step, every_n_steps=every_n_steps, steps=steps,
                                      modules=modules, exclude_modules=exclude_modules, phases=phases, ops=ops)

    @property
    def start_step(self) -> int:
        return self.selection.start_step

    @start_step.setter
    def start_step(self, value: int | None) -> None:
        self.selection = dataclasses.replace(self.selection, start_step=0 if value is None else value)

    @property
    def end_step(self) -> int:
        return self.selection.end_step

    @end_step.setter
    def end_step(self, value: int | None) -> None:
        self.selection = dataclasses.replace(self.selection, end_step=sys.maxsize if value is None else value)

    def is_active(self, step: int) -> bool:
        """Whether ``step`` gets per-step calls (its steps rule; sites and phases are asked per probe)."""
        return self.selection.wants_step(step)

    @property
    def observes_tensors(self) -> bool:
        """True when this subscriber overrides on_forward or on_backward (so probes are inserted)."""
        cls = type(self)
        return cls.on_forward is not SubscriberBase.on_forward or cls.on_backward is not SubscriberBase.on_backward

    @property
    def builds_graph(self) -> bool:
        """True when this subscriber overrides a graph-building call (so every module keeps its hooks)."""
        cls = type(self)
        return any(getattr(cls, name) is not getattr(SubscriberBase, name) for name in _GRAPH_BUILDING_CALLS)

    # Graph-building calls (eager: every forward; ORT: at export).
    def pre_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        return args, kwargs

    def post_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, outputs: Any):
        return outputs

    def pre_forward_outmost_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        return args, kwargs

    def post_forward_outmost_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, outputs: Any):
        return outputs

    # Per-step calls (eager and ORT alike, only for active steps, never during export).
    def on_forward(self, event: ProbeEvent, tensors: Sequence[torch.Tensor]) -> None:
        pass

    def on_backward(self, event: ProbeEvent, grads: Sequence[torch.Tensor | None]) -> None:
        pass

    def on_forward_end(self, step: int) -> None:
        pass

    def on_site_failed(self, event: ProbeEvent, reason: str) -> None:
        """This subscriber's call for ``event`` raised (``reason``); its site gets no more calls from now on
        (``probes.core.failures``). Record that the site went dark, if you keep records."""

    def on_step_end(self, step: int) -> None:
        pass

    def on_subscribe(self, model: torch.nn.Module) -> None:
        """Called once by ``subscribe()`` with the user's module (wrappers removed), before any other call."""

    def on_step_start(self, step: int) -> None:
        """Step ``step`` opened (every step, whatever the selection); the previous one is over."""

    def close(self) -> None:
        """Release resources (files, threads); called when the subscription is removed."""
