"""The one place where probes touches onnxruntime-training's private internals.

Everything here works without onnxruntime installed: ORT state is looked up only when ORT has
already been imported by the user's program, so importing probes never imports ORT.

    from exporters.adapters import ort_internals
    if ort_internals.is_exporting(): ...          # ORTModule is exporting (schema run, deep copy, trace)
    if ort_internals.is_ort_schema_run(): ...     # its eager run before the trace (on a deep copy)
    if ort_internals.inside_ort_graph(): ...      # a PythonOp run by ORT's runtime: do not raise from here
    inner = ort_internals.unwrap(model)           # the user's nn.Module inside an ORTModule
    ort_internals.install_export_rewrite(rewrite) # ORTModule's export steps for some models (exporters/zero3.py)
    with ort_internals.ortmodule_threads(1): ...   # ORTModule sessions built inside: 1 intra-op thread, no spinning
    ort_internals.route_left_out_steps(model, LeftOutRoute(left_out=..., finish=...))  # unprobed graph for them
    if ort_internals.exporting_unprobed(): ...     # ORTModule exports that graph: hooks insert nothing
    ort_internals.keep_random_streams()            # graphs with probes draw the random numbers those without draw

One version check (``SUPPORTED_ORT``) runs before ORT's internals are used or when they are not as expected.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import sys
import traceback
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from ..handles import Handle

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
            "Install onnxruntime-training-cpu==1.19.2 or update exporters/adapters/ort_internals.py."
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


def is_ort_schema_run() -> bool:
    """True during ORTModule's eager run of the model before an export, the one that finds its output schema.

    ORT 1.19 runs (a deep copy of) the model once, eagerly under ``torch.no_grad()``, then traces it; both
    inside the export flag of ``is_ort_exporting``. The eager run is the one that is no trace.
    """
    return is_ort_exporting() and not torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export()


# ORTModule's Python frame through which its C++ graph run (forward and backward) calls PythonOps.
_GRAPH_RUNNER = "ortmodule/_execution_agent.py"


def inside_ort_graph() -> bool:
    """True when called (on this thread) from a PythonOp that ORTModule's runtime is executing.

    ORT 1.19 calls a PythonOp's Python code from C++ inside its execution agent's run; an exception
    raised there reaches the caller only as ORT's ``RuntimeError(... "Get null result")``, its type and
    message lost (printed to stderr). Whoever wants to raise something readable waits until this is False.
    Walks this thread's Python stack: meant for rare events, not for every probe.
    """
    if _SUBSCRIBER_MANAGER_MODULE not in sys.modules and "onnxruntime.training.ortmodule" not in sys.modules:
        return False
    return any(frame.f_code.co_filename.replace("\\", "/").endswith(_GRAPH_RUNNER)
               for frame, _ in traceback.walk_stack(None))


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
            _export_again(manager)
    except AttributeError as error:
        raise OrtInternalsError(
            f"cannot ask ORTModule to re-export after (un)subscribing ({error}); "
            "subscribe before wrapping the model in ORTModule"
        ) from error


def _export_again(manager: Any) -> None:
    """Make ORT's training or inference ``manager`` export, build and run a new graph from its next forward.

    ORT 1.19's own signal is not enough once it exported: its managers then skip the checks that read it
    and that build a new session (``ORTMODULE_SKIPCHECK_POLICY``'s default) unless nothing was exported
    and no session made yet, which is what this makes them see (ORT's own re-initialisation after
    unpickling drops the session the same way).
    """
    transition = manager._graph_transition_manager
    transition.signal_model_changed()
    transition._exported_model_info = None
    manager._execution_agent = None


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
    _PATCHES.release_at_exit(unregister_python_functions)
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


# Rewriting ORTModule's export (ZeRO-3 models, see exporters/zero3.py) ----------------------------

_GTM_MODULE = "onnxruntime.training.ortmodule._graph_transition_manager"
_TRAINING_MANAGER_MODULE = "onnxruntime.training.ortmodule._training_manager"
_TRIGGER_MODULE = "onnxruntime.training.ortmodule._mem_efficient_grad_mgmt"
_EXPORT_STEPS = ("_export_model", "_post_export_process")


class Zero3ExportError(RuntimeError):
    """A ZeRO-3 model cannot be exported for ORTModule as it is configured."""


@dataclass(frozen=True)
class ExportRewrite:
    """How ORTModule exports the models ``is_managed`` accepts (the others export as ORT does).

    ``export_context(model)`` is entered around the export (of the model itself: no deep copy);
    ``rewrite_exported(model_proto, module)`` runs on the exported graph before ORT processes it;
    ``drop_inputs(model_proto, module, graph_input_names)`` runs on ORT's processed training graph and
    returns the graph inputs it removed, whose consumers now read ``pull_weight_trigger()``'s input.
    """

    is_managed: Callable[[Any], bool]
    export_context: Callable[[Any], ContextManager[Any]]
    rewrite_exported: Callable[[Any, Any], None]
    drop_inputs: Callable[[Any, Any, list[str]], list[str]]


def _gtm_class() -> type:
    module = importlib.import_module(_GTM_MODULE)
    cls = getattr(module, "GraphTransitionManager", None)
    if cls is None or not all(isinstance(cls.__dict__.get(name), staticmethod) for name in _EXPORT_STEPS):
        raise OrtInternalsError(
            f"{_GTM_MODULE}.GraphTransitionManager no longer has the static methods {_EXPORT_STEPS}; "
            "probes cannot run ZeRO-3 models under this ORTModule (see exporters/adapters/ort_internals.py)"
        )
    return cls


def pull_weight_trigger() -> tuple[str, int, list[int]]:
    """ORT's memory-efficient "pull weight trigger" input: name, ONNX element type, shape."""
    _check_version()
    module = importlib.import_module(_TRIGGER_MODULE)
    try:
        return (module.MEM_EFFICIENT_PARAM_TRIGGER_INPUT_NAME, int(module.MEM_EFFICIENT_PARAM_TRIGGER_OUTPUT_DTYPE),
                list(module.MEM_EFFICIENT_PARAM_TRIGGER_OUTPUT_SHAPE))
    except AttributeError as error:
        raise OrtInternalsError(f"{_TRIGGER_MODULE} changed ({error}); exporters/adapters/ort_internals.py must be updated") from error


def install_export_rewrite(rewrite: ExportRewrite) -> None:
    """Wrap ORTModule's two export steps with ``rewrite`` (idempotent; the latest rewrite wins)."""
    _check_version()
    cls = _gtm_class()
    pull_weight_trigger()
    _PATCHES.install_rewrite(cls, rewrite)


def reexport_when_requires_grad_changes(exported_probes: Callable[[], int]) -> None:
    """Make ORTModule export a training graph with probes again when which parameters or inputs require
    grad changes (idempotent; the latest ``exported_probes`` wins).

    The probes of such a graph learnt from the export's eager run which of their tensors eager
    differentiates; a new export is the only way to learn it again. ORT 1.19 itself never exports again
    for that: once exported it skips its checks (``ORTMODULE_SKIPCHECK_POLICY``'s default), and without
    that skip it only rebuilds the gradient graph. ``exported_probes()`` counts the probe nodes exported
    so far: an export that made it grow holds probes. Costs a comparison of flags per training step.
    """
    _check_version()
    cls = getattr(importlib.import_module(_TRAINING_MANAGER_MODULE), "TrainingManager", None)
    if cls is None or not callable(cls.__dict__.get("forward")):
        raise OrtInternalsError(
            f"{_TRAINING_MANAGER_MODULE}.TrainingManager.forward is missing; probes cannot tell ORTModule to "
            "export again when requires_grad changes"
        )
    _PATCHES.install_requires_grad_watch(cls, exported_probes)


_GEM_MODULE = "onnxruntime.training.ortmodule._graph_execution_manager"
_INFERENCE_MANAGER_MODULE = "onnxruntime.training.ortmodule._inference_manager"


# Steps no subscriber records: run on a second graph, exported without probes -------------------------

@dataclass(frozen=True)
class LeftOutRoute:
    """How ORTModule runs the forwards of one model whose step no subscriber records.

    ``left_out()`` is asked at every ORTModule forward of the model; when True, the forward runs on a graph
    of its own, exported once per mode (training, inference) while ``exporting_unprobed()`` is True (the
    probes' hooks then insert nothing), and ``finish(outputs)`` turns that forward's outputs into what the
    caller gets (the step's bookkeeping, done eagerly). When False, ORT's own managers run the probed graph.
    """

    left_out: Callable[[], bool]
    finish: Callable[[Any], Any]


def route_left_out_steps(model: torch.nn.Module, route: LeftOutRoute) -> Handle:
    """Run ``model``'s left-out ORTModule forwards as ``route`` says, once ``switch_left_out_steps()`` is
    installed (the model may be wrapped in ORTModule before or after); ``remove()`` ends it and drops the
    unprobed graphs. Needs no onnxruntime: without it, nothing asks the route."""
    _PATCHES.routes[model] = route
    model_ref = weakref.ref(model)

    def remove() -> None:
        model = model_ref()
        if model is not None and _PATCHES.routes.get(model) is route:
            del _PATCHES.routes[model]
            _PATCHES.drop_twins(model)

    return Handle(remove)


def switch_left_out_steps() -> None:
    """Make ORTModule's training and inference managers ask the routes of ``route_left_out_steps``
    (idempotent). ORT 1.19 has one execution manager per mode, each holding one exported graph; a left-out
    forward goes to a second manager of the same class (its "twin", built on the first left-out forward
    of that mode), which exports and runs the model as it is while ``exporting_unprobed()`` holds. The twin
    takes the module's parameters as graph inputs, as the first does, so both train the same weights."""
    _check_version()
    classes = []
    managers = ((_TRAINING_MANAGER_MODULE, "TrainingManager"), (_INFERENCE_MANAGER_MODULE, "InferenceManager"))
    for module_name, name in managers:
        cls = getattr(importlib.import_module(module_name), name, None)
        if cls is None or not callable(cls.__dict__.get("forward")):
            raise OrtInternalsError(
                f"{module_name}.{name}.forward is missing; probes cannot run left-out steps on an unprobed graph "
                "(see exporters/adapters/ort_internals.py)"
            )
        classes.append(cls)
    _PATCHES.install_left_out_switch(classes)


def exporting_unprobed() -> bool:
    """True while ORTModule runs a forward of a left-out step (its first one exports the unprobed graph)."""
    return _PATCHES.unprobed_runs > 0


# ORT's random kernels that seed their generator, when the node has no ``seed`` attribute, with the global seed
# plus the node's index in the graph the session runs (onnxruntime/core/providers/cpu/generator/random.h, 1.19).
_SEEDED_BY_INDEX = frozenset({"RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Multinomial"})
# Random nodes ORT inlines as functions when it builds the session: their function body's nodes are appended to the
# graph, so the body's RandomUniformLike is seeded by the graph's node count then (Bernoulli: RandomUniformLike,
# Greater, Cast; onnx/defs/generator/defs.cc).
_INLINED_BODY = {"Bernoulli": 3}


def keep_random_streams() -> None:
    """Make ORTModule's graphs with probes draw the random numbers its graphs without probes draw (idempotent).

    ORT 1.19 seeds each random node without a ``seed`` attribute (``torch.rand``/``randn``/``multinomial`` in a
    forward) with the global seed plus the node's index in its session's graph. Probe nodes move those indices,
    and with them the random streams: ViT-MAE's masking drew other patches with probes than without. So when
    ORT builds a training or inference graph that holds probes and such nodes, the manager's unprobed twin
    builds the graph without probes from the same inputs, and each random node of the probed graph moves to
    the index its namesake has there (swapped with the node it finds there). Costs one more export and graph
    build, only for graphs with such nodes; dropout draws from ORT's Philox generator, which no index seeds.
    """
    _check_version()
    classes = [getattr(importlib.import_module(module_name), name, None) for module_name, name in
               ((_TRAINING_MANAGER_MODULE, "TrainingManager"), (_INFERENCE_MANAGER_MODULE, "InferenceManager"))]
    for cls in classes:
        if cls is None or not all(callable(getattr(cls, method, None)) for method in
                                  ("_build_graph", "_detect_from_inputs", "_initialize_graph_builder")):
            raise OrtInternalsError(
                "ORT's TrainingManager or InferenceManager changed; probes cannot keep ORTModule's random streams "
                "(see exporters/adapters/ort_internals.py)"
            )
    _PATCHES.install_random_streams(classes)


def _unseeded(node: Any) -> bool:
    """Whether an ONNX node has no ``seed`` attribute (ORT then seeds its generator itself)."""
    return not any(attribute.name == "seed" for attribute in node.attribute)


def _draws_by_index(node: Any) -> bool:
    return node.op_type in _SEEDED_BY_INDEX and node.domain in ("", "ai.onnx") and _unseeded(node)


def _inlined_by_ort(node: Any) -> bool:
    return node.op_type in _INLINED_BODY and node.domain in ("", "ai.onnx") and _unseeded(node)


def _inline_draws(graph: Any, unprobed: Any) -> tuple[list[Any], dict[str, int]]:
    """Copies of ``graph``'s nodes, each unseeded Bernoulli node replaced by the nodes of its ONNX function body (a
    RandomUniformLike, then Greater and CastLike: what ORT inlines, the cast written against the input's type),
    and where each new RandomUniformLike must stand: where ORT puts the one it inlines into ``unprobed`` (its
    node count, plus the bodies inlined before it, in node order)."""
    import onnx
    from onnx import helper

    at = len(unprobed.node)
    wanted: dict[str, int] = {}
    for node in unprobed.node:
        if _inlined_by_ort(node):
            wanted[f"{node.name}/draw"] = at
            at += _INLINED_BODY[node.op_type]
    nodes = []
    for node in graph.node:
        if not _inlined_by_ort(node):
            nodes.append(onnx.NodeProto())
            nodes[-1].CopyFrom(node)
            continue
        (probability,), (drawn,) = node.input, node.output
        uniform, greater = f"{node.name}/uniform", f"{node.name}/greater"
        dtype = [attribute.i for attribute in node.attribute if attribute.name == "dtype"]
        nodes += [helper.make_node("RandomUniformLike", [probability], [uniform], name=f"{node.name}/draw",
                                   low=0.0, high=1.0),
                  helper.make_node("Greater", [uniform, probability], [greater], name=f"{node.name}/greater"),
                  helper.make_node("Cast", [greater], [drawn], name=f"{node.name}/cast", to=dtype[0]) if dtype else
                  helper.make_node("CastLike", [greater, probability], [drawn], name=f"{node.name}/cast")]
    return nodes, wanted


def _holds_probes(graph: Any) -> bool:
    """Whether an ONNX graph holds probe nodes (PythonOps of probes' Functions, or probes' ATen operators)."""
    for node in graph.node:
        for attribute in node.attribute:
            if (attribute.name, node.op_type) in (("func_name", "PythonOp"), ("operator", "ATen")) and \
                    attribute.s.decode(errors="replace").startswith(("probes.", "probes::")):
                return True
    return False


def _place_random_nodes(graph: Any, unprobed: Any) -> list[str]:
    """Move each random node of ``graph`` to its namesake's index in ``unprobed`` (by swapping), a Bernoulli's
    draw to where ORT's inlining puts it there (``_inline_draws``); the names of those that cannot move (no
    namesake, or an index past ``graph``'s end)."""
    nodes, inlined = _inline_draws(graph, unprobed)
    wanted = {node.name: index for index, node in enumerate(unprobed.node) if _draws_by_index(node)}
    wanted.update(inlined)
    unplaced = [node.name for node in nodes
                if _draws_by_index(node) and (node.name not in wanted or wanted[node.name] >= len(nodes))]
    for name, target in sorted(wanted.items(), key=lambda item: item[1]):
        here = next((index for index, node in enumerate(nodes) if node.name == name and _draws_by_index(node)), None)
        if here is not None and target < len(nodes):
            nodes[here], nodes[target] = nodes[target], nodes[here]
    del graph.node[:]
    graph.node.extend(nodes)
    return unplaced


def ortmodule_threads(intra_op_threads: int, *, spinning: bool = False) -> Handle:
    """Make the ORTModule sessions built from now on (at their first forward) use ``intra_op_threads``
    intra-op threads, spinning while idle or not; ``remove()`` restores the earlier setting.

        with ortmodule_threads(1):          # as torch.set_num_threads(1): one core per process
            model = ORTModule(model); model(x)

    ORT 1.19's ORTModule has no option for it: its sessions get one intra-op thread per core, which
    spin between kernels, so on a machine whose cores are all busy (other ranks, PyTorch's own threads)
    they take CPU from the thread that runs the graph and its PythonOps.
    """
    if not isinstance(intra_op_threads, int) or isinstance(intra_op_threads, bool) or intra_op_threads < 1:
        raise ValueError(f"intra_op_threads must be an int >= 1, got {intra_op_threads!r}")
    _check_version()
    cls = getattr(importlib.import_module(_GEM_MODULE), "GraphExecutionManager", None)
    if cls is None or not callable(getattr(cls, "_get_session_config", None)):
        raise OrtInternalsError(
            f"{_GEM_MODULE}.GraphExecutionManager._get_session_config is missing; probes cannot set ORTModule's "
            "threads (see exporters/adapters/ort_internals.py)"
        )
    earlier = _PATCHES.threads
    _PATCHES.install_threads(cls, (intra_op_threads, spinning))
    return Handle(lambda: _PATCHES.install_threads(cls, earlier))


def _requires_grad_flags(parameters: tuple[torch.nn.Parameter, ...], inputs: Any) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Which of ``parameters``, and which tensors of ``inputs`` (nested), require grad."""
    tensors: list[torch.Tensor] = []
    pending = [inputs]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return tuple(p.requires_grad for p in parameters), tuple(t.requires_grad for t in tensors)


def _export_model(**kwargs: Any) -> Any:
    return _PATCHES.export_model(**kwargs)


def _post_export_process(**kwargs: Any) -> Any:
    return _PATCHES.post_export_process(**kwargs)


class _OrtPatches:
    """What this adapter changed in the imported onnxruntime: its exit release, its export steps, the
    training forward that exports a graph with probes again when requires_grad changes, and the training and
    inference forwards that run left-out steps on an unprobed twin manager.

    Process-wide: ORT's PythonOp function pool is a C++ static, and the export steps and the forwards are
    methods of ORT's GraphTransitionManager, TrainingManager and InferenceManager classes, shared by every
    ORTModule of the process.
    """

    def __init__(self) -> None:
        self.releases_at_exit = False
        self.rewrite: ExportRewrite | None = None
        self.original_steps: dict[str, Callable[..., Any]] = {}  # ORT's own, once wrapped
        self.exported_probes: Callable[[], int] | None = None
        # Per TrainingManager whose last export held probes: the module's parameters then (ORT 1.19, too, feeds
        # the parameter objects it found at its first run, GraphTransitionManager._buffer_for_ort_runs; walking
        # the modules every step cost 0.1 to 0.2 ms on a 6-layer GPT-2) and the requires_grad flags it exported with.
        self.watched: "weakref.WeakKeyDictionary[Any, tuple[tuple, tuple]]" = weakref.WeakKeyDictionary()
        # ORTModule's session options: (intra-op threads, spinning) for sessions built from now on, or None.
        self.threads: tuple[int, bool] | None = None
        self.original_session_config: Callable[..., Any] | None = None
        # Left-out steps: each routed model's route, each ORT manager's unprobed twin, and the twins themselves.
        self.routes: "weakref.WeakKeyDictionary[torch.nn.Module, LeftOutRoute]" = weakref.WeakKeyDictionary()
        self.twin_of: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self.twins: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.left_out_switched = False
        self.unprobed_runs = 0  # twins' forwards running now (more than one: a model nested in another)
        # keep_random_streams: the inputs a manager is building its graph for, between its two calls.
        self.building_for: "weakref.WeakKeyDictionary[Any, tuple[tuple, dict]]" = weakref.WeakKeyDictionary()
        self.random_streams_kept = False

    def install_left_out_switch(self, classes: list[type]) -> None:
        if self.left_out_switched:
            return
        for cls in classes:
            cls.forward = self.switching(cls.forward)
        self.left_out_switched = True

    def switching(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(manager: Any, *inputs: Any, **kwargs: Any) -> Any:
            route = self.route_of(manager) if self.routes else None
            if route is None or not route.left_out():
                return original(manager, *inputs, **kwargs)
            twin = self.twin_of.get(manager)
            if twin is None:
                twin = self.twin_of[manager] = self.twin(manager)
            self.unprobed_runs += 1
            try:
                outputs = twin.forward(*inputs, **kwargs)  # the twin is no routed manager: ORT's forward
            finally:
                self.unprobed_runs -= 1
            return route.finish(outputs)

        return forward

    def install_random_streams(self, classes: list[type]) -> None:
        if self.random_streams_kept:
            return
        for cls in classes:
            cls._detect_from_inputs = self.noting_inputs(cls._detect_from_inputs)
            cls._build_graph = self.placing_random_nodes(cls._build_graph)
        self.random_streams_kept = True

    def noting_inputs(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def detect_from_inputs(manager: Any, inputs: tuple, kwargs: dict) -> Any:
            self.building_for[manager] = (inputs, kwargs)  # ORT builds the graph next (_build_graph)
            return original(manager, inputs, kwargs)

        return detect_from_inputs

    def placing_random_nodes(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def build_graph(manager: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(manager, *args, **kwargs)
            building_for = self.building_for.pop(manager, None)
            if building_for is None or manager in self.twins or self.unprobed_runs:
                return result
            try:
                graph = manager._onnx_models.optimized_model.graph
            except AttributeError as error:
                raise OrtInternalsError(f"ORT's execution manager changed ({error}); see exporters/adapters/ort_internals.py") from error
            if not _holds_probes(graph):
                return result
            unplaced = []
            if any(_draws_by_index(node) or _inlined_by_ort(node) for node in graph.node):
                unplaced = _place_random_nodes(graph, self.unprobed_graph(manager, *building_for))
            if unplaced:
                warnings.warn(f"probes: ORTModule seeds the random nodes {unplaced} by their place in the graph, which "
                              "the probes change: their random numbers differ from training without probes",
                              stacklevel=2)
            return result

        return build_graph

    def unprobed_graph(self, manager: Any, inputs: tuple, kwargs: dict) -> Any:
        """The graph ``manager``'s twin builds without probes for ``inputs`` (the twin keeps it)."""
        twin = self.twin_of.get(manager)
        if twin is None:
            twin = self.twin_of[manager] = self.twin(manager)
        self.unprobed_runs += 1
        try:
            build, info = twin._graph_transition_manager.get_post_processed_model(inputs, kwargs)
            if build:
                twin._initialize_graph_builder(info)
                twin._detect_from_inputs(inputs, kwargs)
                twin._build_graph(twin._get_graph_transformer_config())
            return twin._onnx_models.optimized_model.graph
        finally:
            self.unprobed_runs -= 1

    def route_of(self, manager: Any) -> LeftOutRoute | None:
        if manager in self.twins:
            return None
        try:
            model = manager._flattened_module._original_module
        except AttributeError as error:
            raise OrtInternalsError(f"ORT's execution manager changed ({error}); see exporters/adapters/ort_internals.py") from error
        return self.routes.get(model)

    def twin(self, manager: Any) -> Any:
        """A manager of ``manager``'s class on the same flattened module, options and fallback, with no graph yet."""
        try:
            twin = type(manager)(manager._flattened_module, manager._debug_options, manager._fallback_manager,
                                 manager._logger)
        except (AttributeError, TypeError) as error:
            raise OrtInternalsError(
                f"cannot build a second ORT {type(manager).__name__} for left-out steps ({error}); "
                "see exporters/adapters/ort_internals.py"
            ) from error
        self.twins.add(twin)
        return twin

    def drop_twins(self, model: torch.nn.Module) -> None:
        for manager in [m for m in self.twin_of if m._flattened_module._original_module is model]:
            del self.twin_of[manager]

    def install_threads(self, cls: type, threads: tuple[int, bool] | None) -> None:
        self.threads = threads
        if self.original_session_config is not None:
            return
        original = self.original_session_config = cls._get_session_config

        @functools.wraps(original)
        def session_config(manager: Any) -> Any:
            options, *rest = original(manager)
            if self.threads is not None:
                options.intra_op_num_threads = self.threads[0]
                options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.threads[1] else "0")
            return (options, *rest)

        cls._get_session_config = session_config

    def release_at_exit(self, unregister_python_functions: Callable[[], None]) -> None:
        if self.releases_at_exit:
            return
        # ORT's function pool is a C++ static holding these Python objects; released after the
        # interpreter is gone, it crashes the process at exit. ORTModule registers this release
        # only when an ORTModule is constructed, which a standalone export may never do.
        atexit.register(unregister_python_functions)
        self.releases_at_exit = True

    def install_rewrite(self, cls: type, rewrite: ExportRewrite) -> None:
        self.rewrite = rewrite
        if self.original_steps:
            return
        for name in _EXPORT_STEPS:
            self.original_steps[name] = cls.__dict__[name].__func__
        cls._export_model = staticmethod(functools.wraps(self.original_steps["_export_model"])(_export_model))
        cls._post_export_process = staticmethod(
            functools.wraps(self.original_steps["_post_export_process"])(_post_export_process))

    def install_requires_grad_watch(self, cls: type, exported_probes: Callable[[], int]) -> None:
        installed = self.exported_probes is not None
        self.exported_probes = exported_probes
        if installed:
            return
        original = cls.forward

        @functools.wraps(original)
        def forward(manager: Any, *inputs: Any, **kwargs: Any) -> Any:
            return self.training_forward(original, manager, inputs, kwargs)

        cls.forward = forward

    def training_forward(self, original: Callable[..., Any], manager: Any, inputs: tuple, kwargs: dict) -> Any:
        try:
            transition, module = manager._graph_transition_manager, manager._flattened_module
            exported = transition._exported_model_info
        except AttributeError as error:
            raise OrtInternalsError(f"ORT's TrainingManager changed ({error}); see exporters/adapters/ort_internals.py") from error
        watched = self.watched.get(manager)
        if watched is not None and _requires_grad_flags(watched[0], (inputs, kwargs)) != watched[1]:
            _export_again(manager)
            exported = None
        probes = self.exported_probes()
        result = original(manager, *inputs, **kwargs)
        if transition._exported_model_info is not exported:  # it exported
            if self.exported_probes() != probes:
                parameters = tuple(module.parameters())
                self.watched[manager] = parameters, _requires_grad_flags(parameters, (inputs, kwargs))
            else:
                self.watched.pop(manager, None)
        return result

    def managed(self, flattened_module: Any) -> tuple[ExportRewrite, torch.nn.Module] | None:
        rewrite = self.rewrite
        model = getattr(flattened_module, "_original_module", None)
        if rewrite is None or not isinstance(model, torch.nn.Module) or not rewrite.is_managed(model):
            return None
        return rewrite, model

    def export_model(self, **kwargs: Any) -> Any:
        original = self.original_steps["_export_model"]
        managed = self.managed(kwargs.get("flattened_module"))
        if managed is None:
            return original(**kwargs)
        rewrite, model = managed
        if kwargs.get("enable_zero_stage3_support"):
            raise Zero3ExportError(
                "ORTMODULE_ENABLE_ZERO_STAGE3=1 turns on ORT's own ZeRO-3 support, which conflicts with probes' "
                "ZeRO-3 hooks (probes.zero3.configure_ort_compatible_zero_stage3); unset it"
            )
        # A deep copy's parameters are bare partitions without DeepSpeed's bookkeeping.
        kwargs["deepcopy_before_model_export"] = False
        with rewrite.export_context(model):
            exported_model, *rest = original(**kwargs)
        rewrite.rewrite_exported(exported_model, kwargs["flattened_module"])
        return (exported_model, *rest)

    def post_export_process(self, **kwargs: Any) -> Any:
        info = self.original_steps["_post_export_process"](**kwargs)
        flattened_module = kwargs.get("flatten_module")
        managed = self.managed(flattened_module)
        if managed is None or kwargs.get("export_mode") != torch.onnx.TrainingMode.TRAINING:
            return info
        rewrite, _ = managed
        if getattr(info, "is_mem_efficient_grad_management_enabled", False):
            raise Zero3ExportError(
                "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT=1 pulls parameters from PyTorch by itself, which cannot "
                "work with ZeRO-3 partitioned parameters; unset it"
            )
        try:
            model = info._post_export_processed_model
            graph_inputs = list(info.onnx_graph_input_names)
            require_grad = list(info.onnx_graph_input_names_require_grad)
        except AttributeError as error:
            raise OrtInternalsError(f"ORT's PostExportProcessedModelInfo changed ({error})") from error
        removed = rewrite.drop_inputs(model, flattened_module, graph_inputs)
        if not removed:
            return info
        trigger, _, _ = pull_weight_trigger()
        info.onnx_graph_input_names = _replace_first(graph_inputs, removed, trigger)
        info.onnx_graph_input_names_require_grad = _replace_first(require_grad, removed, trigger)
        info.onnx_graph_input_names_user_defined = [*info.onnx_graph_input_names_user_defined, trigger]
        info.onnx_graph_input_names_require_grad_user_defined = [
            *info.onnx_graph_input_names_require_grad_user_defined, trigger]
        # Makes ORT feed the trigger (a fresh (1,) zeros tensor requiring grad) on every run.
        info.is_mem_efficient_grad_management_enabled = True
        return info


_PATCHES = _OrtPatches()


def _replace_first(names: list[str], removed: list[str], replacement: str) -> list[str]:
    """``names`` without ``removed``; ``replacement`` where the first removed name was."""
    gone = set(removed)
    positions = [i for i, name in enumerate(names) if name in gone]
    kept = [name for name in names if name not in gone]
    if positions:
        kept.insert(positions[0], replacement)
    return kept
