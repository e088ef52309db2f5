"""SubscriberManager: owns the module hooks, the probe sites and the step counter of a subscription.

    from probes import SubscriberManager, StatisticsSubscriber
    handle = SubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])
    ...train (eager, or after wrapping in ORTModule)...
    handle.remove()   # or SubscriberManager.unsubscribe(), or `with SubscriberManager.subscribe(...):`

Called on the class, ``subscribe``/``unsubscribe``/``flush`` act on ``GlobalSubscriberManager`` (the
original onnxruntime hooks' usage); called on an instance, on that instance.

Each module gets a forward pre-hook and a forward hook (the root: the same two calls inside its
``forward``, see ``rootcall``). The hooks pass the module's output tensors (and, when a subscriber
asks, its input tensors) through a ``TensorProbe`` autograd Function and the root module's outputs
through ``StepBoundary``; those Functions do the per-step work, so the same code runs when ORTModule
executes the exported graph and the hooks no longer fire. While dynamo traces (torch.compile), the
hooks put the custom ops of ``compiled`` in the graph instead.

Those Functions report to the manager's ``StepTracker`` (``manager.steps``, ``probes.core.steps``),
which numbers the steps, closes them and makes the per-step calls; its docstring has the step rules.

Module names ignore wrappers (DDP, FSDP, torch.compile, DeepSpeed, checkpoint wrappers, ORTModule).
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

import exporters
from exporters import _ort_compat
from exporters.handles import Handle

from ..utils import TensorLeaves, at_exit
from . import compiled, rootcall, wrappers
from .functions import StepBoundary, TensorProbe, can_probe
from .steps import StepTracker
from .interface import ProbeSite, SubscriberBase

ROOT_NAME = "<root>"


class _BindsGlobalOnClass:
    """A method that, looked up on the class instead of an instance, binds to GlobalSubscriberManager."""

    def __init__(self, method: Callable) -> None:
        self._method = method
        functools.update_wrapper(self, method)

    def __get__(self, instance: "SubscriberManager | None", owner: type) -> Callable:
        return types.MethodType(self._method, GlobalSubscriberManager if instance is None else instance)


class Subscription(Handle):
    """Handle returned by ``subscribe``: ``remove()`` (or leaving a ``with`` block) undoes it."""

    def __init__(self, manager: "SubscriberManager", model: torch.nn.Module) -> None:
        super().__init__(self._unsubscribe)
        self.manager = manager
        self._model_ref = weakref.ref(model)

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model_ref()

    @property
    def active(self) -> bool:
        return self.manager._subscription is self

    def _unsubscribe(self) -> None:
        if self.active:
            self.manager.unsubscribe()


# Which manager currently holds each model, so that subscribing again replaces the old subscription.
_HOLDERS: "weakref.WeakKeyDictionary[torch.nn.Module, SubscriberManager]" = weakref.WeakKeyDictionary()
# Managers whose root forward is running; inspect_activation reports to the innermost.
_RUNNING: list["SubscriberManager"] = []
_LIVE: "weakref.WeakSet[SubscriberManager]" = weakref.WeakSet()


class SubscriberManager:
    """Registers subscribers on a model; see the module docstring."""

    def __init__(self) -> None:
        self.steps = StepTracker(forward_running=self._forward_running)
        self._handles: list[RemovableHandle | Handle] = []
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
        """Hook ``subscribers`` into every module of ``model`` (a plain module, or one inside DDP, FSDP,
        torch.compile, a DeepSpeed engine or ORTModule: the same names either way)."""
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

        root = wrappers.unwrap(model)
        exporters.install_for_ort()  # ORTModule exports the probes with exporters/ (no-op without ORT)
        self.unsubscribe()
        previous = _HOLDERS.get(root)
        if previous is not None:
            previous.unsubscribe()

        self.steps.reset(subscribers)
        self._register_hooks(root)
        _HOLDERS[root] = self
        _LIVE.add(self)
        self._wrapper_ref = weakref.ref(model) if model is not root else None
        _ort_compat.signal_model_changed(model)
        self._subscription = Subscription(self, root)
        return self._subscription

    @_BindsGlobalOnClass
    def unsubscribe(self) -> None:
        """Remove every hook this manager added, finish the open step and close the subscribers."""
        if self._subscription is None:
            return
        subscribers = self.steps.subscribers
        self.steps.stop()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        root = self._subscription.model
        if root is not None and _HOLDERS.get(root) is self:
            del _HOLDERS[root]
        wrapper = self._wrapper_ref() if self._wrapper_ref is not None else None
        if wrapper is not None:
            _ort_compat.signal_model_changed(wrapper)
        self._subscription = None
        self._sites.clear()
        self._inspect_sites.clear()
        for subscriber in subscribers:
            subscriber.close()

    @_BindsGlobalOnClass
    def flush(self) -> None:
        """Finish the open step now (a step closes by itself when its backward ends; this closes a
        forward-only one, e.g. after evaluation)."""
        self.steps.close_open_step()

    @property
    def step(self) -> int:
        """The number of steps begun so far (the number the next step will get)."""
        return self.steps.step

    @property
    def subscribers(self) -> tuple[SubscriberBase, ...]:
        return self.steps.subscribers

    @property
    def sites(self) -> tuple[ProbeSite, ...]:
        """The module sites of the current subscription, in registration order."""
        return tuple(self._sites)

    def get_subscriber(self, subscriber_type: type) -> SubscriberBase:
        for subscriber in self.steps.subscribers:
            if isinstance(subscriber, subscriber_type):
                return subscriber
        raise LookupError(f"no {subscriber_type.__qualname__} is subscribed to this manager")

    def inspect(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Probe an intermediate tensor under ``name``; returns the tensor to use from then on."""
        if not self.steps.observers:
            return tensor
        if torch.compiler.is_compiling():  # the site is made by name when the compiled probe first runs
            return compiled.inspect(self._sites[0], name, tensor)
        site = self.inspect_site(name, type(tensor).__name__)
        if not self.steps.wants_site(site):
            return tensor
        (probed,) = TensorProbe.apply(site, tensor)
        return probed

    def inspect_site(self, name: str, tensor_class: str = "Tensor") -> ProbeSite:
        """The site of the ``inspect_activation`` name ``name`` (made on first use)."""
        site = self._inspect_sites.get(name)
        if site is None:
            site = self._inspect_sites[name] = ProbeSite(name, "inspect", -1, -1, tensor_class, self)
        return site

    # Hooks ------------------------------------------------------------------------------------

    def _register_hooks(self, root: torch.nn.Module) -> None:
        # Which sites get a probe is fixed here, at subscribe time: under ORTModule the exported graph
        # then holds exactly the wanted probes, and step cadences are decided per call, never by a re-export.
        builders = any(s.builds_graph for s in self.steps.subscribers)
        for index, (name, module) in enumerate(wrappers.user_named_modules(root)):
            qualified = name or ROOT_NAME
            depth = 0 if not name else name.count(".") + 1
            sites = {kind: ProbeSite(qualified, kind, index, depth, type(module).__name__, self)
                     for kind in ("input", "output")}
            self._sites.append(sites["output"])
            probe_inputs = self.steps.wants_site(sites["input"])
            probe_outputs = self.steps.wants_site(sites["output"])
            if index != 0 and not (builders or probe_inputs or probe_outputs):
                continue  # nobody wants this module: no hook, no cost
            pre = functools.partial(self._pre_forward_hook, sites["input"], index == 0, probe_inputs)
            post = functools.partial(self._post_forward_hook, sites["output"], index == 0, probe_outputs)
            if index == 0:  # inside the root's forward, not hooks: see rootcall (one torch.compile frame)
                self._handles.append(rootcall.wrap_forward(module, pre, post))
            else:
                self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(module.register_forward_hook(post))

    def _pre_forward_hook(self, site: ProbeSite, is_root: bool, probe: bool, module: torch.nn.Module,
                          args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        subscribers = self.steps.subscribers
        if is_root:
            if self in _RUNNING:  # a forward that raised never reached the post-hook
                _RUNNING.remove(self)
            _RUNNING.append(self)
            for subscriber in subscribers:
                args, kwargs = subscriber.pre_forward_outmost_module_apply(site, module, args, kwargs)
        for subscriber in subscribers:
            args, kwargs = subscriber.pre_forward_module_apply(site, module, args, kwargs)
        if probe:
            args, kwargs = self._guarded_apply(site, (args, kwargs))
        return args, kwargs

    def _post_forward_hook(self, site: ProbeSite, is_root: bool, probe: bool, module: torch.nn.Module,
                           args: tuple, outputs: Any) -> Any:
        subscribers = self.steps.subscribers
        for subscriber in subscribers:
            outputs = subscriber.post_forward_module_apply(site, module, args, outputs)
        if probe:
            outputs = self._guarded_apply(site, outputs)
        if is_root:
            for subscriber in subscribers:
                outputs = subscriber.post_forward_outmost_module_apply(site, module, args, outputs)
            outputs = self._apply_to_tensors(site, outputs, boundary=True)
            if _RUNNING and _RUNNING[-1] is self:
                _RUNNING.pop()
        return outputs

    def _guarded_apply(self, site: ProbeSite, structure: Any) -> Any:
        """``_apply_to_tensors``; should inserting the probe itself fail, the module runs without it (one
        warning; the site stays off), since a probe never stops training."""
        if self.steps.failures.is_off(site):
            return structure
        try:
            return self._apply_to_tensors(site, structure)
        except Exception as error:
            if torch.compiler.is_compiling():
                raise  # dynamo's own errors while tracing: it breaks the graph there, or reports the failure
            self.steps.failures.switch_off(site, None, None, error)
            return structure

    def _apply_to_tensors(self, site: ProbeSite, structure: Any, *, boundary: bool = False) -> Any:
        """Pass the tensors of a nested structure through ``site``'s probe (``boundary``: through the step
        boundary of the root's outputs); everything else is kept as is."""
        if isinstance(structure, torch.Tensor) and can_probe(structure):  # the common case, no pytree round trip
            return self._pass(site, (structure,), boundary)[0]
        leaves = TensorLeaves.of(structure, select=_is_probeable)
        if not boundary:
            unobservable = [leaf for leaf in leaves.leaves if isinstance(leaf, torch.Tensor) and not can_probe(leaf)]
            if unobservable:
                _warn_unobserved(site, unobservable)
        if not leaves.positions and not boundary:
            return structure
        return leaves.rebuild(self._pass(site, leaves.tensors, boundary))

    def _pass(self, site: ProbeSite, tensors: Sequence[torch.Tensor], boundary: bool) -> Sequence[torch.Tensor]:
        if torch.compiler.is_compiling():  # dynamo is tracing: the graph gets the probe ops
            return compiled.boundary(site, tensors) if boundary else compiled.probe(site, tensors)
        if not boundary:
            return TensorProbe.apply(site, *tensors)
        if tensors:
            return StepBoundary.apply(self.steps, *tensors)
        if not _ort_compat.is_exporting():
            self.steps.forward_returned()  # no tensor to carry the step boundary: eager-only fallback
        return ()

    def _forward_running(self) -> bool:
        return self in _RUNNING


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


_UNOBSERVED_WARNED: "weakref.WeakSet[ProbeSite]" = weakref.WeakSet()


def _is_probeable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and can_probe(leaf)


def _warn_unobserved(site: ProbeSite, tensors: Sequence[torch.Tensor]) -> None:
    if site in _UNOBSERVED_WARNED:
        return
    _UNOBSERVED_WARNED.add(site)
    kinds = ", ".join(sorted({f"{tensor.dtype} {tensor.layout} nested tensor" for tensor in tensors}))
    warnings.warn(f"probes: {site.name!r} {site.kind} has tensors no autograd Function can pass ({kinds}); "
                  "they go on unobserved (no record). This warning is not repeated.", stacklevel=3)


def _finish_at_exit() -> None:
    for manager in list(_LIVE):
        manager.unsubscribe()


at_exit("subscriptions", _finish_at_exit)
