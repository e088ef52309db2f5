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

Steps (docs/training.md says what each training set-up gives):

- A step opens at the first probe of a forward. It closes when the backward pass that reaches it
  ends (the autograd engine's graph task finishes), so its dump is complete when ``backward()``
  returns. A forward that no backward follows (evaluation, ``torch.no_grad``) closes when the next
  forward starts, or on ``flush()``/``unsubscribe()``.
- A forward that runs inside a backward pass is a recomputation (activation checkpointing): not a
  step, not a new call of its modules, not recorded (unless a subscriber sets ``observe_recompute``).
- A backward pass that reaches a step already closed (``retain_graph=True`` and a second
  ``backward()``, a second-order backward) opens a backward-only step of its own. A second backward
  of the same forward within one step is recorded as a new call of the module (``name#k``).
- Module names ignore wrappers (DDP, FSDP, torch.compile, DeepSpeed, checkpoint wrappers, ORTModule).
"""

from __future__ import annotations

import atexit
import functools
import types
import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

import exporters
from exporters import _ort_compat, _torch_compat

from . import wrappers
from .functions import StepBoundary, TensorProbe, can_probe
from .subscriber import ProbeEvent, ProbeSite, Recomputed, RunState, SubscriberBase

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
        _ort_compat.signal_model_changed(model)
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
            _ort_compat.signal_model_changed(wrapper)
        subscribers = self._subscribers
        self._subscription = None
        self._subscribers = self._observers = ()
        self._sites.clear()
        self._inspect_sites.clear()
        for subscriber in subscribers:
            subscriber.close()

    @_BindsGlobalOnClass
    def flush(self) -> None:
        """Finish the open step now (a step closes by itself when its backward ends; this closes a
        forward-only one, e.g. after evaluation)."""
        self._close_open_step()

    @property
    def step(self) -> int:
        """The number of steps begun so far (the number the next step will get)."""
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
        for index, (name, module) in enumerate(wrappers.user_named_modules(root)):
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
        if isinstance(structure, torch.Tensor) and can_probe(structure):  # the common case, no pytree round trip
            return function.apply(first_arg, structure)[0]
        leaves, spec = pytree.tree_flatten(structure)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        positions = [i for i in tensors if can_probe(leaves[i])]
        if len(positions) < len(tensors) and isinstance(first_arg, ProbeSite):
            _warn_unobserved(first_arg, [leaves[i] for i in tensors if not can_probe(leaves[i])])
        if not positions:
            if always and not _ort_compat.is_exporting():
                self._end_forward()  # no tensor to carry the step boundary: eager-only fallback
            return structure
        probed = function.apply(first_arg, *(leaves[i] for i in positions))
        for position, tensor in zip(positions, probed):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, spec)

    # Per-step dispatch, called by the probe Functions -------------------------------------------

    def _open(self) -> int:
        """The open step, opening the next one if none is open."""
        state = self.run_state
        if state.open_step is not None:
            return state.open_step
        state.open_step = state.step
        state.step += 1
        return state.open_step

    def _begin_forward_work(self) -> int:
        # A probe after the root forward returned belongs to the next forward: the open step got no
        # backward (evaluation, no_grad), so it is complete.
        state = self.run_state
        if state.open_step is not None and state.forward_done:
            self._close_open_step()
        # No backward runs now (a forward inside one is a recomputation and does not get here): a pass
        # still listed raised before its end callbacks ran.
        state.backward_tasks.clear()
        return self._open()

    def _dispatch_forward(self, site: ProbeSite, tensors: Sequence[torch.Tensor]) -> ProbeEvent | Recomputed:
        if _torch_compat.current_backward() is not None:
            return self._recomputed_forward(site, tensors)
        state = self.run_state
        step = self._begin_forward_work()
        if site.kind == "inspect":
            if site.name in state.inspected:
                raise ValueError(
                    f"inspect_activation name {site.name!r} was used twice in step {step}; "
                    "give every inspected tensor a unique name"
                )
            state.inspected.add(site.name)
        call = state.calls.get(id(site), 0)
        state.calls[id(site)] = call + 1
        event = ProbeEvent(site, step, "forward", state.seq, call)
        state.seq += 1
        state.unmatched.setdefault(id(site), []).append(event)
        for subscriber in self._receivers(site, step):
            subscriber.on_forward(event, tensors)
        return event

    def _receivers(self, site: ProbeSite, step: int | None, *, recompute: bool = False) -> list[SubscriberBase]:
        """The observers that get this site's calls in ``step``."""
        if step is None:
            return []
        return [s for s in self._observers if s.is_active(step) and (site.kind != "input" or s.observe_inputs)
                and (s.observe_recompute or not recompute)]

    def _recomputed_forward(self, site: ProbeSite, tensors: Sequence[torch.Tensor]) -> Recomputed:
        """A forward run inside backward (activation checkpointing): matched to its original later."""
        state = self.run_state
        token = Recomputed(site)
        state.recomputing.append((id(site), token))
        step = state.open_step
        wanted = self._receivers(site, step, recompute=True)
        if wanted:
            count = state.recomputes.get(id(site), 0)
            state.recomputes[id(site)] = count + 1
            event = ProbeEvent(site, step, "recompute", state.seq, count)
            state.seq += 1
            for subscriber in wanted:
                subscriber.on_forward(event, tensors)
        return token

    def _match_recomputed(self) -> None:
        """Pairs the probes recomputed since the last backward call with their original forward events.

        A checkpointed segment is recomputed in one go, in forward order, and segments are recomputed
        last first; so the k recomputed calls of a site are its last k forward calls not matched yet.
        Only a reentrant checkpoint runs backward through recomputed probes; the others leave them unused.
        """
        state = self.run_state
        if not state.recomputing:
            return
        by_site: dict[int, list[Recomputed]] = {}
        for site_id, token in state.recomputing:
            by_site.setdefault(site_id, []).append(token)
        state.recomputing.clear()
        for site_id, tokens in by_site.items():
            originals = state.unmatched.get(site_id, [])
            matched = originals[-len(tokens):]
            del originals[len(originals) - len(matched):]
            for token, event in zip(tokens[len(tokens) - len(matched):], matched):
                token.event = event

    def _dispatch_backward(self, token: ProbeEvent | Recomputed, grads: Sequence[torch.Tensor | None]) -> None:
        self._match_recomputed()
        forward = token.event if isinstance(token, Recomputed) else token
        if forward is None:
            return
        self._watch_backward()
        state = self.run_state
        step = self._open()
        site = forward.site
        if forward.step == step and id(forward) not in state.backward_done:
            state.backward_done.add(id(forward))
            event = ProbeEvent(site, step, "backward", state.seq, forward.call)
        else:  # another backward of a forward already differentiated: a new call in this step
            call = state.calls.get(id(site), 0)
            state.calls[id(site)] = call + 1
            event = ProbeEvent(site, step, "backward", state.seq, call, forward_step=forward.step)
        state.seq += 1
        for subscriber in self._receivers(site, step):
            subscriber.on_backward(event, grads)

    def _end_forward(self) -> None:
        """The root module's forward returned."""
        if _torch_compat.current_backward() is not None:
            return  # the root itself recomputed by a checkpoint
        self._begin_forward_work()
        self.run_state.forward_done = True

    def _root_backward(self) -> None:
        """The backward pass reached the root's outputs: the step closes when that pass ends."""
        self._match_recomputed()
        self._watch_backward()

    def _watch_backward(self) -> None:
        task = _torch_compat.current_backward()
        state = self.run_state
        if task is None or task in state.backward_tasks:
            return
        state.backward_tasks.add(task)
        _torch_compat.call_when_backward_ends(functools.partial(self._backward_ended, task))

    def _backward_ended(self, task: int) -> None:
        state = self.run_state
        state.backward_tasks.discard(task)
        # Wait for the enclosing pass when a reentrant checkpoint's nested backward ends, and for the
        # forward when a backward runs inside it (torch.autograd.grad in a module's forward).
        if state.backward_tasks or self in _RUNNING:
            return
        self._close_open_step()

    def _close_open_step(self) -> None:
        state = self.run_state
        step, state.open_step = state.open_step, None
        state.forward_done = False
        state.seq = 0
        for per_step in (state.calls, state.inspected, state.unmatched, state.recomputing, state.recomputes,
                         state.backward_done):
            per_step.clear()
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


_UNOBSERVED_WARNED: "weakref.WeakSet[ProbeSite]" = weakref.WeakSet()


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
