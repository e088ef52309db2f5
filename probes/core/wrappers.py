"""Wrapper modules that only delegate to the user's module, and how to see through them.

DDP and DataParallel (``module.``), torch.compile's OptimizedModule (``_orig_mod.``), FSDP's
FullyShardedDataParallel (``_fsdp_wrapped_module.``), activation-checkpoint wrappers
(``_checkpoint_wrapped_module.``), a DeepSpeed engine (``module.``) and ORTModule all add a path
component to every name below them. Probes name modules as if the wrappers were not there, so a
wrapped run compares with a plain one, and subscribing to the wrapper or to the inner module is the same.

    for name, module in user_named_modules(model):   # ("", root), ("layers.0", ...), ...
        ...
"""

from __future__ import annotations

from typing import Iterator

import torch

from exporters.adapters import ort_internals

# Qualified class name -> the attribute holding the wrapped module. Matched along the MRO, so
# subclasses (CheckpointWrapper and OffloadWrapper of ActivationWrapper) are found too. Names, not
# imports: none of these packages is imported to check.
_WRAPPERS: dict[str, str] = {
    "torch.nn.parallel.distributed.DistributedDataParallel": "module",
    "torch.nn.parallel.data_parallel.DataParallel": "module",
    "torch._dynamo.eval_frame.OptimizedModule": "_orig_mod",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel": "_fsdp_wrapped_module",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper": "_checkpoint_wrapped_module",
    "deepspeed.runtime.engine.DeepSpeedEngine": "module",
}


def wrapped_module(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``module`` delegates to when it is a known wrapper, else None."""
    if ort_internals.is_ortmodule(module):
        return ort_internals.unwrap(module)
    for cls in type(module).__mro__:
        attribute = _WRAPPERS.get(f"{cls.__module__}.{cls.__qualname__}")
        if attribute is not None:
            inner = getattr(module, attribute, None)
            if not isinstance(inner, torch.nn.Module):
                raise TypeError(
                    f"{type(module).__qualname__}.{attribute} is not an nn.Module; probes cannot find the "
                    "module this wrapper delegates to (subscribe the inner module instead)"
                )
            return inner
    return None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside any stack of wrappers (``model`` itself when it is not a wrapper)."""
    inner = wrapped_module(model)
    while inner is not None:
        model = inner
        inner = wrapped_module(model)
    return model


def user_named_modules(root: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Like ``root.named_modules()``, without the wrappers: each wrapped module takes its wrapper's name."""
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", unwrap(root))]
    while stack:
        name, module = stack.pop()
        module = unwrap(module)
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield name, module
        children = [(f"{name}.{child_name}" if name else child_name, child)
                    for child_name, child in module.named_children()]
        stack.extend(reversed(children))
