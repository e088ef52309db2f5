"""The one place where probes touches onnxruntime-training's private internals.

Everything here works without onnxruntime installed: ORT state is looked up only when ORT has
already been imported by the user's program, so importing probes never imports ORT.

    from . import _ort_compat
    if _ort_compat.is_exporting(): ...          # ORTModule is exporting (schema run, deep copy, trace)
    inner = _ort_compat.unwrap(model)           # the user's nn.Module inside an ORTModule
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import sys
from typing import Any

import torch

# The versions whose internals this adapter was written against and tested with.
SUPPORTED_ORT = ((1, 19), (1, 20))

_SUBSCRIBER_MANAGER_MODULE = "onnxruntime.training.utils.hooks._subscriber_manager"


class OrtInternalsError(RuntimeError):
    """onnxruntime-training's internals differ from what probes expects."""


def ort_version() -> tuple[int, int] | None:
    """(major, minor) of the imported onnxruntime, or None when onnxruntime is not imported."""
    ort = sys.modules.get("onnxruntime")
    if ort is None:
        return None
    major, minor = (int(part) for part in ort.__version__.split(".")[:2])
    return major, minor


def _check_version() -> None:
    version = ort_version()
    if version is not None and not (SUPPORTED_ORT[0] <= version < SUPPORTED_ORT[1]):
        raise OrtInternalsError(
            f"onnxruntime {'.'.join(map(str, version))} is not supported by probes' ORT adapter "
            f"(supported: >= {SUPPORTED_ORT[0][0]}.{SUPPORTED_ORT[0][1]}, < {SUPPORTED_ORT[1][0]}.{SUPPORTED_ORT[1][1]}). "
            "Install onnxruntime-training-cpu==1.19.2 or update probes/_ort_compat.py."
        )


def is_ort_exporting() -> bool:
    """True while ORTModule exports the model.

    ORT 1.19 wraps its whole export (the eager output-schema run, the forward on its deep copy and
    the TorchScript trace) in `no_increase_global_step()`, which raises a module-level flag. ORT
    imports that module before exporting, so if it is not imported, ORT is not exporting.
    """
    manager_module = sys.modules.get(_SUBSCRIBER_MANAGER_MODULE)
    if manager_module is None:
        return False
    flag = getattr(manager_module, "ORT_NO_INCREASE_GLOBAL_STEP", None)
    if not isinstance(flag, list) or not flag:
        _check_version()
        raise OrtInternalsError(
            f"{_SUBSCRIBER_MANAGER_MODULE}.ORT_NO_INCREASE_GLOBAL_STEP is missing or changed shape; "
            "probes cannot tell ORTModule's export runs from training steps"
        )
    return bool(flag[0])


def is_exporting() -> bool:
    """True for runs that are not training steps: ORT's export runs and any ONNX/TorchScript trace."""
    return is_ort_exporting() or torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()


def _ortmodule_class() -> type | None:
    module = sys.modules.get("onnxruntime.training.ortmodule.ortmodule")
    return getattr(module, "ORTModule", None) if module is not None else None


def is_ortmodule(model: Any) -> bool:
    cls = _ortmodule_class()
    return cls is not None and isinstance(model, cls)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module: `model` itself, or the module an ORTModule wraps."""
    if not is_ortmodule(model):
        return model
    _check_version()
    inner = getattr(model, "module", None)
    if not isinstance(inner, torch.nn.Module):
        raise OrtInternalsError("ORTModule.module is not an nn.Module; cannot find the wrapped model")
    return inner


def signal_model_changed(model: torch.nn.Module) -> None:
    """Make an ORTModule re-export on its next forward (hooks were added or removed)."""
    if not is_ortmodule(model):
        return
    _check_version()
    try:
        torch_module = model._torch_module
        managers = [torch_module._execution_manager(training) for training in (False, True)]
        for manager in managers:
            manager._graph_transition_manager.signal_model_changed()
    except AttributeError as error:
        raise OrtInternalsError(
            f"cannot ask ORTModule to re-export after (un)subscribing ({error}); "
            "subscribe before wrapping the model in ORTModule"
        ) from error


# PythonOp export support (used by exporters/) -----------------------------------------------------

_ORTMODULE_PACKAGE = "onnxruntime.training.ortmodule"
_PYTHONOP_EXPORTER_MODULE = "onnxruntime.training.ortmodule._custom_autograd_function_exporter"


@functools.cache
def is_onnxruntime_installed() -> bool:
    """True when onnxruntime can be imported (never imports it)."""
    return importlib.util.find_spec("onnxruntime") is not None


def is_ortmodule_imported() -> bool:
    """True once the program has imported onnxruntime.training.ortmodule (never imports it)."""
    return _ORTMODULE_PACKAGE in sys.modules


def add_pythonop_export_handler(func_name: str, handler: Any) -> None:
    """Make ORTModule's PythonOp exporter call ``handler(g, node, *args, **kwargs)`` for ``func_name``.

    ``func_name`` is the Function's fully qualified class name (ORT's key). ORT 1.19 looks this map up
    before its default export; a handler returning None falls back to the default.
    """
    _check_version()
    module = importlib.import_module(_PYTHONOP_EXPORTER_MODULE)
    handlers = getattr(getattr(module, "_SpecialCustomFunctionHandler", None), "_HIGH_PRIORITY_EXPORT_HANDLER_MAP", None)
    register = getattr(module, "register_high_priority_handler", None)
    if register is None or not isinstance(handlers, dict):
        raise OrtInternalsError(
            f"{_PYTHONOP_EXPORTER_MODULE}.register_high_priority_handler is missing or changed; "
            "probes cannot export their autograd Functions as PythonOp under ORTModule"
        )
    register(func_name)(handler)


_RELEASE_AT_EXIT: list[bool] = []


def register_pythonop_runtime(func_name: str, function: type, infer_shape: Any, alias_input: Any) -> None:
    """Tell ORT's PythonOp kernels which class runs ``func_name``, its shape and alias functions.

    ``infer_shape(node, input_shapes, input_dtypes) -> (output_shapes, output_dtypes)`` keeps shapes
    through the op; ``alias_input(node_proto_bytes) -> (forward_map, backward_map)`` lets ORT reuse
    input buffers for outputs instead of copying them (see exporters/pythonop.py for the maps).
    """
    _check_version()
    try:
        from onnxruntime.capi._pybind_state import (
            register_input_alias_function,
            register_shape_inference_function,
            register_torch_autograd_function,
            unregister_python_functions,
        )
    except ImportError as error:
        raise OrtInternalsError(
            f"onnxruntime's PythonOp registration functions are missing ({error}); "
            "is this onnxruntime-training (not plain onnxruntime)?"
        ) from error
    if not _RELEASE_AT_EXIT:
        # ORT's function pool is a C++ static holding these Python objects; released after the
        # interpreter is gone, it crashes the process at exit. ORTModule registers this release
        # only when an ORTModule is constructed, which a standalone export may never do.
        atexit.register(unregister_python_functions)
        _RELEASE_AT_EXIT.append(True)
    register_torch_autograd_function(func_name, function)
    if infer_shape is not None:
        register_shape_inference_function(func_name, infer_shape)
    if alias_input is not None:
        register_input_alias_function(func_name, alias_input)


def enable_pythonop_runners() -> None:
    """Register ORT's Python-op forward/backward runners (ORTModule does it when first constructed).

    Needed to run PythonOp nodes in a plain InferenceSession; imports ORTModule (seconds, once).
    """
    _check_version()
    from onnxruntime.training.ortmodule import _custom_autograd_function

    enable = getattr(_custom_autograd_function, "enable_custom_autograd_support", None)
    if enable is None:
        raise OrtInternalsError("onnxruntime.training.ortmodule._custom_autograd_function.enable_custom_autograd_support is missing")
    enable(True)
