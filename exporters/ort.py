"""Make ORTModule export the probe Functions with exporters/ (PythonOp with aliasing and shapes).

    import exporters
    exporters.install_for_ort()   # probes.SubscriberManager.subscribe() calls this for you

Without onnxruntime installed this does nothing and imports nothing. If ORT is installed but
``onnxruntime.training.ortmodule`` is not imported yet, the installation waits for that import
(importing ORTModule takes seconds, so it is never done on the user's behalf); once it is imported:

- ORTModule's PythonOp exporter calls our handler for every registered probe Function, which emits
  the node of exporters/pythonop.py (same attributes as ORT's default, plus the site name);
- ORT's PythonOp kernels get each Function's class, ``infer_shape`` and ``alias_input``, so ORT keeps
  the shapes and returns the probes' outputs in their inputs' buffers instead of copying them;
- the forwards of steps no subscriber records run on a second graph, exported once per mode without the
  probes (``ort_internals.route_left_out_steps``: the probes say which steps, and count them);
- a training graph with probes is exported again when which parameters or inputs require grad changes
  (ORT would only rebuild its gradient graph): its probes learn at export which tensors eager
  differentiates (``probes.core.differentiable``).

All ORT internals used here are behind exporters/adapters/ort_internals.py.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable

from .adapters import ort_internals

if TYPE_CHECKING:
    from .handles import Handle

from .pythonop import emit_probe, identity_alias_input, identity_infer_shape
from .registry import ProbeFunctionSpec, on_register, registered_specs, spec_for

_ORTMODULE = "onnxruntime.training.ortmodule"


def _ort_handler(spec: ProbeFunctionSpec) -> Callable[..., Any]:
    def handler(g: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        current = spec_for(spec.function)
        if current is None:  # unregistered since: None makes ORT use its default exporter
            return None
        _INSTALLATION.exported_probes += 1
        return emit_probe(g, node, current, args)

    handler.__qualname__ = f"export_{spec.function.__qualname__}"
    return handler


def _install_spec(spec: ProbeFunctionSpec) -> None:
    ort_internals.add_pythonop_export_handler(spec.name, _ort_handler(spec))
    shape, alias = (identity_infer_shape, identity_alias_input) if spec.identity else (None, None)
    ort_internals.register_pythonop_runtime(spec.name, spec.function, shape, alias)


class _OrtInstallation:
    """Whether the probe exporters are registered with ORTModule, or wait for its import.

    Process-wide: ORT's PythonOp export handlers and kernel registrations are module globals of the
    one imported onnxruntime, and the import hook sits on the process's ``sys.meta_path``.
    """

    def __init__(self) -> None:
        self.installed = False
        self.waiting = False  # an _AfterImport finder is on sys.meta_path
        self.exported_probes = 0  # probe nodes ORTModule's exports emitted so far

    def install(self) -> None:
        if self.installed:
            return
        if ort_internals.is_ortmodule_imported():
            self.install_now()
            return
        if self.waiting or not ort_internals.is_onnxruntime_installed():
            return
        sys.meta_path.insert(0, _AfterImport(_ORTMODULE, self.install_after_import))
        self.waiting = True

    def install_now(self) -> None:
        for spec in registered_specs():
            _install_spec(spec)
        if not self.installed:
            # The probes learn at each export what eager differentiates: a change of requires_grad re-exports.
            ort_internals.reexport_when_requires_grad_changes(lambda: self.exported_probes)
            # Steps no subscriber records run on a graph exported without probes (no PythonOp call).
            ort_internals.switch_left_out_steps()
            # A random node draws from a stream ORT seeds by the node's index: probe nodes must not move it.
            ort_internals.keep_random_streams()
            self.installed = True
            on_register(_install_spec)

    def install_after_import(self, module: Any) -> None:
        # Raising here would break the user's `import onnxruntime.training.ortmodule`; ORT then exports
        # the probes with its default exporter (correct, with an extra copy per probe output).
        try:
            self.install_now()
        except Exception as error:  # noqa: BLE001 - any failure must leave ORT importable
            warnings.warn(
                f"probes could not install their PythonOp exporters into ORTModule ({error}); ORT's default "
                "exporter will be used, which copies every probed tensor",
                RuntimeWarning,
                stacklevel=2,
            )


_INSTALLATION = _OrtInstallation()


def is_installed() -> bool:
    """True once the probe exporters are registered with an imported ORTModule."""
    return _INSTALLATION.installed


def install_for_ort() -> None:
    """Register the probe exporters with ORTModule now, or as soon as the program imports it."""
    _INSTALLATION.install()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``name`` is imported, then removes itself."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self._name = name
        self._callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallbackLoader(spec.loader, self._callback)
        return spec


class _CallbackLoader:
    """The found loader, calling back after executing the module; everything else is delegated."""

    def __init__(self, loader: Any, callback: Callable[[Any], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def inference_session(model: Any, **session_options: Any) -> Any:
    """An ``onnxruntime.InferenceSession`` on an exported model (path or ModelProto) that runs its probes.

        session = exporters.inference_session(exporters.export_onnx(model, (tokens,)))
        outputs = session.run(None, {"tokens": tokens.numpy()})   # ORT calls the probes' forward

    Registers ORT's Python-op runners and the probe Functions first (imports ORTModule). Only valid
    in the process that exported the model: its probe arguments are pointers to live objects.
    """
    import onnxruntime

    ort_internals.enable_pythonop_runners()
    install_for_ort()
    if isinstance(model, (str, os.PathLike)):
        source = os.fspath(model)
    else:
        source = model if isinstance(model, bytes) else model.SerializeToString()
    session_options.setdefault("providers", ["CPUExecutionProvider"])
    return onnxruntime.InferenceSession(source, **session_options)


def ortmodule_threads(intra_op_threads: int, *, allow_spinning: bool = False) -> "Handle":
    """Give every ORTModule session built afterwards ``intra_op_threads`` intra-op threads, and (by default)
    workers that sleep when idle instead of spinning: what several ranks on one machine need, each with its
    share of the cores (docs/zero3.md, "Threads per rank"). ORTModule 1.19 has no setting of its own for
    either. Sessions already built keep their pool (ORTModule builds its session on the first step).

        handle = exporters.ortmodule_threads(os.cpu_count() // ranks_per_machine)   # before the first step
        handle.remove()   # sessions built afterwards get ORT's defaults again (or: with ...:)
    """
    return ort_internals.ortmodule_threads(intra_op_threads, spinning=allow_spinning)
