"""Every difference between the torch versions exporters/ runs on (2.4 and 2.13), in one place.

torch 2.9 moved the TorchScript ONNX exporter's modules under ``torch.onnx._internal.torchscript_exporter``
and made ``torch.onnx.export`` default to the dynamo exporter; the symbolic registry, the export
globals and the graph context are otherwise the same objects in both.

    from exporters import _torch_compat as compat
    restore = compat.override_symbolic("prim::PythonOp", 17, my_symbolic)   # ...export...; restore()
    compat.onnx_export(model, args, buffer, opset_version=17, training=torch.onnx.TrainingMode.TRAINING)
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType
from typing import Any, Callable

import torch

Symbolic = Callable[..., Any]


@functools.cache
def _exporter_modules() -> tuple[ModuleType, ModuleType]:
    """(registration, _globals) of the TorchScript exporter.

    Imported on first use: with onnxruntime-training installed, importing torch.onnx on torch 2.4
    imports ORTModule too (seconds), which ``import exporters`` must not cost.
    """
    try:  # torch >= 2.9
        from torch.onnx._internal.torchscript_exporter import _globals, registration
    except ImportError:  # torch 2.4
        from torch.onnx import _globals  # type: ignore[no-redef]
        from torch.onnx._internal import registration  # type: ignore[no-redef]
    return registration, _globals


def export_training_mode() -> bool:
    """True when the running TorchScript export exports a training graph."""
    mode = _exporter_modules()[1].GLOBALS.training_mode
    if isinstance(mode, bool):
        return mode
    return mode == torch.onnx.TrainingMode.TRAINING


def export_opset() -> int:
    """The opset of the running (or last) TorchScript export."""
    return int(_exporter_modules()[1].GLOBALS.export_onnx_opset_version)


def active_symbolic(name: str, opset: int) -> Symbolic | None:
    """The symbolic the exporter would call now for ``name`` ("domain::op") at ``opset``."""
    group = _exporter_modules()[0].registry.get_function_group(name)
    return group.get(opset) if group is not None else None


def _custom_override(name: str, opset: int) -> Symbolic | None:
    group = _exporter_modules()[0].registry.get_function_group(name)
    # The registry keeps custom functions per exact opset next to the built-in ones; only a custom
    # function registered at this very opset is replaced by ours and must be put back afterwards.
    if group is None or not group._functions.overridden(opset):
        return None
    return group._functions[opset]


def override_symbolic(name: str, opset: int, symbolic: Symbolic) -> Callable[[], None]:
    """Make ``symbolic`` the custom symbolic of ``name`` at ``opset``; returns the undo function.

    The undo puts back what was registered at that opset before (or nothing), and leaves the
    registry alone if someone replaced ``symbolic`` in the meantime.
    """
    registry = _exporter_modules()[0].registry
    previous = _custom_override(name, opset)
    registry.register(name, opset, symbolic, custom=True)

    def restore() -> None:
        if _custom_override(name, opset) is not symbolic:
            return
        if previous is None:
            registry.unregister(name, opset)
        else:
            registry.register(name, opset, previous, custom=True)

    return restore


def python_op_class(node: torch._C.Node) -> type:
    """The autograd Function class a traced ``prim::PythonOp`` node applies."""
    return node.pyobj().__self__


def onnx_export(model: torch.nn.Module, args: tuple, f: Any, **kwargs: Any) -> None:
    """``torch.onnx.export`` with the TorchScript exporter on every supported torch."""
    with warnings.catch_warnings():
        # torch 2.13 deprecates the TorchScript exporter; torch 2.4 warns about traced Python values.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(model, args, f, dynamo=False, **kwargs)
