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
every kind.

The seed's named methods keep working: ``on_forward(event, tensors)``, ``on_backward(event, grads)``,
``on_forward_end(step)``, ``on_step_end(step)``, ``on_site_failed(event, reason)``, ``on_subscribe(model)``,
``on_step_start(step)``. A class that overrides one gets that event through it, with its old arguments (and,
left at None, ``event_kinds`` is the set of those it overrides). Where a class overrides a named method below a
parent that overrides ``on_event`` (a subclass of ``StatisticsSubscriber`` overriding ``on_step_end``), the
named method wins for its event, and its ``super().on_step_end(step)`` reaches the parent's ``on_event``; a
class's own ``on_event`` calling ``super().on_event(event)`` reaches the named methods of its parents.

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
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Sequence

import torch

from .selection import Selection
from .sites import EVENT_KINDS, EventKind, ProbeEvent, ProbeSite

__all__ = ["ProbeEvent", "ProbeSite", "SubscriberBase"]

_GRAPH_BUILDING_CALLS = ("pre_forward_module_apply", "post_forward_module_apply", "pre_forward_outmost_module_apply",
                         "post_forward_outmost_module_apply")
TENSOR_EVENTS = frozenset({"forward", "backward"})  # the kinds that need probes in the model


@dataclass(frozen=True)
class _Named:
    """The seed's method for one event kind: its name, and its arguments to and from an event."""

    method: str
    arguments: Callable[[ProbeEvent], tuple]  # the event -> the method's arguments
    event: Callable[..., ProbeEvent]  # the method's arguments -> the event


# The old methods never see tensors inside an event (a subscriber that keeps its events keeps no tensor).
_NAMED: dict[str, _Named] = {
    "subscribe": _Named("on_subscribe", lambda e: (e.model,), lambda model: ProbeEvent(None, 0, kind="subscribe",
                                                                                         model=model)),
    "step_start": _Named("on_step_start", lambda e: (e.step,), lambda step: ProbeEvent(None, step, kind="step_start")),
    "forward": _Named("on_forward", lambda e: (e._replace(tensors=()), e.tensors),
                      lambda event, tensors: event._replace(kind="forward", tensors=tuple(tensors))),
    "backward": _Named("on_backward", lambda e: (e._replace(tensors=()), e.tensors),
                       lambda event, grads: event._replace(kind="backward", tensors=tuple(grads))),
    "forward_end": _Named("on_forward_end", lambda e: (e.step,),
                          lambda step: ProbeEvent(None, step, kind="forward_end")),
    "step_end": _Named("on_step_end", lambda e: (e.step,), lambda step: ProbeEvent(None, step, kind="step_end")),
    "site_failed": _Named("on_site_failed", lambda e: (e, e.reason),
                          lambda event, reason: event._replace(kind="site_failed", reason=reason, tensors=())),
}


@dataclass(frozen=True)
class Routes:
    """How one subscriber class takes each event kind, worked out once per class from what it overrides.

    - ``named[kind]``: the seed's method the class overrides for ``kind``, below no ``on_event`` of its own (the
      manager calls it with its old arguments); absent where ``on_event`` takes the kind.
    - ``event_below[kind]``: what a named method's ``super()`` call reaches, the ``on_event`` of a parent below
      every override of that method.
    - ``named_below[kind]``: what ``super().on_event(event)`` reaches, the named method of a parent below
      every ``on_event``.
    - ``default_events``: the kinds taken when ``event_kinds`` is None.

    Each fallback lies strictly below what falls back to it, so no pair of them calls the other back.
    """

    named: dict[str, Callable]
    event_below: dict[str, Callable]
    named_below: dict[str, Callable]
    default_events: frozenset[str]

    @classmethod
    def of(cls, subscriber_class: type) -> "Routes":
        mro = _above_base(subscriber_class)
        handlers = [c for c in mro if _writes_on_event(c)]
        named, event_below, named_below = {}, {}, {}
        for kind, spec in _NAMED.items():
            overriders = [c for c in mro if spec.method in c.__dict__]
            takers = [c for c in mro if c in overriders or c in handlers]
            if takers and takers[0] not in handlers:
                named[kind] = takers[0].__dict__[spec.method]
            below = [c for c in handlers if not overriders or mro.index(c) > mro.index(overriders[-1])]
            if below:
                event_below[kind] = below[0].__dict__["on_event"]
            below = [c for c in overriders if not handlers or mro.index(c) > mro.index(handlers[-1])]
            if below:
                named_below[kind] = below[0].__dict__[spec.method]
        default = frozenset(EVENT_KINDS) if handlers else frozenset(named)
        return cls(named, event_below, named_below, default)


def _above_base(cls: type) -> list[type]:
    """The classes of ``cls``'s method resolution order that come before ``SubscriberBase`` (the others' methods
    are hidden behind its defaults)."""
    mro = cls.__mro__
    return list(mro[:mro.index(SubscriberBase)])


def _writes_on_event(cls: type) -> bool:
    """Whether ``cls`` itself defines an ``on_event`` (not one made by ``_route_named_methods``)."""
    method = cls.__dict__.get("on_event")
    return method is not None and not getattr(method, "routes_named_methods", False)


def _route_named_methods(cls: type, routes: Routes) -> None:
    """A class overriding a named method below a parent's ``on_event`` gets an ``on_event`` that sends that
    event to the named method, so that ``on_event`` stays the one entry point of every subscriber."""
    handler = next(c.__dict__["on_event"] for c in _above_base(cls) if _writes_on_event(c))

    def on_event(self: SubscriberBase, event: ProbeEvent) -> None:
        named = routes.named.get(event.kind)
        if named is None:
            return handler(self, event)
        return named(self, *_NAMED[event.kind].arguments(event))

    on_event.routes_named_methods = True  # type: ignore[attr-defined]
    cls.on_event = on_event  # type: ignore[method-assign]


def wanted_events(subscriber: "SubscriberBase") -> frozenset[str]:
    """The kinds of event ``subscriber`` takes: its ``event_kinds``, or (None) its class's default; and always the
    named methods it overrides. A kind that does not exist is a ValueError."""
    routes = type(subscriber)._routes
    declared = subscriber.event_kinds
    if declared is None:
        return routes.default_events
    if isinstance(declared, str) or not isinstance(declared, Collection):
        raise ValueError(f"{type(subscriber).__qualname__}.event_kinds must be a set of event kinds (e.g. "
                         f"{{'forward', 'step_end'}}) or None, got {declared!r}")
    unknown = sorted(set(declared) - set(EVENT_KINDS))
    if unknown:
        raise ValueError(f"{type(subscriber).__qualname__}.event_kinds names no event kind: {', '.join(map(repr, unknown))}; "
                         f"the kinds are {', '.join(map(repr, EVENT_KINDS))}")
    return frozenset(declared) | frozenset(routes.named)


def named_method(subscriber: "SubscriberBase", kind: EventKind) -> Callable | None:
    """The seed's method that takes ``kind`` for ``subscriber`` (a function: call it with the subscriber and the
    old arguments), or None where ``on_event`` takes it."""
    return type(subscriber)._routes.named.get(kind)


class SubscriberBase:
    """Base class of every subscriber: override ``on_event`` (or the seed's named methods); see the module docstring.

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
    # else those of the named methods it overrides. Probes go into the model only for "forward" or "backward".
    event_kinds: Collection[str] | None = None
    _routes: ClassVar[Routes]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._routes = Routes.of(cls)
        if cls._routes.named and any(_writes_on_event(c) for c in _above_base(cls)):
            _route_named_methods(cls, cls._routes)

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
        """What happened (``event.kind``), where, in which step, with which tensors. This default hands the
        event to the named method a class overrides for it (the seed's form), with its old arguments."""
        named = type(self)._routes.named_below.get(event.kind)
        if named is not None:
            named(self, *_NAMED[event.kind].arguments(event))

    # Graph-building calls (eager: every forward; ORT: at export).
    def pre_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        return args, kwargs

    def post_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, outputs: Any):
        return outputs

    def pre_forward_outmost_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        return args, kwargs

    def post_forward_outmost_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, outputs: Any):
        return outputs

    # The seed's named methods: each takes one kind of event, with its old arguments. By default each hands its
    # event on to a parent's ``on_event`` (so ``super().on_step_end(step)`` below one reaches it).
    def on_forward(self, event: ProbeEvent, tensors: Sequence[torch.Tensor]) -> None:
        self._to_on_event("forward", event, tensors)

    def on_backward(self, event: ProbeEvent, grads: Sequence[torch.Tensor | None]) -> None:
        self._to_on_event("backward", event, grads)

    def on_forward_end(self, step: int) -> None:
        self._to_on_event("forward_end", step)

    def on_site_failed(self, event: ProbeEvent, reason: str) -> None:
        """This subscriber's call for ``event`` raised (``reason``); its site gets no more calls from now on
        (``probes.core.failures``). Record that the site went dark, if you keep records."""
        self._to_on_event("site_failed", event, reason)

    def on_step_end(self, step: int) -> None:
        self._to_on_event("step_end", step)

    def on_subscribe(self, model: torch.nn.Module) -> None:
        """Called once by ``subscribe()`` with the user's module (wrappers removed), before any other call."""
        self._to_on_event("subscribe", model)

    def on_step_start(self, step: int) -> None:
        """Step ``step`` opened (every step, whatever the selection); the previous one is over."""
        self._to_on_event("step_start", step)

    def _to_on_event(self, kind: str, *arguments: Any) -> None:
        handler = type(self)._routes.event_below.get(kind)
        if handler is not None:
            handler(self, _NAMED[kind].event(*arguments))

    def close(self) -> None:
        """Release resources (files, threads); called when the subscription is removed."""


SubscriberBase._routes = Routes(named={}, event_below={}, named_below={}, default_events=frozenset())
