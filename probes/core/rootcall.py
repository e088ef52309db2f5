"""The root module's forward, wrapped so that the root's probes run in the same frame as its forward.

``torch.compile(model)`` runs the hooks of the module it compiles outside the compiled frame ("invoke
hooks outside of dynamo then pickup the inner frame", torch/_dynamo/eval_frame.py): forward hooks on
the root would become graphs of their own, a graph break between the model and its last probes. The
manager therefore does the root's work (its pre- and post-forward calls, its probes, the step
boundary) in a wrapper set as the root's instance ``forward``, the way Accelerate wraps a model's
forward for mixed precision; the other modules keep plain hooks, which dynamo traces inline.

    handle = wrap_forward(root, before, after)   # before(module, args, kwargs) -> (args, kwargs)
    ...                                          # after(module, args, outputs) -> outputs
    handle.remove()                              # the root's forward is what it was
    wrap_forward(root, before, after, around=scope)   # scope(module) -> a context manager for the whole
                                                      # call (before, forward, after), or None

The wrapper is a function bound to the module, like a class's forward: it keeps the wrapped forward's
signature (``inspect.signature`` follows ``__wrapped__``; ORTModule and Hugging Face read it), has the
``__func__`` ORTModule reads, and a deep copy of the module (ORTModule copies it to export) gets it
bound to the copy.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, ContextManager

import torch

from exporters.handles import Handle

Before = Callable[[torch.nn.Module, tuple, dict], "tuple[tuple, dict]"]
After = Callable[[torch.nn.Module, tuple, Any], Any]
Around = Callable[[torch.nn.Module], "ContextManager[Any] | None"]


def wrap_forward(module: torch.nn.Module, before: Before, after: After, around: Around | None = None) -> Handle:
    """Run ``before`` and ``after`` around ``module``'s forward, inside it (see the module docstring); the whole
    call inside the context ``around(module)`` returns, when it returns one."""
    inner = module.__dict__.get("forward")  # someone else's instance forward (a wrapper of theirs), kept
    state = {"active": True}

    def call_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if inner is not None:
            return inner(*args, **kwargs)
        # Called with the module, not bound: torch 2.4's dynamo cannot trace ``forward.__get__(module)``.
        return type(self).forward(self, *args, **kwargs)

    @functools.wraps(inner.__func__ if isinstance(inner, types.MethodType) else type(module).forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not state["active"]:
            return call_forward(self, *args, **kwargs)
        scope = around(self) if around is not None else None
        if scope is None:
            return probed_forward(self, args, kwargs)
        with scope:
            return probed_forward(self, args, kwargs)

    def probed_forward(self: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        args, kwargs = before(self, args, kwargs)
        return after(self, args, call_forward(self, *args, **kwargs))

    bound = types.MethodType(forward, module)
    module.forward = bound  # type: ignore[method-assign]

    def unwrap() -> None:
        state["active"] = False
        if module.__dict__.get("forward") is not bound:
            return  # someone wrapped it again after us: their wrapper stays, ours only delegates now
        if inner is None:
            del module.forward
        else:
            module.forward = inner  # type: ignore[method-assign]

    return Handle(unwrap)
