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

Those Functions are handed the manager's ``StepTracker`` (``manager.tracker``, ``probes.core.steps``),
which numbers the steps, closes them and makes the per-step calls; its docstring has the step rules.
The sites they get are plain data: nothing in the hot path points back to the manager.

Module names ignore wrappers (DDP, FSDP, torch.compile, DeepSpeed, checkpoint wrappers, ORTModule).
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
import weakref
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
from torch.utils.hooks import RemovableHandle

import exporters
from exporters.adapters import ort_internals, torch_internals
from exporters.handles import Handle

from ..utils.exit import at_exit
from ..utils.names import ROOT_NAME
from ..utils.tree import TensorLeaves, lone_tensor
from . import aliases, compiled, rootcall, wrappers
from .functions import SiteBinding, apply_boundary, can_probe
from .native import PYTHON_APPLIERS, probe_applier
from .ops import OpRecorder, Scope
from .steps import StepTracker
from .interface import SubscriberBase, wanted_events
from .sites import ProbeEvent, ProbeSite



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


class ManagerRegistry:
    """What all managers share: which manager holds each model, whose root forward runs, which to finish at exit.

    Process-wide, and so one instance (``REGISTRY``): a model subscribed again from any manager must
    find the manager holding it, ``inspect_activation`` is a plain function called inside any subscribed
    forward, and interpreter exit must reach every manager.
    """

    def __init__(self) -> None:
        # Which manager holds each model, so that subscribing it again replaces the old subscription.
        self.holders: "weakref.WeakKeyDictionary[torch.nn.Module, SubscriberManager]" = weakref.WeakKeyDictionary()
        self.running: list[SubscriberManager] = []  # managers whose root forward runs, innermost last
        self.live: "weakref.WeakSet[SubscriberManager]" = weakref.WeakSet()

    def forward_running(self, manager_ref: "weakref.ref[SubscriberManager]") -> bool:
        return manager_ref() in self.running

    def finish_all(self) -> None:
        for manager in list(self.live):
            manager.unsubscribe()


REGISTRY = ManagerRegistry()


class SubscriberManager:
    """Registers subscribers on a model; see the module docstring."""

    def __init__(self) -> None:
        # Weakly: the tracker is handed to probe Functions, and an exported graph keeps those arguments.
        self.tracker = StepTracker(forward_running=functools.partial(REGISTRY.forward_running,
                                                                     weakref.ref(self)))
        self._handles: list[RemovableHandle | Handle] = []
        self._module_sites: list[tuple[ProbeSite, ProbeSite]] = []  # (input, output) per module index
        self._inspect_sites: dict[str, ProbeSite] = {}
        self._probes: dict[ProbeSite, SiteBinding] = {}  # each site's TensorProbe argument
        self._unobserved_warned: set[ProbeSite] = set()
        self._uncompilable_warned: set[str] = set()  # module names
        self._transform_warned = False  # see _transformed_pre_forward
        self._subscription: Subscription | None = None
        self._compiled_key: int | None = None  # how torch.compile graphs find this subscription (compiled.OPS)
        self._wrapper_ref: weakref.ref | None = None
        self._builders: tuple[SubscriberBase, ...] = ()  # the subscribers overriding a graph-building call
        # True while an eager root forward runs whose step no observer records (and nothing builds the graph):
        # the hooks of its modules have nothing to do. Never set while dynamo traces or a model is exported, but
        # for ORTModule's export of the graph of left-out steps (``ort_internals.exporting_unprobed``).
        self._left_out_forward = False
        self._ops = OpRecorder(self._probe_op, self._read_op)  # the operations inside modules selected by ``ops=`` (probes.core.ops)
        self._op_sites: dict[str, ProbeSite] = {}
        self._module_indices: dict[str, int] = {}  # qualified name -> module index
        self._records_ops = False  # some module's operations are recorded
        # In a trace (ORTModule's export), the outputs of the probe calls no traced code uses: the root's step boundary
        # takes them too, so that the exported graph keeps those calls (``_carry``).
        self._carried: list[torch.Tensor] = []
        # TensorProbe's apply in eager calls, and the same for one plain tensor of a module hook that made the checks
        # (``native.ProbeAppliers``).
        self._apply_probe, self._apply_observed = PYTHON_APPLIERS

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
            try:
                wanted_events(subscriber)
            except ValueError as error:
                raise ValueError(f"subscribers[{position}]: {error}") from None

        appliers = probe_applier()  # the C++ probe for eager calls where it is built (probes.core.native)
        root = wrappers.unwrap(model)
        exporters.install_for_ort()  # ORTModule exports the probes with exporters/ (no-op without ORT)
        self.unsubscribe()
        previous = REGISTRY.holders.get(root)
        if previous is not None:
            previous.unsubscribe()

        subscribed = ProbeEvent(None, 0, kind="subscribe", model=root)
        for subscriber in subscribers:
            if "subscribe" in wanted_events(subscriber):
                subscriber.on_event(subscribed)
        self.tracker.reset(subscribers)
        self._compiled_key = compiled.OPS.register(self)
        self._apply_probe, self._apply_observed = appliers
        self._register_hooks(root)
        # Under ORTModule, a step no subscriber records runs on a graph exported without the probes.
        self._handles.append(ort_internals.route_left_out_steps(
            root, ort_internals.LeftOutRoute(left_out=self._left_out_now, finish=self._finish_left_out)))
        REGISTRY.holders[root] = self
        REGISTRY.live.add(self)
        self._wrapper_ref = weakref.ref(model) if model is not root else None
        ort_internals.signal_model_changed(model)
        self._subscription = Subscription(self, root)
        return self._subscription

    @_BindsGlobalOnClass
    def unsubscribe(self) -> None:
        """Remove every hook this manager added, finish the open step and close the subscribers."""
        if self._subscription is None:
            return
        subscribers = self.tracker.subscribers
        self.tracker.stop()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._compiled_key is not None:
            compiled.OPS.unregister(self._compiled_key)
            self._compiled_key = None
        root = self._subscription.model
        if root is not None and REGISTRY.holders.get(root) is self:
            del REGISTRY.holders[root]
        wrapper = self._wrapper_ref() if self._wrapper_ref is not None else None
        if wrapper is not None:
            ort_internals.signal_model_changed(wrapper)
        self._subscription = None
        self._module_sites.clear()
        self._inspect_sites.clear()
        self._probes.clear()
        self._unobserved_warned.clear()
        self._uncompilable_warned.clear()
        self._transform_warned = False
        self._builders = ()
        self._left_out_forward = False
        self._ops.close()
        self._op_sites.clear()
        self._module_indices.clear()
        self._records_ops = False
        for subscriber in subscribers:
            subscriber.close()

    @_BindsGlobalOnClass
    def flush(self) -> None:
        """Finish the open step now (a step closes by itself when its backward ends; this closes a
        forward-only one, e.g. after evaluation)."""
        self.tracker.close_open_step()

    @_BindsGlobalOnClass
    def pause(self) -> None:
        """Finish the open step, then record nothing until ``resume()``: forwards run while paused (an
        evaluation between training steps) are not steps, and the step count does not move."""
        self.tracker.pause()

    @_BindsGlobalOnClass
    def resume(self) -> None:
        """Record again after ``pause()``; the next forward opens the next step."""
        self.tracker.resume()

    @_BindsGlobalOnClass
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """``with manager.paused(): evaluate(model)``: ``pause()``, then ``resume()`` on the way out."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    @property
    def step(self) -> int:
        """The number of steps begun so far (the number the next step will get)."""
        return self.tracker.step

    @property
    def subscribers(self) -> tuple[SubscriberBase, ...]:
        return self.tracker.subscribers

    @property
    def sites(self) -> tuple[ProbeSite, ...]:
        """The module sites of the current subscription, in registration order."""
        return tuple(output for _, output in self._module_sites)

    def get_subscriber(self, subscriber_type: type) -> SubscriberBase:
        for subscriber in self.tracker.subscribers:
            if isinstance(subscriber, subscriber_type):
                return subscriber
        raise LookupError(f"no {subscriber_type.__qualname__} is subscribed to this manager")

    def inspect(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Probe an intermediate tensor under ``name``; returns the tensor to use from then on."""
        if not self.tracker.observers:
            return tensor
        if torch.compiler.is_compiling():  # the site is made by name when the compiled probe first runs
            return compiled.inspect(self._compiled_key, name, tensor)
        site = self.inspect_site(name, type(tensor).__name__)
        if not self.tracker.wants_site(site):
            return tensor
        # The subscribers' own torch calls are no operation of the model.
        (probed,) = self._ops.run_paused(self._apply_probe, self._probes[site], tensor)
        if self._ops.scopes:
            self._ops.produced((probed,), (site.record_name(0),))
        return probed

    def inspect_site(self, name: str, tensor_class: str = "Tensor") -> ProbeSite:
        """The site of the ``inspect_activation`` name ``name`` (made on first use)."""
        site = self._inspect_sites.get(name)
        if site is None:
            site = self._inspect_sites[name] = ProbeSite(name, "inspect", -1, -1, tensor_class)
            self._probes[site] = SiteBinding(self.tracker, site)
        return site

    def op_site(self, name: str, inputs: list[str] | None = None) -> ProbeSite | None:
        """The site of the operation ``name`` (``<module>/<op>:<k>``, made on first use); None when its module is
        not one of this subscription's."""
        site = self._op_sites.get(name)
        if site is None:
            index = self._module_indices.get(name.rpartition("/")[0])
            if index is None:
                return None
            module = self._module_sites[index][1]
            site = self._op_sites[name] = ProbeSite(name, "op", index, module.depth + 1, module.module_class, inputs)
            self._probes[site] = SiteBinding(self.tracker, site)
        return site

    def _probe_op(self, name: str, inputs: list[str] | None,
                  tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor] | None:
        """The ``OpRecorder``'s probe: an operation's output tensors through the probe of its site."""
        if torch.compiler.is_compiling():
            return compiled.probe_op(self._compiled_key, name, tensors)
        site = self.op_site(name, inputs)
        if site is None or not self.tracker.wants_site(site) or self.tracker.failures.is_off(site):
            return None
        return self._apply_probe(self._probes[site], *tensors)

    def _read_op(self, name: str, inputs: list[str] | None, tensors: Sequence[torch.Tensor]) -> None:
        """The ``OpRecorder``'s read: tensors that a call the recorder leaves out made (``tensors``, detached), through
        the probe of the site ``name``; its outputs are dropped (in a trace: carried, see ``_carry``)."""
        if torch.compiler.is_compiling():
            compiled.probe_op(self._compiled_key, name, tensors)
            return
        probed = self._probe_op(name, inputs, tensors)
        if probed is not None and torch.jit.is_tracing():
            self._carry(probed)

    def module_site(self, module_index: int, kind: str) -> ProbeSite | None:
        """The ``"input"`` or ``"output"`` site of the module at ``module_index`` (None outside the subscription)."""
        if not 0 <= module_index < len(self._module_sites):
            return None
        sites = self._module_sites[module_index]
        return sites[0] if kind == "input" else sites[1]

    # Hooks ------------------------------------------------------------------------------------

    def _register_hooks(self, root: torch.nn.Module) -> None:
        # Which sites get a probe is fixed here, at subscribe time: under ORTModule the exported graph
        # then holds exactly the wanted probes, and step cadences are decided per call, never by a re-export.
        self._builders = tuple(s for s in self.tracker.subscribers if s.builds_graph)
        builders = bool(self._builders)
        for index, (name, module) in enumerate(wrappers.user_named_modules(root)):
            qualified = name or ROOT_NAME
            depth = 0 if not name else name.count(".") + 1
            inputs, outputs = (ProbeSite(qualified, kind, index, depth, type(module).__name__)
                               for kind in ("input", "output"))
            self._module_sites.append((inputs, outputs))
            self._module_indices[qualified] = index
            self._probes.update({site: SiteBinding(self.tracker, site) for site in (inputs, outputs)})
            probe_inputs = self.tracker.wants_site(inputs)
            probe_outputs = self.tracker.wants_site(outputs)
            ops = self.tracker.wants_ops(outputs)
            self._records_ops |= ops
            if index != 0 and not (builders or probe_inputs or probe_outputs or ops):
                continue  # nobody wants this module: no hook, no cost
            pre, post = self._module_hooks(inputs, outputs, index == 0, probe_inputs, probe_outputs, ops)
            if index == 0:  # inside the root's forward, not hooks: see rootcall (one torch.compile frame)
                self._handles.append(rootcall.wrap_forward(module, pre, post, around=self._root_call_scope))
                continue
            if builders or probe_inputs or ops:  # a pre-hook with nothing to do would still cost every call
                self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(post))

    def _module_hooks(self, inputs: ProbeSite, outputs: ProbeSite, is_root: bool, probe_inputs: bool,
                      probe_outputs: bool, ops: bool) -> tuple[Callable, Callable]:
        """A module's forward pre-hook and forward hook.

        Closures, not bound methods or partials: ORTModule deep-copies the model, hooks included, before
        exporting, and ``copy.deepcopy`` copies no function. The copy's hooks are therefore these very
        closures, reporting to this manager and its sites; a bound method would copy the manager, a
        partial its sites.

        Under torch.compile they are traced inline, in the frame dynamo compiles. A module that runs
        eagerly there (its forward broke the graph) calls them eagerly, and so they run eagerly, as
        in eager PyTorch: dynamo compiles none of their frames (each would be a graph of its own, one
        more per module, recompiled for each site).
        """
        @torch_internals.not_compiled_as_frame
        def pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if torch.compiler.is_compiling():
                args, kwargs = self._pre_forward_hook(inputs, is_root, probe_inputs, module, args, kwargs)
                if ops:
                    self._open_ops(outputs)
                return args, kwargs
            if self._left_out_forward and not is_root:  # (read after the check above: dynamo never guards on it)
                return args, kwargs
            return torch_internals.call_uncompiled(self._eager_pre_forward_hook, inputs, is_root, probe_inputs,
                                                 module, args, kwargs, outputs if ops else None)

        @torch_internals.not_compiled_as_frame
        def post_forward(module: torch.nn.Module, args: tuple, result: Any) -> Any:
            if torch.compiler.is_compiling():
                if ops:
                    self._ops.leave(outputs.module_index)
                return self._post_forward_hook(outputs, is_root, probe_outputs, module, args, result)
            if self._left_out_forward and not is_root:
                return result
            return torch_internals.call_uncompiled(self._eager_post_forward_hook, outputs, is_root, probe_outputs,
                                                 module, args, result, ops)

        return pre_forward, post_forward

    def _eager_pre_forward_hook(self, site: ProbeSite, is_root: bool, probe: bool, module: torch.nn.Module,
                                args: tuple, kwargs: dict, ops: ProbeSite | None) -> tuple[tuple, dict]:
        if is_root:
            self._carried.clear()  # left by a traced forward that raised
        if is_root and ort_internals.exporting_unprobed():  # ORT exports the graph of left-out steps: no probe
            self._left_out_forward = True
            return args, kwargs
        if torch_internals.functorch_transforms_active():
            return self._transformed_pre_forward(is_root, args, kwargs)
        if is_root:  # the whole eager forward is left out when its step is: its modules' hooks return at once
            probes_now = self._probes_now()
            self._left_out_forward = not (self._builders or probes_now)
            probe = probe and probes_now
        else:
            probe = probe and self._probes_now()
        ops = ops if ops is not None and (ort_internals.is_exporting() or self.tracker.ops_observed_now(ops)) else None
        if not (probe or is_root or self._builders or ops):  # a left-out step: nothing to do
            return args, kwargs
        # Checked here, where dynamo's frame evaluation is off: traced, the check would break the graph.
        if self._run_by_compiler(site):
            return args, kwargs
        # The probes' own torch calls are no operation of the model.
        args, kwargs = self._ops.run_paused(self._pre_forward_hook, site, is_root, probe, module, args, kwargs)
        if ops is not None:
            if probe:  # the op records name the module's inputs they read
                self._name_tensors(site, (args, kwargs))
            self._open_ops(ops)
        return args, kwargs

    def _eager_post_forward_hook(self, site: ProbeSite, is_root: bool, probe: bool, module: torch.nn.Module,
                                 args: tuple, outputs: Any, ops: bool) -> Any:
        recorder = self._ops
        if ops:
            recorder.leave(site.module_index)
        if is_root:
            self._left_out_forward = False
            if ort_internals.exporting_unprobed():
                return outputs
        if torch_internals.functorch_transforms_active():
            return self._transformed_post_forward(is_root, outputs)
        probe = probe and self._probes_now()
        if not (probe or is_root or self._builders):
            return outputs
        if self._run_by_compiler(site):
            return outputs
        kind = type(outputs)
        # Only a tensor or a tuple can take the direct call: other outputs skip the trace check.
        direct = (probe and (kind is torch.Tensor or kind is tuple)
                  and not (is_root or self._builders or recorder.scopes) and not torch.jit.is_tracing())
        if direct and kind is torch.Tensor and can_probe(outputs):
            outputs = self._probe_tensor(site, outputs)  # the most common call, without the general path's layers
        elif direct and kind is tuple and (place := lone_tensor(outputs)) is not None and can_probe(outputs[place]):
            # One tensor and scalars (Hugging Face's (hidden, None)): passed as the general path would pass it.
            outputs = outputs[:place] + (self._probe_tensor(site, outputs[place]),) + outputs[place + 1:]
        else:
            outputs = recorder.run_paused(self._post_forward_hook, site, is_root, probe, module, args, outputs)
        if probe and self._records_ops and not is_root:  # op records name the module outputs they read
            self._name_tensors(site, outputs)
        return outputs

    def _transformed_pre_forward(self, is_root: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A module called under a functorch transform (``torch.func.grad``, ``vmap``, ``jacrev``...): no probe.

        torch runs no autograd Function without ``setup_context`` under a transform (it raises), and the probe
        Functions have none: they take their live state as arguments, which ORT's PythonOp needs. Inserting them
        would stop the user's call, or switch their sites off for the rest of training. So the call runs as
        without probes (one warning), its modules' hooks return at once (as in a left-out step) and the root's
        step is still counted; eager calls outside the transform are observed as before.
        """
        if not self._transform_warned:
            self._transform_warned = True
            warnings.warn("probes: a model called under a torch.func transform (grad, vmap, jacrev, ...) is not "
                          "observed: torch runs no probe Function there. Its calls outside the transform are. "
                          "This warning is not repeated.", stacklevel=5)
        if is_root:
            self._left_out_forward = True
        return args, kwargs

    def _transformed_post_forward(self, is_root: bool, outputs: Any) -> Any:
        """The end of a call under a functorch transform (``_transformed_pre_forward``): the root counts the step."""
        if is_root and not ort_internals.is_exporting():
            self.tracker.forward_returned()
        return outputs

    def _open_ops(self, site: ProbeSite) -> None:
        """The operations the module of ``site`` calls from now until its forward ends get records."""
        if torch.compiler.is_compiling() and not torch_internals.dynamo_traces_function_modes():
            _warn_ops_uncompiled()
            return
        self._ops.enter(Scope(site.name, site.module_index))

    def _name_tensors(self, site: ProbeSite, structure: Any) -> None:
        """The probed tensors of ``structure`` (``site``'s, just passed through its probe) are its records from now
        on, for the ``inputs`` of the op records that read them (eager and export only)."""
        tensors = TensorLeaves.of(structure, select=_selector(compiling=False)).tensors
        self._ops.produced(tensors, [site.record_name(i) for i in range(len(tensors))])

    def _root_call_scope(self, root: torch.nn.Module) -> ContextManager[None] | None:
        """The context of the root's whole call: the schema run's (below), and closing the op recorder at its end,
        also when the forward raised (no module's forward is running then)."""
        schema = self._schema_run_scope(root)
        if not self._records_ops or torch.compiler.is_compiling():
            return schema
        stack = contextlib.ExitStack()
        stack.callback(self._ops.close)
        if schema is not None:
            stack.enter_context(schema)
        return stack

    def _probes_now(self) -> bool:
        """Whether an eager call inserts its probe: some observer records the step it belongs to. A left-out
        step's probes would only pass their tensors, so its modules run as without probes. Exports always
        insert them: an exported graph (ORTModule's, a trace) serves every later step."""
        return self.tracker.observed_now() or ort_internals.is_exporting()

    def _left_out_now(self) -> bool:
        """Whether an ORTModule forward beginning now runs the graph without probes: nothing would be recorded
        (as for an eager root forward, ``_eager_pre_forward_hook``) and nothing builds the graph."""
        return not (self._builders or self.tracker.observed_now())

    def _finish_left_out(self, outputs: Any) -> Any:
        """The outputs of an ORTModule forward run without probes, through the step boundary (applied eagerly,
        as in an eager left-out step): the step is counted and closed as the probed graph's boundary would."""
        return self._apply_to_tensors(self._module_sites[0][1], outputs, boundary=True)

    def _run_by_compiler(self, site: ProbeSite) -> bool:
        """Whether torch.compile, not the model, runs ``site``'s module now: the module is inside a call the
        compiler keeps whole as one graph node, and runs on its stand-in tensors while the compiler traces
        (``torch_internals.compiler_runs_module``). The hook then observes nothing, since that call is no step
        the model takes, and the compiled graph runs the module's operations without it: the site has no
        record under torch.compile (one warning per module)."""
        if not torch_internals.compiler_runs_module():
            return False
        if site.name not in self._uncompilable_warned:
            self._uncompilable_warned.add(site.name)
            warnings.warn(f"probes: {site.name!r} runs inside a module call that torch.compile keeps "
                          "whole in its graph (as torch 2.4 does with a parametrized torch.nn module): its hooks "
                          "run only while the compiler traces, so it has no record under torch.compile. This "
                          "warning is not repeated.", stacklevel=3)
        return True

    def _schema_run_scope(self, root: torch.nn.Module) -> ContextManager[None] | None:
        """ORTModule's eager run of the model before a training export runs with grad enabled, so the probes
        learn which of their tensors eager differentiates (``probes.core.differentiable``)."""
        if (torch.compiler.is_compiling() or not root.training or not ort_internals.is_ort_schema_run()
                or ort_internals.exporting_unprobed()):
            return None
        return self.tracker.differentiable.learning()

    def _pre_forward_hook(self, site: ProbeSite, is_root: bool, probe: bool, module: torch.nn.Module,
                          args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        subscribers = self._builders
        if is_root:
            running = REGISTRY.running
            if self in running:  # a forward that raised never reached the post-hook
                running.remove(self)
            running.append(self)
            for subscriber in subscribers:
                args, kwargs = subscriber.pre_forward_outmost_module_apply(site, module, args, kwargs)
        for subscriber in subscribers:
            args, kwargs = subscriber.pre_forward_module_apply(site, module, args, kwargs)
        if probe:
            args, kwargs = self._guarded_apply(site, (args, kwargs))
        return args, kwargs

    def _post_forward_hook(self, site: ProbeSite, is_root: bool, probe: bool, module: torch.nn.Module,
                           args: tuple, outputs: Any) -> Any:
        subscribers = self._builders
        for subscriber in subscribers:
            outputs = subscriber.post_forward_module_apply(site, module, args, outputs)
        if probe:
            outputs = self._guarded_apply(site, outputs)
        if is_root:
            for subscriber in subscribers:
                outputs = subscriber.post_forward_outmost_module_apply(site, module, args, outputs)
            outputs = self._apply_to_tensors(site, outputs, boundary=True)
            running = REGISTRY.running
            if running and running[-1] is self:
                running.pop()
        return outputs

    def _probe_tensor(self, site: ProbeSite, tensor: torch.Tensor) -> torch.Tensor:
        """``_guarded_apply(site, tensor)`` for one plain tensor in an eager call, no op scope open, no trace or
        functorch transform running, its step observed now (or an export running)."""
        failures = self.tracker.failures
        if failures.is_off(site):
            return tensor
        try:
            return self._apply_observed(self._probes[site], tensor)
        except Exception as error:
            failures.switch_off(site, None, None, error)
            return tensor

    def _guarded_apply(self, site: ProbeSite, structure: Any) -> Any:
        """``_apply_to_tensors``; should inserting the probe itself fail, the module runs without it (one
        warning; the site stays off), since a probe never stops training."""
        if self.tracker.failures.is_off(site):
            return structure
        try:
            return self._apply_to_tensors(site, structure)
        except Exception as error:
            if torch.compiler.is_compiling():
                raise  # dynamo's own errors while tracing: it breaks the graph there, or reports the failure
            self.tracker.failures.switch_off(site, None, None, error)
            return structure

    def _apply_to_tensors(self, site: ProbeSite, structure: Any, *, boundary: bool = False) -> Any:
        """Pass the tensors of a nested structure through ``site``'s probe (``boundary``: through the step
        boundary of the root's outputs); everything else is kept as is."""
        compiling = torch.compiler.is_compiling()
        select = _selector(compiling)
        if isinstance(structure, torch.Tensor) and select(structure):  # the common case, no pytree round trip
            return self._pass(site, (structure,), boundary, compiling)[0]
        if compiling:
            compiled.flattening(True)
        leaves = TensorLeaves.of(structure, select=select)
        unobservable = [] if boundary else [leaf for leaf in leaves.leaves
                                            if isinstance(leaf, torch.Tensor) and not can_probe(leaf)]
        if compiling:
            compiled.flattening(False)
        if unobservable and site not in self._unobserved_warned:
            self._unobserved_warned.add(site)
            _warn_unobserved(site, unobservable)
        if not leaves.positions and not boundary:
            return structure
        shared = aliases.find(leaves.tensors)  # tensors sharing memory: see aliases
        tracing = not compiling and torch.jit.is_tracing()
        if shared is not None and boundary and tracing:
            # The traced boundary's outputs are the exported graph's, never views of one another when it runs: they
            # pass it as usual, so that it has a used output to carry the read probes (``_carry``) to.
            shared = shared.unread()
        if shared is None:
            return leaves.rebuild(self._pass(site, leaves.tensors, boundary, compiling))
        carry = tracing and not boundary and shared.read_only

        def probe(tensors: list[torch.Tensor]) -> Sequence[torch.Tensor]:
            probed = self._pass(site, tensors, boundary, compiling)
            if carry:
                self._carry(probed)
            return probed

        return leaves.rebuild(shared.apply(leaves.tensors, probe))

    def _carry(self, dropped: Sequence[torch.Tensor]) -> None:
        """``dropped``, the outputs of a probe call that the traced forward does not use (views of one another only
        read; an op's input read), go to the step boundary: an exported graph keeps only what its outputs depend on,
        and the boundary's outputs are the graph's."""
        self._carried.extend(dropped[:1])

    def _pass(self, site: ProbeSite, tensors: Sequence[torch.Tensor], boundary: bool,
              compiling: bool) -> Sequence[torch.Tensor]:
        if compiling:  # dynamo is tracing: the graph gets the probe ops
            key = self._compiled_key
            return compiled.boundary(key, tensors) if boundary else compiled.probe(key, site, tensors)
        if not boundary:
            return self._apply_probe(self._probes[site], *tensors)
        carried, self._carried = self._carried, []
        if tensors or carried:
            return apply_boundary(self.tracker, *tensors, *carried)[:len(tensors)]
        if not ort_internals.is_exporting():
            self.tracker.forward_returned()  # no tensor to carry the step boundary: eager-only fallback
        return ()


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
    running = REGISTRY.running
    if not running:
        return tensor
    return running[-1].inspect(name, tensor)


def _selector(compiling: bool) -> Callable[[Any], bool]:
    """Which leaves pass through a probe: tensors a Function can pass, and, inside a TorchScript trace (ORTModule's
    export), not the tracer's stand-ins for sizes, which eager code holds as ints."""
    return _is_probeable_traced if not compiling and torch.jit.is_tracing() else _is_probeable


def _is_probeable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and can_probe(leaf)


def _is_probeable_traced(leaf: Any) -> bool:
    """Inside a TorchScript trace: not the tracer's stand-in for a number the code holds as an int in eager."""
    return _is_probeable(leaf) and not torch_internals.is_traced_number(leaf)


@torch_internals.constant_while_tracing  # called by dynamo while it traces: the warning is issued then, once
def _warn_ops_uncompiled() -> bool:
    warnings.warn(f"probes: op records (ops=) under torch.compile need torch >= 2.6 (this is {torch.__version__}): "
                  "the compiled modules get module records only; eager and ORTModule runs get op records.",
                  stacklevel=2)
    return True


def _warn_unobserved(site: ProbeSite, tensors: Sequence[torch.Tensor]) -> None:
    kinds = ", ".join(sorted({f"{tensor.dtype} {tensor.layout} nested tensor" for tensor in tensors}))
    warnings.warn(f"probes: {site.name!r} {site.kind} has tensors no autograd Function can pass ({kinds}); "
                  "they go on unobserved (no record). This warning is not repeated.", stacklevel=3)


at_exit("subscriptions", REGISTRY.finish_all)
