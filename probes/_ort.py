"""The one place where probes touches onnxruntime-training's private internals.

Everything here works without onnxruntime installed: ORT state is looked up only when ORT has
already been imported by the user's program, so importing probes never imports ORT.

    from probes import _ort
    if _ort.is_exporting(): ...          # ORTModule is exporting (schema run, deep copy, trace)
    inner = _ort.unwrap(model)           # the user's nn.Module inside an ORTModule
"""

from __future__ import annotations

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
            "Install onnxruntime-training-cpu==1.19.2 or update probes/_ort.py."
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
