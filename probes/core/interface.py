"""The subscriber interface: what a probe observes, and when.

Every event reaches a subscriber as one call with one argument, ``on_event(event)``: a ``ProbeEvent`` whose
``kind`` says what happened (as Hugging Face's ``TrainerCallback`` gives every event one signature, an event
can be added without breaking a subscriber). The kinds (``probes.core.sites.EventKind``):

- ``"forward"``: a probe fired in a forward, ``event.tensors`` its tensors: a module's outputs
  (``event.site.kind == "output"``), its inputs (``"input"``, only if ``observe_inputs``), an
  ``inspect_activation`` call (``"inspect"``) or an operation inside a module selected by ``ops`` (``"op"``);
  ``tensors[i]`` is the i-th tensor of the flattened structure, named ``event.record_name(i)``. A forward
  recomputed by activation checkpointing is not reported, unless ``observe_recompute`` (then with
  ``event.phase == "recompute"``).
- ``"backward"``: their gradients (None where a tensor got no gradient).
- ``"forward_end"``: the root module's forward returned (the step's forward records are all in).
- ``"step_end"``: the step is complete (its backward is done); flush what it produced.
- ``"site_failed"``: a ``"forward"``/``"backward"`` call raised; that site is switched off for this subscriber
  (one ``ProbeFailureWarning``, ``event.reason`` says why), and training goes on.
- ``"step_start"``: a step opened (its first probe fired), for every step, selected or not: a subscriber that
  finishes a step after its end (the optimizer's update comes after the backward) learns here that the
  previous step is over. It must be cheap; an error there is one ``ProbeFailureWarning``.
- ``"subscribe"``: once, from ``SubscriberManager.subscribe``, before any other event: ``event.model`` is the
  user's module with its wrappers removed (``probes.core.wrappers``), for a subscriber that reads more than
  the probed tensors (``StatisticsSubscriber(parameters=True)`` lists the parameters and their names).

``"forward"`` and ``"backward"`` come from the manager's own probe Function, in eager PyTorch and in ORT alike,
only for the steps, sites and phases the subscriber selects (``start_step``/``end_step``,
``every_n_steps``/``steps``, ``modules``/``exclude_modules``, ``phases``, ``ops``: ``probes.core.selection``),
never during an export; ``"forward_end"`` and ``"step_end"`` only in selected steps. A ``"forward_end"`` or
``"step_end"`` call may raise an error whose class sets ``stops_training = True`` (the anomaly sentinel does, to
stop training): every other subscriber still gets its call first, then the first such error is raised where
the phase ended (out of the model's forward, out of ``backward()``). Any other error raised there is one
``ProbeFailureWarning``: a probe never stops training by accident.

Which events a subscriber gets is declared, never guessed: ``event_kinds`` (a set of kinds; probes are inserted
only when one wants ``"forward"`` or ``"backward"``). Left at None, a class that overrides ``on_event`` gets
every kind, and one that does not gets none (it only builds the graph). A subclass extends its parent as any
Python class does: its ``on_event`` handles the kinds it cares about and calls ``super().on_event(event)``.

The seed's named methods (``on_forward(event, tensors)``, ``on_step_end(step)``, ...) are gone: a class that
defines one is a TypeError at its definition that names the ``on_event`` form to write (docs/migration.md), never
a method that is silently not called.

*Graph-building calls* are no events: they return what the forward continues with. They run inside the
PyTorch module hooks the manager registers: in eager mode on every forward, under ORTModule only while ORT
exports the model (afterwards ORT runs the exported graph and no module hook fires). Anything meant to happen
on every step must therefore be done by an autograd Function that these calls insert; ORT carries such a
Function into its graph as a PythonOp and calls its Python code on every step:

- ``pre_forward_module_apply(site, module, args, kwargs) -> (args, kwargs)``
- ``post_forward_module_apply(site, module, args, outputs) -> outputs``
- ``pre_forward_outmost_module_apply`` / ``post_forward_outmost_module_apply``: same, root only.

Usage::

    class PrintShapes(SubscriberBase):
        event_kinds = {"forward"}

        def on_event(self, event):
            print(event.step, event.record_name(0), tuple(event.tensors[0].shape))
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection
from typing import Any, Iterable, Sequence

import torch

from .selection import Selection
from .sites import EVENT_KINDS, ProbeEvent, ProbeSite

__all__ = ["ProbeEvent", "ProbeSite", "SubscriberBase"]

_GRAPH_BUILDING_CALLS = ("pre_forward_module_apply", "post_forward_module_apply", "pre_forward_outmost_module_apply",
                         "post_forward_outmost_module_apply")
TENSOR_EVENTS = frozenset({"forward", "backward"})  # the kinds that need probes in the model
# The seed's named methods, by the event kind that replaced each, and that event's field their arguments were.
_NAMED_BEFORE = {"on_forward": ("forward", "event.tensors"), "on_backward": ("backward", "event.tensors"),
                 "on_forward_end": ("forward_end", "event.step"), "on_step_end": ("step_end", "event.step"),
                 "on_site_failed": ("site_failed", "event.reason"), "on_subscribe": ("subscribe", "event.model"),
                 "on_step_start": ("step_start", "event.step")}


def wanted_events(subscriber: "SubscriberBase") -> frozenset[str]:
    """The kinds of event ``subscriber`` takes: its ``event_kinds``, or (None) every kind where its class overrides
    ``on_event`` and none where it does not. A kind that does not exist is a ValueError."""
    declared = subscriber.event_kinds
    if declared is None:
        overrides = type(subscriber).on_event is not SubscriberBase.on_event
        return frozenset(EVENT_KINDS) if overrides else frozenset()
    if isinstance(declared, str) or not isinstance(declared, Collection):
        raise ValueError(f"{type(subscriber).__qualname__}.event_kinds must be a set of event kinds (e.g. "
                         f"{{'forward', 'step_end'}}) or None, got {declared!r}")
    unknown = sorted(set(declared) - set(EVENT_KINDS))
    if unknown:
        raise ValueError(f"{type(subscriber).__qualname__}.event_kinds names no event kind: {', '.join(map(repr, unknown))}; "
                         f"the kinds are {', '.join(map(repr, EVENT_KINDS))}")
    return frozenset(declared)


class SubscriberBase:
    """Base class of every subscriber: override ``on_event``; see the module docstring.

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

    Left-out steps still count (step numbers do not change) and get no call at all, ``"step_end"``
    included; a site no subscriber wants gets no probe.
    """

    observe_inputs: bool = False  # also probe module inputs (outputs and inspect calls always)
    observe_recompute: bool = False  # also get forwards recomputed by activation checkpointing (phase "recompute")
    selection: Selection = Selection()  # subclasses that never call __init__ record everything
    # The kinds of event this subscriber takes (``EventKind``); None: every kind for a class overriding on_event,
    # none for one that does not. Probes go into the model only for "forward" or "backward".
    event_kinds: Collection[str] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for method, (kind, field) in _NAMED_BEFORE.items():
            if method in cls.__dict__:
                raise TypeError(
                    f"{cls.__qualname__}.{method}: subscribers take every event through on_event(event); write "
                    f"`def on_event(self, event)` handling event.kind == {kind!r} (its argument is {field}) and "
                    "calling super().on_event(event) for the others (docs/migration.md)")

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
        """True when this subscriber takes "forward" or "backward" events (so probes are inserted)."""
        return not TENSOR_EVENTS.isdisjoint(wanted_events(self))

    @property
    def builds_graph(self) -> bool:
        """True when this subscriber overrides a graph-building call (so every module keeps its hooks)."""
        cls = type(self)
        return any(getattr(cls, name) is not getattr(SubscriberBase, name) for name in _GRAPH_BUILDING_CALLS)

    # The one event call (eager and ORT alike; see the module docstring for when each kind comes).
    def on_event(self, event: ProbeEvent) -> None:
        """What happened (``event.kind``), where, in which step, with which tensors. The base takes nothing."""

    # Graph-building calls (eager: every forward; ORT: at export).
    def pre_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        return args, kwargs

    def post_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, outputs: Any):
        return outputs

    def pre_forward_outmost_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        return args, kwargs

    def post_forward_outmost_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, outputs: Any):
        return outputs

    def close(self) -> None:
        """Release resources (files, threads); called when the subscription is removed."""

