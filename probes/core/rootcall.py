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

The wrapper keeps the wrapped forward's signature (``inspect.signature`` follows ``__wrapped__``;
ORTModule and Hugging Face read it), follows the module when it is deep-copied (ORTModule copies it to
export), and pickles as the plain forward (a pickled subscribed model unpickles without probes).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from exporters.handles import Handle

Before = Callable[[torch.nn.Module, tuple, dict], "tuple[tuple, dict]"]
After = Callable[[torch.nn.Module, tuple, Any], Any]


class _WrappedForward:
    def __init__(self, module: torch.nn.Module, before: Before, after: After) -> None:
        self._module = module
        self._inner: Callable[..., Any] | None = module.__dict__.get("forward")  # someone else's wrapper, kept
        self._before = before
        self._after = after
        self.active = True
        functools.update_wrapper(self, self._inner or _plain_forward(module))

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner
        # Called with the module, not bound: torch 2.4's dynamo cannot trace ``forward.__get__(module)``.
        return inner(*args, **kwargs) if inner is not None else type(self._module).forward(self._module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module
        if not self.active:
            return self._forward(*args, **kwargs)
        args, kwargs = self._before(module, args, kwargs)
        outputs = self._forward(*args, **kwargs)
        return self._after(module, args, outputs)

    def __deepcopy__(self, memo: dict) -> "_WrappedForward":
        # Copied as part of its module: the copy wraps the copied module (already in ``memo``).
        module = memo.get(id(self._module), self._module)
        return _WrappedForward(module, self._before, self._after)

    def __reduce__(self) -> tuple:
        return (_plain_forward, (self._module,))


def _plain_forward(module: torch.nn.Module) -> Callable[..., Any]:
    return type(module).forward.__get__(module)


def wrap_forward(module: torch.nn.Module, before: Before, after: After) -> Handle:
    """Run ``before`` and ``after`` around ``module``'s forward, inside it (see the module docstring)."""
    wrapper = _WrappedForward(module, before, after)
    module.forward = wrapper  # type: ignore[method-assign]

    def unwrap() -> None:
        wrapper.active = False
        if module.__dict__.get("forward") is not wrapper:
            return  # someone wrapped it again after us: their wrapper stays, ours only delegates now
        if wrapper._inner is None:
            del module.forward
        else:
            module.forward = wrapper._inner  # type: ignore[method-assign]

    return Handle(unwrap)
