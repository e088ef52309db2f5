"""The one place where the project touches DeepSpeed's internals (ZeRO stage 3 parameter offload).

Everything ``probes.zero3`` and ``exporters`` need from DeepSpeed (its classes, methods and attributes
such as ``ds_shape``, ``ds_status``) goes through these functions, so a DeepSpeed release that
reorganises its private code breaks here, with a clear error, and nowhere else. Importing this module
does not import DeepSpeed; ``require_deepspeed()`` does, and checks the version.

    from exporters.adapters import deepspeed_internals
    deepspeed_internals.require_deepspeed()                    # ImportError / DeepSpeedVersionError
    deepspeed_internals.replace_setup_hooks(my_setup)          # DeepSpeedZeRoOffload.setup_zero_stage3_hooks
    deepspeed_internals.fetch_for_forward(offload, module)     # gather the module's partitioned parameters
    owner = deepspeed_internals.zero3_optimizer_of(optimizer, model.parameters())   # in a torch optimizer step hook
    deepspeed_internals.zero3_stepping(owner, optimizer).shards  # this rank's fp32 master / grad / state shards
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any, Callable, Iterable, NamedTuple

import torch

# DeepSpeed releases whose ZeRO-3 internals this adapter was written against and tested with:
# >= MIN, < MAX (0.19.8 on torch 2.4.1 and torch 2.13.0).
SUPPORTED_MIN = (0, 19)
SUPPORTED_MAX = (0, 20)
SUPPORTED_RANGE = f">={SUPPORTED_MIN[0]}.{SUPPORTED_MIN[1]},<{SUPPORTED_MAX[0]}.{SUPPORTED_MAX[1]}"

_OFFLOAD_MODULE = "deepspeed.runtime.zero.parameter_offload"
_OFFLOAD_CLASS = "DeepSpeedZeRoOffload"
_SETUP_HOOKS = "setup_zero_stage3_hooks"
# The DeepSpeedZeRoOffload methods and attributes the subscriber calls; checked once per process.
_OFFLOAD_METHODS = (
    _SETUP_HOOKS,
    "get_param_coordinator",
    "pre_sub_module_forward_function",
    "post_sub_module_forward_function",
    "pre_sub_module_backward_function",
    "post_sub_module_backward_function",
)


class DeepSpeedVersionError(ImportError):
    """The installed DeepSpeed is outside the range this adapter supports."""


class DeepSpeedInternalsError(RuntimeError):
    """DeepSpeed's internals differ from what probes expects (a renamed method, a moved global)."""


def _parse_version(text: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise DeepSpeedVersionError(
            f"cannot parse the DeepSpeed version {text!r}; probes supports deepspeed{SUPPORTED_RANGE}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def check_version(version_text: str) -> None:
    """Raise DeepSpeedVersionError unless ``version_text`` is in the supported range."""
    major, minor, _ = _parse_version(version_text)
    if not SUPPORTED_MIN <= (major, minor) < SUPPORTED_MAX:
        raise DeepSpeedVersionError(
            f"DeepSpeed {version_text} is not supported by probes.zero3 (supported: deepspeed{SUPPORTED_RANGE}, "
            "tested with 0.19.8); install a supported release or update exporters/adapters/deepspeed_internals.py"
        )


class _DeepSpeedState:
    """What this adapter keeps per imported DeepSpeed: whether its internals were checked, and the
    ``setup_zero_stage3_hooks`` that ``replace_setup_hooks`` took off DeepSpeed's class."""

    def __init__(self) -> None:
        self.checked = False
        self.original_setup: Callable | None = None


_DEEPSPEED = _DeepSpeedState()


def require_deepspeed() -> ModuleType:
    """Import DeepSpeed, check its version and the ZeRO-3 internals probes uses; return the package."""
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(
            "probes.zero3 needs the 'deepspeed' package, which is not installed "
            f"(pip install 'deepspeed{SUPPORTED_RANGE}', or pip install 'probes[zero3]')"
        ) from error
    if not _DEEPSPEED.checked:
        check_version(getattr(deepspeed, "__version__", "unknown"))
        offload = offload_class()
        missing = [name for name in _OFFLOAD_METHODS if not callable(getattr(offload, name, None))]
        if missing:
            raise DeepSpeedInternalsError(
                f"{_OFFLOAD_MODULE}.{_OFFLOAD_CLASS} in DeepSpeed {deepspeed.__version__} lacks {missing}; "
                "exporters/adapters/deepspeed_internals.py must be updated for this release"
            )
        if not isinstance(getattr(_offload_module(), "FWD_MODULE_STACK", None), list):
            raise DeepSpeedInternalsError(f"{_OFFLOAD_MODULE}.FWD_MODULE_STACK is missing or no longer a list")
        _DEEPSPEED.checked = True
    return deepspeed


def skip_shm_comm_build() -> None:
    """Stop DeepSpeed from compiling its shared-memory communication op (~75 s) at init_distributed.

    Only the CPU accelerator builds it, and gloo over loopback does not need it.
    """
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if not isinstance(compatible, dict):
        raise DeepSpeedInternalsError("deepspeed.ops.__compatible_ops__ is missing or no longer a dict")
    compatible["deepspeed_shm_comm"] = False


def _offload_module() -> ModuleType:
    try:
        import deepspeed.runtime.zero.parameter_offload as module
    except ImportError as error:
        raise DeepSpeedInternalsError(f"cannot import {_OFFLOAD_MODULE}: {error}") from error
    return module


def offload_class() -> type:
    """DeepSpeed's ZeRO-3 parameter offload class (its instances own the parameter hooks)."""
    cls = getattr(_offload_module(), _OFFLOAD_CLASS, None)
    if not isinstance(cls, type):
        raise DeepSpeedInternalsError(f"{_OFFLOAD_MODULE}.{_OFFLOAD_CLASS} is missing")
    return cls


# Replacing DeepSpeedZeRoOffload.setup_zero_stage3_hooks ----------------------------------------

def replace_setup_hooks(setup: Callable[[Any], None]) -> None:
    """Make every DeepSpeedZeRoOffload created from now on call ``setup(offload)`` to install its hooks."""
    cls = offload_class()
    if _DEEPSPEED.original_setup is None:
        _DEEPSPEED.original_setup = cls.__dict__[_SETUP_HOOKS]
    setattr(cls, _SETUP_HOOKS, setup)


def restore_setup_hooks() -> bool:
    """Put DeepSpeed's own setup_zero_stage3_hooks back; False when it was not replaced."""
    if _DEEPSPEED.original_setup is None:
        return False
    setattr(offload_class(), _SETUP_HOOKS, _DEEPSPEED.original_setup)
    _DEEPSPEED.original_setup = None
    return True


def setup_hooks_replaced() -> bool:
    return _DEEPSPEED.original_setup is not None


# What DeepSpeed's own setup does besides registering hooks --------------------------------------

def is_z3_leaf(module: torch.nn.Module) -> bool:
    from deepspeed.utils import z3_leaf_module

    return bool(z3_leaf_module(module))


def prepare_modules(offload: Any, root: torch.nn.Module) -> set[int]:
    """Give ``root`` (the offload's module, or the model a wrapper of it runs) and its submodules
    the ZeRO-3 bookkeeping DeepSpeed's hook registration gives them.

    Returns the ids of the modules that get hooks: every module down to, and including, a
    ZeRO-3 leaf module (whose descendants DeepSpeed treats as part of the leaf). ``ds_id`` numbering
    follows DeepSpeed's registration order, so the parameter coordinator's traces are the same.
    """
    coordinator = offload.get_param_coordinator()
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()  # modules (re)numbered: a recorded trace no longer applies
    managed: set[int] = set()
    counter = 0
    stack = [root]
    while stack:
        module = stack.pop()
        module.ds_id = counter
        counter += 1
        module.ds_recompute_parameters = set()
        managed.add(id(module))
        if is_z3_leaf(module):
            for param in module.parameters():
                param.ds_z3_leaf_module = module
        else:
            stack.extend(reversed(list(module.children())))
    return managed


def offload_root(offload: Any) -> torch.nn.Module:
    """The module an offload manages (the model given to deepspeed.initialize)."""
    return offload.module


# Where users find the manager holding an engine's hooks (docs/zero3.md):
# ``engine.optimizer.parameter_offload.probes_manager``.
_MANAGER_ATTRIBUTE = "probes_manager"


def finish_setup(offload: Any, handle: Any, *, manager: Any) -> None:
    """The rest of DeepSpeed's setup_zero_stage3_hooks, with ``handle`` standing for the hooks.

    DeepSpeed removes ``handle`` where it removes its own hooks (engine destroy, generation
    unwrap), and keeps the root module at the bottom of its forward module stack. ``manager`` (the
    SubscriberManager holding the hooks) is kept on the offload as ``probes_manager``.
    """
    setattr(offload, _MANAGER_ATTRIBUTE, manager)
    offload.hierarchy = 0
    offload.forward_hooks.append(handle)
    offload.fwd_pre_hook = handle
    _offload_module().FWD_MODULE_STACK.append(offload.module)


def attached_manager(offload: Any) -> Any | None:
    """The manager ``finish_setup`` kept on the offload, or None."""
    return getattr(offload, _MANAGER_ATTRIBUTE, None)


# Per-step calls (the work DeepSpeed's module hooks do) -----------------------------------------

_RELEASE_PLANS = "_PartitionedParameterCoordinator__params_to_release"


def _forget_release_plans(coordinator: Any) -> None:
    """Drop the coordinator's cached release decisions, made against a trace that no longer holds.

    ``PartitionedParameterCoordinator.__params_to_release(module, step_id)`` is an ``lru_cache`` (keyed by
    coordinator, module and step index, shared by every coordinator) that DeepSpeed never clears, not even
    when the trace is invalidated and recorded again. Under ORTModule the export-time forwards of the first
    step complete a forward-only trace; the plans cached then ("no later use: release after forward") would
    outlive it and release every module after its forward for the rest of training, so that the backward
    gathers each module again. Clearing costs each coordinator one recomputation per (module, step).
    """
    plans = getattr(type(coordinator), _RELEASE_PLANS, None)
    # DeepSpeed wraps the lru_cache in instrument_w_nvtx, a plain closure over it (no functools.wraps).
    while plans is not None and not hasattr(plans, "cache_clear"):
        names = getattr(getattr(plans, "__code__", None), "co_freevars", ())
        plans = plans.__closure__[names.index("func")].cell_contents if "func" in names else None
    if not callable(getattr(plans, "cache_clear", None)):
        raise DeepSpeedInternalsError(
            f"{type(coordinator).__name__}.__params_to_release (DeepSpeed {_deepspeed_version()}) is missing or no "
            "longer an lru_cache; exporters/adapters/deepspeed_internals.py must be updated for this release")
    plans.cache_clear()


def start_forward(offload: Any) -> None:
    """Start of the root module's forward: the coordinator begins a new step (its trace).

    When this completes a newly recorded trace, release decisions cached under an earlier trace are dropped.
    """
    coordinator = offload.get_param_coordinator()
    recording = coordinator.is_record_trace()
    coordinator.reset_step()
    if recording and coordinator.is_complete_trace():
        _forget_release_plans(coordinator)


def fetch_for_forward(offload: Any, module: torch.nn.Module) -> None:
    """Gather ``module``'s partitioned parameters before its forward (pushes the module stack)."""
    offload.pre_sub_module_forward_function(module)


def release_after_forward(offload: Any, module: torch.nn.Module, outputs: Iterable[torch.Tensor]) -> None:
    """Release ``module``'s parameters after its forward (pops the module stack).

    A parameter the module returned as an output (a "dangling" parameter) stays gathered and is
    registered on the enclosing module, as DeepSpeed's own post-forward hook does.
    """
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter, unregister_external_parameter

    stack = _offload_module().FWD_MODULE_STACK
    stack.pop()
    for output in outputs:
        param = output if hasattr(output, "ds_id") else getattr(output, "ds_param_alias", None)
        if param is None or any(id(param) in m._external_params for m in stack):
            continue
        param.is_external_param = True
        register_external_parameter(stack[-1], param)
        if id(param) in module._external_params:
            unregister_external_parameter(module, param)
        param.all_gather()
    offload.post_sub_module_forward_function(module)


def fetch_for_backward(offload: Any, module: torch.nn.Module) -> None:
    """Gather ``module``'s parameters before its backward."""
    offload.pre_sub_module_backward_function(module)


def release_after_backward(offload: Any, module: torch.nn.Module) -> None:
    """Release ``module``'s parameters after its backward."""
    offload.post_sub_module_backward_function(module)


# Parameters ---------------------------------------------------------------------------------

def module_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters DeepSpeed gathers for ``module``: its own, its external ones, a leaf's all."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    return list(iter_params(module, recurse=is_z3_leaf(module)))


def is_zero_param(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and hasattr(tensor, "ds_id")


def is_partitioned(param: torch.Tensor) -> bool:
    """True when only this rank's shard is held (``param.data`` is empty)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return is_zero_param(param) and param.ds_status == ZeroParamStatus.NOT_AVAILABLE


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's unpartitioned shape."""
    return param.ds_shape if is_zero_param(param) else param.shape


def declared_full_shape(tensor: Any) -> tuple[int, ...] | None:
    """The full shape DeepSpeed recorded on a (possibly partitioned) tensor (``ds_shape``), or None."""
    shape = getattr(tensor, "ds_shape", None)
    return tuple(shape) if shape else None


# The ZeRO-3 optimizer's shards (fp32 master copy, its gradient, optimizer state) --------------------
#
# DeepSpeedZeroOptimizer_Stage3 steps a torch optimizer (its ``optimizer``) over flat fp32 partitions, one
# sub-group at a time: for the duration of that inner ``step()`` it sets the param group's ``params`` to
# ``[fp32_partitioned_groups_flat[i]]``, and empties it after. Torch's global optimizer hooks therefore see the
# inner optimizer and flat tensors, once per sub-group. In ``fp32_partitioned_groups_flat[i]`` each model
# parameter of sub-group ``i`` (``fp16_groups[i]``, in order) holds ``partition_numel()`` elements at
# ``grad_position[param_id][1]`` (DeepSpeed's own local API, ``safe_get_local_fp32_param``, narrows the same
# way); its ``.grad`` is the flat gradient after ``unscale_and_clip_grads``, set before the inner step and
# released after it. Rank ``r`` of the partition group holds the flattened parameter's elements
# ``[r * partition_numel, (r + 1) * partition_numel)``; what lies past ``ds_numel`` is padding (the last ranks).

_STAGE3_ATTRIBUTES = ("optimizer", "fp16_groups", "fp32_partitioned_groups_flat", "grad_position",
                      "sub_group_process_groups", "get_param_id")


class Zero3Shard(NamedTuple):
    """This rank's part of one model parameter as the ZeRO-3 optimizer holds it (views: nothing is copied).

    ``bounds[r]`` is rank ``r``'s ``[start, end)`` in the flattened full tensor (padding excluded, so late
    ranks of a small parameter may hold ``start == end``); ``rank`` is this rank's index in ``group``.
    ``master``, ``grad`` and each of ``state`` are 1-D, ``end - start`` elements long.
    """

    param: torch.nn.Parameter  # the model parameter (partitioned: never gathered here)
    full_shape: tuple[int, ...]
    bounds: tuple[tuple[int, int], ...]
    rank: int
    group: Any  # the partition's torch.distributed process group
    master: torch.Tensor  # the fp32 master copy's shard
    grad: torch.Tensor | None  # the fp32 gradient shard the inner optimizer uses (after unscale and clipping)
    state: dict[str, torch.Tensor]  # the optimizer state shards (exp_avg, exp_avg_sq: tensors shaped like the flat partition)


class Zero3Stepping(NamedTuple):
    """What one inner ``step()`` of a ZeRO-3 optimizer updates: its sub-groups' shards (module doc above)."""

    sub_groups: tuple[int, ...]
    last: bool  # the engine's step ends with this sub-group (its post-hook is the step's last)
    shards: list[Zero3Shard]


def zero3_optimizer_of(optimizer: Any, params: Iterable[torch.Tensor]) -> Any | None:
    """The ZeRO-3 optimizer (DeepSpeedZeroOptimizer_Stage3) whose inner torch optimizer is ``optimizer``, found
    through the model parameters ``params`` (DeepSpeed gives each its ``_z3_optimizer``); None when it is not one.

    The inner optimizer's parameters are flat partitions that name no model parameter, hence ``params``. The
    answer holds as long as the engine lives; a caller may keep it per optimizer.
    """
    seen: set[int] = set()
    for param in params:
        owner = getattr(param, "_z3_optimizer", None)
        if owner is None or id(owner) in seen:
            continue
        seen.add(id(owner))
        if optimizer is getattr(owner, "optimizer", None) or optimizer is getattr(owner, "backup_optimizer", None):
            require_deepspeed()
            missing = [name for name in _STAGE3_ATTRIBUTES if not hasattr(owner, name)]
            if missing:
                raise DeepSpeedInternalsError(
                    f"{type(owner).__name__} (DeepSpeed {_deepspeed_version()}) lacks {missing}; "
                    "exporters/adapters/deepspeed_internals.py must be updated for this release")
            return owner
    return None


def zero3_stepping(owner: Any, optimizer: Any) -> Zero3Stepping:
    """The sub-groups the inner ``optimizer`` of ``owner`` (``zero3_optimizer_of``) is stepping now, and this
    rank's shards of their parameters (sub-group order, then DeepSpeed's parameter order: stable across steps).

    Valid inside the inner optimizer's step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook and
    _post_hook), where DeepSpeed has put one flat partition in the param group:

    - pre-hook: ``grad`` is the gradient the update uses (after loss unscaling and gradient clipping);
      ``master`` and ``state`` are still the previous step's (``state`` is empty before Adam's first step);
    - post-hook: ``master`` and ``state`` are the update's results; ``grad`` is unchanged (DeepSpeed releases
      it after the hook).

    Outside a step the param groups are empty: no sub-group, no shard. Reads no tensor and gathers nothing.
    Raises ValueError where the optimizer's state lives on NVMe (``offload_optimizer: nvme``: not in memory).
    """
    flats = owner.fp32_partitioned_groups_flat
    stepping = {id(tensor) for group in optimizer.param_groups for tensor in group["params"]}
    sub_groups = tuple(index for index, flat in enumerate(flats) if id(flat) in stepping)
    shards: list[Zero3Shard] = []
    for index in sub_groups:
        if getattr(owner, "_swappable_optimizer_subgroup", lambda _: False)(index):
            raise ValueError("the ZeRO-3 optimizer state of this sub-group is swapped to NVMe "
                             "(offload_optimizer: nvme); its shards are not in memory to be summarised")
        flat = flats[index]
        grad = flat.grad
        state = {str(key): value for key, value in optimizer.state.get(flat, {}).items()
                 if isinstance(value, torch.Tensor) and value.shape == flat.shape}
        group = owner.sub_group_process_groups[index]
        world, rank = torch.distributed.get_world_size(group=group), torch.distributed.get_rank(group=group)
        for param in owner.fp16_groups[index]:
            _, offset, size = owner.grad_position[owner.get_param_id(param)]
            numel = int(param.ds_numel)
            bounds = tuple((min(r * size, numel), min((r + 1) * size, numel)) for r in range(world))
            held = bounds[rank][1] - bounds[rank][0]
            shards.append(Zero3Shard(
                param, tuple(param.ds_shape), bounds, rank, group, flat.narrow(0, offset, held),
                None if grad is None else grad.narrow(0, offset, held),
                {key: value.narrow(0, offset, held) for key, value in state.items()}))
    return Zero3Stepping(sub_groups, bool(sub_groups) and sub_groups[-1] == len(flats) - 1, shards)


def _deepspeed_version() -> str:
    import deepspeed

    return getattr(deepspeed, "__version__", "unknown")
