"""DeepSpeed ZeRO stage 3 parameter hooks as probes: the same Python in eager PyTorch and in ORTModule.

    from probes.zero3 import configure_ort_compatible_zero_stage3
    configure_ort_compatible_zero_stage3()            # before deepspeed.initialize(...)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

After the call, every ZeRO-3 engine DeepSpeed creates installs its parameter hooks through a
``SubscriberManager`` holding a ``ZeROOffloadSubscriber`` (``DeepSpeedZeRoOffload.setup_zero_stage3_hooks``
is replaced; DeepSpeed's code is not modified). ``restore_zero_stage3_hooks()``, the returned
handle's ``restore()`` or leaving ``with configure_ort_compatible_zero_stage3():`` undoes that for
engines created afterwards.

Before a module's forward, ``ZeroPreForward`` gathers the module's partitioned parameters and returns,
besides the module's inputs, the full-size parameters; after it, ``ZeroPostForward`` releases them.
Their backward passes fetch the parameters again before the module's backward and release them
after it. Being autograd Functions inside the forward, they are exported as PythonOps and run on
every step under ORTModule too, where the exported graph consumes ZeroPreForward's full-size outputs
and their gradients are handed to the parameters (and so to DeepSpeed's gradient hooks) in its backward.
Everything that touches DeepSpeed's internals is in ``probes._deepspeed``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from exporters import _deepspeed_compat, _ort_compat, _torch_compat

from ..core import wrappers
from ..core import ProbeSite, SubscriberBase, SubscriberManager


@dataclass(eq=False)
class ModuleBinding:
    """One module under ZeRO-3: what its probe Functions act on (passed to them by pointer)."""

    offload: Any  # the engine's DeepSpeedZeRoOffload
    module: torch.nn.Module  # the module DeepSpeed manages (never ORT's export-time copy)
    name: str
    is_root: bool
    params: tuple[torch.nn.Parameter, ...] = ()  # the parameters ZeroPreForward returns full-size
    backward_fetches: int = 0  # backward fetches not yet matched by a backward release

    def __deepcopy__(self, memo: dict) -> "ModuleBinding":
        return self


def _mark_non_differentiable(ctx: Any, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    # An output passing an input through stays non-differentiable when its input was.
    ctx.set_materialize_grads(False)
    frozen = [output for output, tensor in zip(outputs, inputs) if not tensor.requires_grad]
    if frozen:
        ctx.mark_non_differentiable(*frozen)


def _hand_off_gradients(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    """Accumulate gradients computed outside PyTorch's graph (by ORT) into the parameters.

    A backward from the parameters themselves runs their AccumulateGrad and with it DeepSpeed's
    post-accumulate-grad hooks, which reduce the gradient into the partitioned gradient buffers.
    """
    pairs = [(param, grad) for param, grad in zip(params, grads) if grad is not None and param.requires_grad]
    if pairs:
        torch.autograd.backward([param for param, _ in pairs], [grad for _, grad in pairs])


class ZeroPreForward(torch.autograd.Function):
    """Gathers a module's parameters; outputs its tensor inputs, then its full-size parameters.

        outputs = ZeroPreForward.apply(binding, input_count, *inputs, *param_placeholders)

    Backward: hands the gradients of the full-size parameters (when a graph consumed them) to the
    parameters, then releases the parameters fetched for the module's backward.
    """

    @staticmethod
    def forward(ctx: Any, binding: ModuleBinding, input_count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with _torch_compat.untraced():
            if binding.is_root:
                _deepspeed_compat.start_forward(binding.offload)
            _deepspeed_compat.fetch_for_forward(binding.offload, binding.module)
        inputs = tensors[:input_count]
        ctx.binding = binding
        ctx.input_count = input_count
        # Under ORT the placeholders are replaced by one (1,) trigger input that requires a gradient.
        ctx.placeholders = [(t.shape, t.dtype, t.device) for t in tensors[input_count:]]
        _mark_non_differentiable(ctx, inputs, inputs)
        return (*inputs, *(param.detach() for param in binding.params))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        binding: ModuleBinding = ctx.binding
        count = ctx.input_count
        _hand_off_gradients(binding.params, grads[count:])
        if binding.backward_fetches > 0:
            binding.backward_fetches -= 1
            _deepspeed_compat.release_after_backward(binding.offload, binding.module)
        needs = ctx.needs_input_grad[2 + count:]
        placeholder_grads = (torch.zeros(shape, dtype=dtype, device=device) if need else None
                             for need, (shape, dtype, device) in zip(needs, ctx.placeholders))
        return (None, None, *grads[:count], *placeholder_grads)


class ZeroPostForward(torch.autograd.Function):
    """Releases a module's parameters after its forward; identity on the module's output tensors.

        outputs = ZeroPostForward.apply(binding, *outputs)

    Backward: fetches the parameters again before the module's backward runs.
    """

    @staticmethod
    def forward(ctx: Any, binding: ModuleBinding, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with _torch_compat.untraced():
            _deepspeed_compat.release_after_forward(binding.offload, binding.module, outputs)
        ctx.binding = binding
        _mark_non_differentiable(ctx, outputs, outputs)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        binding: ModuleBinding = ctx.binding
        _deepspeed_compat.fetch_for_backward(binding.offload, binding.module)
        binding.backward_fetches += 1
        return (None, *grads)


class DeepCopiedModuleError(RuntimeError):
    """A ZeRO-3 hook ran on a copy of the model (ORTModule's deep copy before export)."""


class ZeROOffloadSubscriber(SubscriberBase):
    """Does DeepSpeed ZeRO-3's parameter gather/release around every module, as probe Functions.

        subscriber = ZeROOffloadSubscriber(engine.optimizer.parameter_offload)

    Usually created by ``configure_ort_compatible_zero_stage3``; pass it to a ``SubscriberManager``
    only for an offload whose own hooks were not installed.
    """

    def __init__(self, offloader: Any) -> None:
        super().__init__(None, None)
        _deepspeed_compat.require_deepspeed()
        self.offloader = offloader
        # An ORTModule given to deepspeed.initialize reports its wrapped model's children as its own:
        # the wrapped model is the root whose forward the hooks see.
        root = wrappers.unwrap(_deepspeed_compat.offload_root(offloader))
        managed = _deepspeed_compat.prepare_modules(offloader, root)
        # Indexed like the manager's sites (the order of the manager's module walk); None inside a ZeRO-3 leaf module.
        self._bindings: list[ModuleBinding | None] = [
            ModuleBinding(offloader, module, name or "<root>", module is root) if id(module) in managed else None
            for name, module in wrappers.user_named_modules(root)
        ]
        self.closed = False

    def binding(self, site: ProbeSite, module: torch.nn.Module) -> ModuleBinding | None:
        if site.module_index >= len(self._bindings):
            return None
        binding = self._bindings[site.module_index]
        if binding is not None and module is not binding.module:
            raise DeepCopiedModuleError(
                f"ZeRO-3 hook for {site.name!r} ran on a copy of the model, whose parameters are empty "
                "partitions without DeepSpeed's bookkeeping. ORTModule deep-copies the model before export "
                "unless ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT=0; set it (probes' ORT adapter does so for "
                "ZeRO-3 models it knows about)."
            )
        return binding

    def pre_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, kwargs: dict):
        binding = self.binding(site, module)
        if binding is None:
            return args, kwargs
        binding.params = tuple(_deepspeed_compat.module_params(binding.module))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        # The empty partitions become the Function's inputs so that an exported graph ties each
        # full-size output to its parameter's graph input. Detached: no gradient edge to the
        # parameter is made while it is empty (its full-size gradient would not match).
        placeholders = [param.detach() for param in binding.params]
        if not positions and not placeholders:
            # Nothing to carry a Function (eager-only): gather directly.
            ZeroPreForward.forward(_NoContext(), binding, 0)
            return args, kwargs
        outputs = ZeroPreForward.apply(binding, len(positions), *(leaves[i] for i in positions), *placeholders)
        for position, tensor in zip(positions, outputs):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def post_forward_module_apply(self, site: ProbeSite, module: torch.nn.Module, args: tuple, outputs: Any):
        binding = self.binding(site, module)
        if binding is None:
            return outputs
        leaves, spec = pytree.tree_flatten(outputs)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not positions:
            if _ort_compat.is_exporting():
                warnings.warn(f"{site.name!r} returns no tensor: under ORTModule its ZeRO-3 parameters are released "
                              "only at the end of backward", stacklevel=2)
            _deepspeed_compat.release_after_forward(binding.offload, binding.module, ())
            return outputs
        released = ZeroPostForward.apply(binding, *(leaves[i] for i in positions))
        for position, tensor in zip(positions, released):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def close(self) -> None:
        self.closed = True
        destroying = getattr(self.offloader, "_probes_destroying", False)
        if not _EXITING and not destroying and _owns_hooks(self.offloader, self):
            warnings.warn(
                "the ZeRO-3 parameter hooks of a live DeepSpeed engine were unsubscribed (was the model subscribed "
                "again? that replaces the subscription); pass extra subscribers with "
                "configure_ort_compatible_zero_stage3(debug=True) instead",
                RuntimeWarning,
                stacklevel=2,
            )


class _NoContext:
    """Stands in for an autograd ctx when a Function's forward is called without one."""

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


def _owns_hooks(offloader: Any, subscriber: ZeROOffloadSubscriber) -> bool:
    manager = getattr(offloader, "probes_manager", None)
    return isinstance(manager, SubscriberManager) and subscriber in manager.subscribers


_EXITING = False


@atexit.register
def _mark_exiting() -> None:
    # Registered after the manager's own exit handler, so it runs first (atexit is LIFO).
    global _EXITING
    _EXITING = True


# Patching DeepSpeed ---------------------------------------------------------------------------

@dataclass
class Zero3Settings:
    """What ``configure_ort_compatible_zero_stage3`` asked for; read when an engine is created."""

    debug: bool = False
    stats_output_dir: str = "./"
    stats_overwrite: bool = False


_settings: Zero3Settings | None = None


def _debug_subscribers(settings: Zero3Settings) -> list[SubscriberBase]:
    if not settings.debug:
        return []
    try:
        from ..stats import StatisticsSubscriber
    except ImportError as error:
        warnings.warn(f"debug=True: probes.statistics.StatisticsSubscriber is not available ({error}); "
                      "no statistics are dumped", RuntimeWarning, stacklevel=3)
        return []

    def create() -> SubscriberBase:
        return StatisticsSubscriber(output_dir=settings.stats_output_dir, override_output_dir=settings.stats_overwrite)

    # Every rank dumps under the same directory: rank 0 creates it before the others look at it.
    # (Engine creation is collective, so every rank reaches this barrier.)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return [create()]
    rank = torch.distributed.get_rank()
    subscriber = create() if rank == 0 else None
    torch.distributed.barrier()
    return [subscriber if subscriber is not None else create()]


def _setup_zero_stage3_hooks_with_probes(offload: Any) -> None:
    """Replacement for ``DeepSpeedZeRoOffload.setup_zero_stage3_hooks`` (called by its __init__)."""
    settings = _settings or Zero3Settings()
    model = _deepspeed_compat.offload_root(offload)
    subscribers = [ZeROOffloadSubscriber(offload), *_debug_subscribers(settings)]
    manager = SubscriberManager()
    subscription = manager.subscribe(model, subscribers)
    offload.probes_manager = manager
    _MANAGED_ROOTS.add(_ort_compat.unwrap(model))
    _deepspeed_compat.finish_setup(offload, _DestroyHandle(offload, subscription))
    if _ort_compat.is_ortmodule(model):
        _prepare_ortmodule_export()


# Models (the roots the hooks see) whose ZeRO-3 hooks are probes'.
_MANAGED_ROOTS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _describe_binding(non_tensor_args: Sequence[Any]) -> str:
    binding = non_tensor_args[0] if non_tensor_args else None
    return binding.name if isinstance(binding, ModuleBinding) else ""


def _export_context(model: torch.nn.Module) -> Any:
    try:
        from exporters import partitioned_embedding_export
    except ImportError:
        return contextlib.nullcontext()
    return partitioned_embedding_export(model)


def _prepare_ortmodule_export() -> None:
    """Let ORTModule export ZeRO-3 models with these hooks (see probes/_ort_zero3.py)."""
    from exporters import zero3 as _ort_zero3

    try:
        from exporters import register_probe_function
    except ImportError:
        pass  # ORT's default PythonOp exporter handles the Functions, with a copy per output
    else:
        register_probe_function(ZeroPreForward, describe=_describe_binding, identity=False)
        register_probe_function(ZeroPostForward, describe=_describe_binding)
    _ort_zero3.install(_ort_zero3.Zero3ExportSpec(
        is_managed=lambda model: model in _MANAGED_ROOTS,
        is_partitioned=_deepspeed_compat.is_partitioned,
        full_shape=_deepspeed_compat.full_shape,
        pre_forward=ZeroPreForward,
        binding_position=0,
        input_count_position=1,
        params_of=lambda binding: binding.params,
        export_context=_export_context,
    ))


class _DestroyHandle:
    """What DeepSpeed removes when it removes its hooks (engine destroy): our subscription."""

    def __init__(self, offload: Any, subscription: Any) -> None:
        self._offload = offload
        self._subscription = subscription

    def remove(self) -> None:
        self._offload._probes_destroying = True
        try:
            self._subscription.remove()
        finally:
            self._offload._probes_destroying = False


class Zero3Patch:
    """Handle returned by ``configure_ort_compatible_zero_stage3``; ``restore()`` or ``with`` undoes it."""

    def __init__(self, settings: Zero3Settings) -> None:
        self.settings = settings

    @property
    def active(self) -> bool:
        return _settings is self.settings and _deepspeed_compat.setup_hooks_replaced()

    def restore(self) -> None:
        if self.active:
            restore_zero_stage3_hooks()

    def __enter__(self) -> "Zero3Patch":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


def configure_ort_compatible_zero_stage3(debug: bool = False, stats_output_dir: str | os.PathLike = "./",
                                         stats_overwrite: bool = False) -> Zero3Patch:
    """Make every DeepSpeed ZeRO-3 engine created from now on use probes' parameter hooks.

    ``debug=True`` also subscribes a ``StatisticsSubscriber`` writing to ``stats_output_dir``
    (each rank under ``rank_<r>/``; ``stats_overwrite`` replaces an earlier dump of the rank).
    Engines created before the call keep their hooks. Calling again replaces the settings.

    Raises ImportError when DeepSpeed is not installed, DeepSpeedVersionError when its version is
    outside ``probes._deepspeed_compat.SUPPORTED_RANGE``.
    """
    global _settings
    _deepspeed_compat.require_deepspeed()
    settings = Zero3Settings(bool(debug), os.fspath(stats_output_dir), bool(stats_overwrite))
    _deepspeed_compat.replace_setup_hooks(_setup_zero_stage3_hooks_with_probes)
    _settings = settings
    return Zero3Patch(settings)


def restore_zero_stage3_hooks() -> bool:
    """Give DeepSpeed back its own ZeRO-3 hooks for engines created from now on; False if not patched."""
    global _settings
    _settings = None
    return _deepspeed_compat.restore_setup_hooks()


def is_configured() -> bool:
    """True while DeepSpeed's ZeRO-3 hook setup is replaced by probes'."""
    return _deepspeed_compat.setup_hooks_replaced()
