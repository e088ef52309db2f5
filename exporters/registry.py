"""Which autograd Functions exporters/ exports as PythonOp, and how each names its site.

    from exporters import register_probe_function
    register_probe_function(MyProbe, describe=lambda args: args[0].name)

A registered Function is exported by our PythonOp symbolic (standalone ``export_onnx`` and, once
``install_for_ort`` ran, ORTModule's export) and registered with ORT's PythonOp kernels. Functions
registered as identities (the default) get ORT's shape inference and buffer aliasing: output i is
tensor input i, and the gradient of tensor input i is the gradient of output i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

Describe = Callable[[Sequence[Any]], str]


@dataclass(frozen=True)
class ProbeFunctionSpec:
    """How one probe Function is exported."""

    function: type[torch.autograd.Function]
    describe: Describe  # the Function's non-tensor arguments -> the PythonOp's ``comment`` (its site name)
    identity: bool  # outputs are the tensor inputs, unchanged, in order

    @property
    def name(self) -> str:
        """The fully qualified class name: PythonOp's ``func_name`` and ORT's registry key."""
        return qualified_name(self.function)


def qualified_name(function: type) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def _no_description(non_tensor_args: Sequence[Any]) -> str:
    return ""


class _Registry:
    """The registered probe Functions and who wants to hear of new ones.

    Process-wide: ORT finds a PythonOp's Function by its qualified class name in its own process-wide
    pool, and a Function class is itself process-wide, so one registration serves every export.
    """

    def __init__(self) -> None:
        self.specs: dict[type, ProbeFunctionSpec] = {}
        self.listeners: list[Callable[[ProbeFunctionSpec], None]] = []

    def register(self, spec: ProbeFunctionSpec) -> None:
        self.specs[spec.function] = spec
        for listener in self.listeners:
            listener(spec)

    def unregister(self, function: type) -> None:
        self.specs.pop(function, None)

    def spec_for(self, function: type) -> ProbeFunctionSpec | None:
        return self.specs.get(function)

    def registered(self) -> tuple[ProbeFunctionSpec, ...]:
        return tuple(self.specs.values())

    def on_register(self, listener: Callable[[ProbeFunctionSpec], None]) -> None:
        self.listeners.append(listener)


_REGISTRY = _Registry()


def register_probe_function(function: type[torch.autograd.Function], *, describe: Describe | None = None,
                            identity: bool = True) -> ProbeFunctionSpec:
    """Export ``function`` as ``com.microsoft::PythonOp`` with exporters/ (idempotent; re-registering replaces).

    ``describe(non_tensor_args) -> str`` names the probe's site in the PythonOp's ``comment`` attribute.
    ``identity=False`` for a Function whose outputs are not its tensor inputs: no aliasing and no
    shape inference are declared to ORT for it.
    """
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError(f"register_probe_function needs a torch.autograd.Function subclass, got {function!r}")
    if "<locals>" in function.__qualname__:
        raise ValueError(
            f"{qualified_name(function)} is defined inside a function; ORT finds PythonOp Functions by their "
            "qualified name, which must be unique: define it at module level"
        )
    spec = ProbeFunctionSpec(function, describe or _no_description, identity)
    _REGISTRY.register(spec)
    return spec


def unregister_probe_function(function: type[torch.autograd.Function]) -> None:
    """Stop exporting ``function`` with exporters/ (ORT's own registrations stay until exit)."""
    _REGISTRY.unregister(function)


def spec_for(function: type) -> ProbeFunctionSpec | None:
    return _REGISTRY.spec_for(function)


def registered_specs() -> tuple[ProbeFunctionSpec, ...]:
    return _REGISTRY.registered()


def on_register(listener: Callable[[ProbeFunctionSpec], None]) -> None:
    """Call ``listener(spec)`` for every Function registered from now on (ORT installs itself this way)."""
    _REGISTRY.on_register(listener)
