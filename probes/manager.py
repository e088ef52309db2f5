"""SubscriberManager: owns the module hooks, the probe sites and the step counter of a subscription.

    from probes import SubscriberManager, StatisticsSubscriber
    handle = SubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])
    ...train (eager, or after wrapping in ORTModule)...
    handle.remove()   # or SubscriberManager.unsubscribe(), or `with SubscriberManager.subscribe(...):`

Called on the class, ``subscribe``/``unsubscribe``/``flush`` act on ``GlobalSubscriberManager`` (the
original onnxruntime hooks' usage); called on an instance, on that instance.

Each module gets a forward pre-hook and a forward hook. The hooks pass the module's output tensors
(and, when a subscriber asks, its input tensors) through a ``TensorProbe`` autograd Function and the
root module's outputs through ``StepBoundary``; those Functions do the per-step work, so the same
code runs when ORTModule executes the exported graph and the hooks no longer fire.
"""

from __future__ import annotations

import atexit
import functools
import types
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from . import _ort
from .functions import StepBoundary, TensorProbe
from .subscriber import ProbeEvent, ProbeSite, RunState, SiteKind, SubscriberBase

ROOT_NAME = "<root>"


class _BindsGlobalOnClass:
    """A method that, looked up on the class instead of an instance, binds to GlobalSubscriberManager."""

    def __init__(self, method: Callable) -> None:
        self._method = method
        functools.update_wrapper(self, method)

    def __get__(self, instance: "SubscriberManager | None", owner: type) -> Callable:
        return types.MethodType(self._method, GlobalSubscriberManager if instance is None else instance)


class Subscription:
    """Handle returned by ``subscribe``: ``remove()`` (or leaving a ``with`` block) undoes it."""

    def __init__(self, manager: "SubscriberManager", model: torch.nn.Module) -> None:
        self.manager = manager
        self._model_ref = weakref.ref(model)

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model_ref()

    @property
    def active(self) -> bool:
        return self.manager._subscription is self

    def remove(self) -> None:
        if self.active:
            self.manager.unsubscribe()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


# Which manager currently holds each model, so that subscribing again replaces the old subscription.
_HOLDERS: "weakref.WeakKeyDictionary[torch.nn.Module, SubscriberManager]" = weakref.WeakKeyDictionary()
# Managers whose root forward is running; inspect_activation reports to the innermost.
_RUNNING: list["SubscriberManager"] = []
_LIVE: "weakref.WeakSet[SubscriberManager]" = weakref.WeakSet()


class SubscriberManager:
    """Registers subscribers on a model; see the module docstring."""

    def __init__(self) -> None:
        self.run_state = RunState()
        self._subscribers: tuple[SubscriberBase, ...] = ()
        self._observers: tuple[SubscriberBase, ...] = ()
        self._probe_inputs = False
        self._handles: list[RemovableHandle] = []
        self._sites: list[ProbeSite] = []
        self._inspect_sites: dict[str, ProbeSite] = {}
        self._subscription: Subscription | None = None
        self._wrapper_ref: weakref.ref | None = None

    def __deepcopy__(self, memo: dict) -> "SubscriberManager":
        # ORT deep-copies the model (and so its hooks) before exporting; the copy's probes must
        # report to this manager, which owns the run state and the subscribers.
        return self

    # Public API -----------------------------------------------------------------------------

    @_BindsGlobalOnClass
    def subscribe(self, model: torch.nn.Module, subscribers: Sequence[SubscriberBase]) -> Subscription:
        """Hook ``subscribers`` into every module of ``model`` (a plain module or an ORTModule)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"subscribe() needs a torch.nn.Module (or ORTModule), got {type(model).__qualname__}")
        if isinstance(subscribers, SubscriberBase) or not isinstance(subscribers, (list, tuple)):
            raise TypeError(
                f"subscribers must be a list of SubscriberBase instances, got {type(subscribers).__qualname__}; "
                "wrap a single subscriber in a list: subscribe(model, [subscriber])"
            )
        if not subscribers:
            raise ValueError("subscribe() got an empty list of subscribers; pass at least one subscriber")
        for position, subscriber in enumerate(subscribers):
            if not isinstance(subscriber, SubscriberBase):
                raise TypeError(
                    f"subscribers[{position}] is a {type(subscriber).__qualname__}, not a SubscriberBase instance"
                )
            if subscriber.start_step > subscriber.end_step:
                raise ValueError(
                    f"subscribers[{position}]: start_step ({subscriber.start_step}) is greater than "
                    f"end_step ({subscriber.end_step})"
                )

        root = _ort.unwrap(model)
        _ort.install_probe_exporters()  # ORTModule exports the probes with exporters/ (no-op without ORT)
        self.unsubscribe()
        previous = _HOLDERS.get(root)
        if previous is not None:
            previous.unsubscribe()

        self.run_state = RunState()
        self._subscribers = tuple(subscribers)
        self._observers = tuple(s for s in subscribers if s.observes_tensors)
        self._probe_inputs = any(s.observe_inputs for s in self._observers)
        self._register_hooks(root)
        _HOLDERS[root] = self
        _LIVE.add(self)
        # atexit runs hooks last-registered-first: re-registering here puts this one before the hooks
        # of the subscribers just created (e.g. dump writers), so the open step is finished first.
        atexit.unregister(_finish_at_exit)
        atexit.register(_finish_at_exit)
        self._wrapper_ref = weakref.ref(model) if model is not root else None
        _ort.signal_model_changed(model)
        self._subscription = Subscription(self, root)
        return self._subscription

    @_BindsGlobalOnClass
    def unsubscribe(self) -> None:
        """Remove every hook this manager added, finish the open step and close the subscribers."""
        if self._subscription is None:
            return
        self._close_open_step()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        root = self._subscription.model
        if root is not None and _HOLDERS.get(root) is self:
            del _HOLDERS[root]
        wrapper = self._wrapper_ref() if self._wrapper_ref is not None else None
        if wrapper is not None:
            _ort.signal_model_changed(wrapper)
        subscribers = self._subscribers
        self._subscription = None
        self._subscribers = self._observers = ()
        self._sites.clear()
        self._inspect_sites.clear()
        for subscriber in subscribers:
            subscriber.close()

    @_BindsGlobalOnClass
    def flush(self) -> None:
        """Finish the open step now (call after its backward, e.g. at the end of training)."""
        self._close_open_step()

    @property
    def step(self) -> int:
        """The number of training steps whose forward has completed."""
        return self.run_state.step

    @property
    def subscribers(self) -> tuple[SubscriberBase, ...]:
        return self._subscribers

    @property
    def sites(self) -> tuple[ProbeSite, ...]:
        """The module sites of the current subscription, in registration order."""
        return tuple(self._sites)

    def get_subscriber(self, subscriber_type: type) -> SubscriberBase:
        for subscriber in self._subscribers:
            if isinstance(subscriber, subscriber_type):
                return subscriber
        raise LookupError(f"no {subscriber_type.__qualname__} is subscribed to this manager")

    def inspect(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Probe an intermediate tensor under ``name``; returns the tensor to use from then on."""
        if not self._observers:
            return tensor
        site = self._inspect_sites.get(name)
        if site is None:
            site = ProbeSite(name, "inspect", -1, -1, type(tensor).__name__, self)
            self._inspect_sites[name] = site
        (probed,) = TensorProbe.apply(site, tensor)
        return probed

    # Hooks ------------------------------------------------------------------------------------

    def _register_hooks(self, root: torch.nn.Module) -> None:
        for index, (name, module) in enumerate(root.named_modules()):
            qualified = name or ROOT_NAME
            depth = 0 if not name else name.count(".") + 1
            sites = {kind: ProbeSite(qualified, kind, index, depth, type(module).__name__, self)
                     for kind in ("input", "output")}
            self._sites.append(sites["output"])
            pre = functools.partial(self._pre_forward_hook, sites["input"], index == 0)
            post = functools.partial(self._post_forward_hook, sites["output"], index == 0)
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(post))

    def _pre_forward_hook(self, site: ProbeSite, is_root: bool, module: torch.nn.Module,
                          args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if is_root:
            if self in _RUNNING:  # a forward that raised never reached the post-hook
                _RUNNING.remove(self)
            _RUNNING.append(self)
            for subscriber in self._subscribers:
                args, kwargs = subscriber.pre_forward_outmost_module_apply(site, module, args, kwargs)
        for subscriber in self._subscribers:
            args, kwargs = subscriber.pre_forward_module_apply(site, module, args, kwargs)
        if self._probe_inputs:
            args, kwargs = self._apply_to_tensors(TensorProbe, site, (args, kwargs))
        return args, kwargs

    def _post_forward_hook(self, site: ProbeSite, is_root: bool, module: torch.nn.Module,
                           args: tuple, outputs: Any) -> Any:
        for subscriber in self._subscribers:
            outputs = subscriber.post_forward_module_apply(site, module, args, outputs)
        if self._observers:
            outputs = self._apply_to_tensors(TensorProbe, site, outputs)
        if is_root:
            for subscriber in self._subscribers:
                outputs = subscriber.post_forward_outmost_module_apply(site, module, args, outputs)
            outputs = self._apply_to_tensors(StepBoundary, self, outputs, always=True)
            if _RUNNING and _RUNNING[-1] is self:
                _RUNNING.pop()
        return outputs

    def _apply_to_tensors(self, function: type[torch.autograd.Function], first_arg: Any, structure: Any,
                          always: bool = False) -> Any:
        """Pass the tensors of a nested structure through ``function``; everything else is kept as is."""
        if isinstance(structure, torch.Tensor):  # the common case, without the pytree round trip
            return function.apply(first_arg, structure)[0]
        leaves, spec = pytree.tree_flatten(structure)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not positions:
            if always and not _ort.is_exporting():
                self._end_forward()  # no tensor to carry the step boundary: eager-only fallback
            return structure
        probed = function.apply(first_arg, *(leaves[i] for i in positions))
        for position, tensor in zip(positions, probed):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, spec)

    # Per-step dispatch, called by the probe Functions -------------------------------------------

    def _open(self, step: int) -> None:
        state = self.run_state
        if state.open_step == step:
            return
        self._close_open_step()
        state.open_step = step
        state.seq = 0
        state.calls.clear()
        state.inspected.clear()

    def _dispatch_forward(self, site: ProbeSite, tensors: Sequence[torch.Tensor]) -> ProbeEvent:
        state = self.run_state
        self._open(state.step)
        if site.kind == "inspect":
            if site.name in state.inspected:
                raise ValueError(
                    f"inspect_activation name {site.name!r} was used twice in step {state.step}; "
                    "give every inspected tensor a unique name"
                )
            state.inspected.add(site.name)
        call = state.calls.get(id(site), 0)
        state.calls[id(site)] = call + 1
        event = ProbeEvent(site, state.step, "forward", state.seq, call)
        state.seq += 1
        for subscriber in self._observers:
            if subscriber.is_active(event.step) and (site.kind != "input" or subscriber.observe_inputs):
                subscriber.on_forward(event, tensors)
        return event

    def _dispatch_backward(self, forward_event: ProbeEvent, grads: Sequence[torch.Tensor | None]) -> None:
        state = self.run_state
        self._open(forward_event.step)
        event = ProbeEvent(forward_event.site, forward_event.step, "backward", state.seq, forward_event.call)
        state.seq += 1
        for subscriber in self._observers:
            if subscriber.is_active(event.step) and (event.site.kind != "input" or subscriber.observe_inputs):
                subscriber.on_backward(event, grads)

    def _end_forward(self) -> None:
        state = self.run_state
        self._open(state.step)
        state.step += 1

    def _close_open_step(self) -> None:
        state = self.run_state
        step, state.open_step = state.open_step, None
        if step is None:
            return
        for subscriber in self._subscribers:
            if subscriber.is_active(step):
                subscriber.on_step_end(step)


GlobalSubscriberManager = SubscriberManager()


def inspect_activation(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Probe an intermediate tensor inside a forward; returns the tensor to continue with.

        x = inspect_activation("attn_scores", scores)

    Outside a subscribed model's forward (or with no observing subscriber) it returns ``tensor``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"inspect_activation needs a non-empty str name, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"inspect_activation({name!r}, ...) needs a torch.Tensor, got {type(tensor).__qualname__}")
    if not _RUNNING:
        return tensor
    return _RUNNING[-1].inspect(name, tensor)


def _finish_at_exit() -> None:
    for manager in list(_LIVE):
        manager.unsubscribe()
