"""The one adapter between probes' ZeRO-3 hooks and ORTModule's export pipeline (onnxruntime-training 1.19).

    from probes import _ort_zero3
    _ort_zero3.install(spec)      # once ORTModule is imported; probes.zero3 calls it

ORTModule exports the model once and then runs the exported graph. Under ZeRO-3 the graph's
parameter inputs are the empty ``(0,)`` partitions; only the pre-forward PythonOp (``spec.pre_forward_name``)
sees the full-size parameters, as outputs. Two of ORT's static export steps are wrapped, for models
``spec.is_managed`` accepts only:

1. ``GraphTransitionManager._export_model``: exports the model itself, not a deep copy (a copy's
   parameters are bare partitions without DeepSpeed's bookkeeping), inside ``spec.export_context``;
   then every consumer of a partitioned parameter's graph input is rewired to the full-size output
   of the pre-forward PythonOp of the module owning it (before ORT infers shapes, which the empty
   partitions would make inconsistent).
2. ``GraphTransitionManager._post_export_process``: after ORT's own processing, the partitioned
   inputs leave the graph (ORT then neither feeds them nor returns gradients for them) and the
   pre-forward PythonOps read ORT's one-element "pull weight trigger" input instead, which requires
   a gradient so that ORT builds the backward through them. The gradients of the full-size outputs
   reach the parameters in that PythonOp's backward.

Anything in ORT that differs from what this expects raises ``_ort_compat.OrtInternalsError``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch

from . import _ort_compat, _torch_compat

_GTM_MODULE = "onnxruntime.training.ortmodule._graph_transition_manager"
_TRIGGER_MODULE = "onnxruntime.training.ortmodule._mem_efficient_grad_mgmt"
_WRAPPED = ("_export_model", "_post_export_process")
PYTHON_OP = "PythonOp"
MS_DOMAIN = "com.microsoft"


class Zero3ExportError(RuntimeError):
    """A ZeRO-3 model cannot be exported for ORTModule as it is configured."""


@dataclass(frozen=True)
class Zero3ExportSpec:
    """What the adapter needs to know about the ZeRO-3 hooks (given by probes.zero3)."""

    is_managed: Callable[[torch.nn.Module], bool]  # the model's ZeRO-3 hooks are probes'
    is_partitioned: Callable[[torch.Tensor], bool]
    full_shape: Callable[[torch.Tensor], Sequence[int]]
    pre_forward: type  # the gathering autograd Function (its PythonOp's func_name is its qualified name)
    binding_position: int  # its apply() argument (passed by pointer) from which ``params_of`` finds the parameters
    input_count_position: int  # its apply() argument holding the number of module inputs before the placeholders
    params_of: Callable[[Any], Sequence[torch.Tensor]]  # binding -> the parameters output full-size, in order
    export_context: Callable[[torch.nn.Module], ContextManager[Any]]

    @property
    def pre_forward_name(self) -> str:
        return f"{self.pre_forward.__module__}.{self.pre_forward.__qualname__}"


_state: dict[str, Any] = {"spec": None, "originals": {}}


def _gtm_class() -> type:
    import importlib

    module = importlib.import_module(_GTM_MODULE)
    cls = getattr(module, "GraphTransitionManager", None)
    if cls is None or not all(isinstance(cls.__dict__.get(name), staticmethod) for name in _WRAPPED):
        raise _ort_compat.OrtInternalsError(
            f"{_GTM_MODULE}.GraphTransitionManager no longer has the static methods {_WRAPPED}; "
            "probes cannot run ZeRO-3 models under this ORTModule (see probes/_ort_zero3.py)"
        )
    return cls


def _trigger_spec() -> tuple[str, int, list[int]]:
    """ORT's memory-efficient "pull weight trigger" input: name, ONNX element type, shape."""
    import importlib

    module = importlib.import_module(_TRIGGER_MODULE)
    try:
        return (module.MEM_EFFICIENT_PARAM_TRIGGER_INPUT_NAME, int(module.MEM_EFFICIENT_PARAM_TRIGGER_OUTPUT_DTYPE),
                list(module.MEM_EFFICIENT_PARAM_TRIGGER_OUTPUT_SHAPE))
    except AttributeError as error:
        raise _ort_compat.OrtInternalsError(
            f"{_TRIGGER_MODULE} changed ({error}); probes/_ort_zero3.py must be updated") from error


def install(spec: Zero3ExportSpec) -> None:
    """Wrap ORTModule's export steps for ZeRO-3 models (idempotent; the latest spec wins)."""
    version = _ort_compat.ort_version()
    if version is not None and not (_ort_compat.SUPPORTED_ORT[0] <= version < _ort_compat.SUPPORTED_ORT[1]):
        raise _ort_compat.OrtInternalsError(
            f"onnxruntime {version[0]}.{version[1]} is not supported for ZeRO-3 under ORTModule "
            "(probes/_ort_zero3.py was written for 1.19)"
        )
    cls = _gtm_class()
    _trigger_spec()
    _state["spec"] = spec
    # ORT's shape inference would give the full-size outputs the shape of the first input.
    _ort_compat.register_pythonop_runtime(spec.pre_forward_name, spec.pre_forward,
                                   functools.partial(_infer_pre_forward_shapes, spec),
                                   functools.partial(_pre_forward_alias_input, spec))
    if _state["originals"]:
        return
    for name in _WRAPPED:
        _state["originals"][name] = cls.__dict__[name].__func__
    cls._export_model = staticmethod(functools.wraps(_state["originals"]["_export_model"])(_export_model))
    cls._post_export_process = staticmethod(
        functools.wraps(_state["originals"]["_post_export_process"])(_post_export_process))


def uninstall() -> None:
    """Put ORT's export steps back."""
    originals = _state["originals"]
    if originals:
        cls = _gtm_class()
        for name, function in originals.items():
            setattr(cls, name, staticmethod(function))
        originals.clear()
    _state["spec"] = None


def is_installed() -> bool:
    return bool(_state["originals"])


def _managed(flattened_module: Any) -> tuple[Zero3ExportSpec, torch.nn.Module] | None:
    spec: Zero3ExportSpec | None = _state["spec"]
    model = getattr(flattened_module, "_original_module", None)
    if spec is None or not isinstance(model, torch.nn.Module) or not spec.is_managed(model):
        return None
    return spec, model


def _export_model(**kwargs: Any) -> Any:
    managed = _managed(kwargs.get("flattened_module"))
    if managed is None:
        return _state["originals"]["_export_model"](**kwargs)
    spec, model = managed
    if kwargs.get("enable_zero_stage3_support"):
        raise Zero3ExportError(
            "ORTMODULE_ENABLE_ZERO_STAGE3=1 turns on ORT's own ZeRO-3 support, which conflicts with probes' "
            "ZeRO-3 hooks (probes.zero3.configure_ort_compatible_zero_stage3); unset it"
        )
    kwargs["deepcopy_before_model_export"] = False
    with spec.export_context(model):
        exported_model, *rest = _state["originals"]["_export_model"](**kwargs)
    flattened_module = kwargs["flattened_module"]
    graph_inputs = {graph_input.name for graph_input in exported_model.graph.input}
    partitioned = {name: param for name, param in flattened_module.named_parameters()
                   if name in graph_inputs and spec.is_partitioned(param)}
    if partitioned:
        rewire_consumers(exported_model, spec, partitioned)
    return (exported_model, *rest)


def _post_export_process(**kwargs: Any) -> Any:
    info = _state["originals"]["_post_export_process"](**kwargs)
    flattened_module = kwargs.get("flatten_module")
    managed = _managed(flattened_module)
    if managed is None or kwargs.get("export_mode") != torch.onnx.TrainingMode.TRAINING:
        return info
    spec, _ = managed
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
        raise _ort_compat.OrtInternalsError(f"ORT's PostExportProcessedModelInfo changed ({error})") from error
    partitioned = [name for name, param in flattened_module.named_parameters()
                   if name in graph_inputs and spec.is_partitioned(param)]
    removed = replace_partitioned_inputs(model, spec, partitioned)
    if not removed:
        return info
    trigger, _, _ = _trigger_spec()
    info.onnx_graph_input_names = _replace_first(graph_inputs, removed, trigger)
    info.onnx_graph_input_names_require_grad = _replace_first(require_grad, removed, trigger)
    info.onnx_graph_input_names_user_defined = [*info.onnx_graph_input_names_user_defined, trigger]
    info.onnx_graph_input_names_require_grad_user_defined = [*info.onnx_graph_input_names_require_grad_user_defined,
                                                             trigger]
    # Makes ORT feed the trigger (a fresh (1,) zeros tensor requiring grad) on every run.
    info.is_mem_efficient_grad_management_enabled = True
    return info


def _replace_first(names: list[str], removed: list[str], replacement: str) -> list[str]:
    """``names`` without ``removed``; ``replacement`` where the first removed name was."""
    gone = set(removed)
    positions = [i for i, name in enumerate(names) if name in gone]
    kept = [name for name in names if name not in gone]
    if positions:
        kept.insert(positions[0], replacement)
    return kept


# The graph rewrite (ORT's PythonOp attribute schema; no ORT call) ------------------------------------

def _attribute(node: Any, name: str) -> Any:
    import onnx

    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return None


def _set_ints(node: Any, name: str, values: list[int]) -> None:
    import onnx

    for attr in list(node.attribute):
        if attr.name == name:
            node.attribute.remove(attr)
    node.attribute.append(onnx.helper.make_attribute(name, values))


def _func_name(node: Any) -> str | None:
    value = _attribute(node, "func_name")
    return value.decode() if isinstance(value, bytes) else value


def _onnx_type(dtype: torch.dtype) -> int:
    return _torch_compat.onnx_element_type(dtype)


def _pointer_argument(node: Any, position: int) -> Any:
    import ctypes

    positions = list(_attribute(node, "input_pointer_scalar_positions") or [])
    pointers = _attribute(node, "input_pointer_scalars") or []
    if position not in positions:
        raise _ort_compat.OrtInternalsError(f"PythonOp {node.name} has no pointer argument at position {position}")
    # The exporter keeps the object alive for the life of the process (so the id stays valid).
    return ctypes.cast(pointers[positions.index(position)], ctypes.py_object).value


def _infer_pre_forward_shapes(spec: Zero3ExportSpec, node: Any, input_shapes: list, input_dtypes: list
                              ) -> tuple[list, list]:
    """Module inputs keep their shapes; the parameter outputs get their full shapes and dtypes."""
    count = _input_count(node, spec.input_count_position)
    params = spec.params_of(_pointer_argument(node, spec.binding_position))
    shapes = [*input_shapes[:count], *(list(spec.full_shape(param)) for param in params)]
    dtypes = [*input_dtypes[:count], *(_onnx_type(param.dtype) for param in params)]
    return shapes, dtypes


def _pre_forward_alias_input(spec: Zero3ExportSpec, node_proto: bytes) -> tuple[list[int], list[int]]:
    """ORT's alias maps: a single module input is returned in its own buffer.

    With several inputs no alias is declared: ORT fails on its first run when two of them share a
    buffer (a module called as ``f(x, x)``), which cannot be ruled out at export; it copies instead.
    No backward alias either: the gradient of an input that needs none is None, not the incoming one.
    """
    import onnx

    node = onnx.NodeProto()
    node.ParseFromString(node_proto)
    cconv = _attribute(node, "input_convention")
    cconv = cconv.decode() if isinstance(cconv, bytes) else cconv
    tensor_positions = [position for position, kind in enumerate(cconv) if kind == "d"]
    forward = [-1] * len(tensor_positions)
    backward = [-1] * len(cconv)
    if _input_count(node, spec.input_count_position) == 1:
        forward[0] = tensor_positions[0]
    return forward, backward


def _input_count(node: Any, position: int) -> int:
    positions = _attribute(node, "input_int_scalar_positions") or []
    scalars = _attribute(node, "input_int_scalars") or []
    if position not in positions:
        raise _ort_compat.OrtInternalsError(f"PythonOp {node.name} has no int argument at position {position}")
    return int(scalars[list(positions).index(position)])


def _retype_inputs(node: Any, index_types: dict[int, tuple[int, int]]) -> None:
    """Set ``input_tensor_ranks``/``input_tensor_types`` of a PythonOp's tensor inputs {index: (rank, type)}."""
    ranks = list(_attribute(node, "input_tensor_ranks") or [])
    types = list(_attribute(node, "input_tensor_types") or [])
    if len(ranks) != len(node.input) or len(types) != len(node.input):
        raise _ort_compat.OrtInternalsError(f"PythonOp {node.name}: input_tensor_ranks/types do not match its inputs")
    for index, (rank, elem_type) in index_types.items():
        ranks[index], types[index] = rank, elem_type
    _set_ints(node, "input_tensor_ranks", ranks)
    _set_ints(node, "input_tensor_types", types)


def _is_pre_forward(node: Any, spec: Zero3ExportSpec) -> bool:
    return node.op_type == PYTHON_OP and node.domain == MS_DOMAIN and _func_name(node) == spec.pre_forward_name


def _pre_forward_nodes(graph: Any, spec: Zero3ExportSpec) -> list[Any]:
    return [node for node in graph.node if _is_pre_forward(node, spec)]


def _placeholder_slots(node: Any, spec: Zero3ExportSpec) -> range:
    return range(_input_count(node, spec.input_count_position), len(node.input))


def full_output_name(param_name: str) -> str:
    return f"{param_name}.probes_full"


def rewire_consumers(model: Any, spec: Zero3ExportSpec, partitioned: dict[str, torch.Tensor]) -> None:
    """Make every consumer of a partitioned parameter read its full-size pre-forward output instead.

    ``model`` is the graph as exported (PythonOps without ORT's ctx output): the pre-forward PythonOp's
    output i passes its input i, so the output in a placeholder's slot is that parameter, full size.
    """
    graph = model.graph
    full_output: dict[str, str] = {}
    placeholder_slots: set[tuple[int, int]] = set()  # (node position, input index); protobuf nodes have no stable id()
    for position, node in enumerate(graph.node):
        if not _is_pre_forward(node, spec):
            continue
        if len(node.output) != len(node.input):
            raise _ort_compat.OrtInternalsError(f"PythonOp {node.name}: expected one output per input before ORT's processing")
        for index in _placeholder_slots(node, spec):
            name = node.input[index]
            placeholder_slots.add((position, index))
            if name in partitioned and name not in full_output:
                node.output[index] = full_output[name] = full_output_name(name)
    missing = sorted(set(partitioned) - set(full_output))
    if missing:
        raise Zero3ExportError(
            f"partitioned parameters {missing} are graph inputs but no ZeRO-3 pre-forward probe gathers them "
            "(is the model's forward using a parameter of a module that is not called?)"
        )
    for position, node in enumerate(graph.node):
        retype = {}
        for index, name in enumerate(node.input):
            if name in full_output and (position, index) not in placeholder_slots:
                node.input[index] = full_output[name]
                param = partitioned[name]
                retype[index] = (len(spec.full_shape(param)), _onnx_type(param.dtype))
        if retype and node.op_type == PYTHON_OP:
            _retype_inputs(node, retype)
    # Types inferred at export from the empty partitions; ORT infers them again.
    del graph.value_info[:]


def replace_partitioned_inputs(model: Any, spec: Zero3ExportSpec, partitioned: Sequence[str]) -> list[str]:
    """Feed the pre-forward PythonOps ORT's trigger input instead of the partitioned graph inputs.

    Returns the graph inputs removed, in graph order.
    """
    import onnx

    graph = model.graph
    names = set(partitioned)
    trigger, trigger_type, trigger_shape = _trigger_spec()
    for node in _pre_forward_nodes(graph, spec):
        retype = {}
        for index in _placeholder_slots(node, spec):
            if node.input[index] in names:
                node.input[index] = trigger
                retype[index] = (len(trigger_shape), trigger_type)
        if retype:
            _retype_inputs(node, retype)
    still_used = sorted({name for node in graph.node for name in node.input if name in names})
    if still_used:
        raise Zero3ExportError(f"partitioned parameters {still_used} are still read by the graph after rewiring")
    removed = [graph_input.name for graph_input in graph.input if graph_input.name in names]
    if not removed:
        return []
    first = next(i for i, graph_input in enumerate(graph.input) if graph_input.name in names)
    for graph_input in [gi for gi in graph.input if gi.name in names]:
        graph.input.remove(graph_input)
    graph.input.insert(first, onnx.helper.make_tensor_value_info(trigger, trigger_type, trigger_shape))
    return removed
