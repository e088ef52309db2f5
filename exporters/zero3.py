"""ORTModule export of DeepSpeed ZeRO-3 models whose parameter hooks are probe Functions: the graph rewrite.

    from exporters import zero3
    zero3.install(spec)      # once ORTModule is imported; probes.zero3 calls it

ORTModule exports the model once and then runs the exported graph. Under ZeRO-3 the graph's
parameter inputs are the empty ``(0,)`` partitions; only the pre-forward PythonOp (``spec.pre_forward_name``)
sees the full-size parameters, as outputs. ``exporters/adapters/ort_internals.py`` wraps two of ORT's static export
steps and calls this module's rewrite in them, for models ``spec.is_managed`` accepts only:

1. After the export (``GraphTransitionManager._export_model``; ORT exports the model itself, not a deep
   copy, whose parameters are bare partitions without DeepSpeed's bookkeeping, inside
   ``spec.export_context``): every consumer of a partitioned parameter's graph input is rewired to the
   full-size output of the pre-forward PythonOp of the module owning it (before ORT infers shapes,
   which the empty partitions would make inconsistent).
2. After ORT's own processing (``GraphTransitionManager._post_export_process``): the partitioned
   inputs leave the graph (ORT then neither feeds them nor returns gradients for them) and the
   pre-forward PythonOps read ORT's one-element "pull weight trigger" input instead, which requires
   a gradient so that ORT builds the backward through them. The gradients of the full-size outputs
   reach the parameters in that PythonOp's backward.

Hooking into those steps is ORT-internal (``ort_internals.install_export_rewrite``); this module only
rewrites ONNX graphs (protobuf, ORT's PythonOp attribute schema). Anything in ORT that differs from what
this expects raises ``ort_internals.OrtInternalsError``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch

from .adapters import ort_internals, torch_internals
from .adapters.ort_internals import Zero3ExportError

PYTHON_OP = "PythonOp"
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Zero3ExportSpec:
    """What the rewrite needs to know about the ZeRO-3 hooks (given by probes.zero3)."""

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


def install(spec: Zero3ExportSpec) -> None:
    """Make ORTModule export the models ``spec.is_managed`` accepts with this rewrite (idempotent; the latest
    spec wins). Needs ORTModule imported."""
    # ORT's shape inference would give the full-size outputs the shape of the first input.
    ort_internals.register_pythonop_runtime(spec.pre_forward_name, spec.pre_forward,
                                          functools.partial(_infer_pre_forward_shapes, spec),
                                          functools.partial(_pre_forward_alias_input, spec))
    ort_internals.install_export_rewrite(ort_internals.ExportRewrite(
        is_managed=spec.is_managed,
        export_context=spec.export_context,
        rewrite_exported=functools.partial(_rewire_exported, spec),
        drop_inputs=functools.partial(_drop_partitioned_inputs, spec),
    ))


def _partitioned_inputs(spec: Zero3ExportSpec, module: torch.nn.Module, graph_inputs: Iterable[str]
                        ) -> dict[str, torch.Tensor]:
    """The module's partitioned parameters that are graph inputs, by name, in the module's order."""
    names = set(graph_inputs)
    return {name: param for name, param in module.named_parameters() if name in names and spec.is_partitioned(param)}


def _rewire_exported(spec: Zero3ExportSpec, exported_model: Any, module: torch.nn.Module) -> None:
    partitioned = _partitioned_inputs(spec, module, (graph_input.name for graph_input in exported_model.graph.input))
    if partitioned:
        rewire_consumers(exported_model, spec, partitioned)


def _drop_partitioned_inputs(spec: Zero3ExportSpec, model: Any, module: torch.nn.Module,
                             graph_inputs: Sequence[str]) -> list[str]:
    return replace_partitioned_inputs(model, spec, list(_partitioned_inputs(spec, module, graph_inputs)))


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


def _pointer_argument(node: Any, position: int) -> Any:
    import ctypes

    positions = list(_attribute(node, "input_pointer_scalar_positions") or [])
    pointers = _attribute(node, "input_pointer_scalars") or []
    if position not in positions:
        raise ort_internals.OrtInternalsError(f"PythonOp {node.name} has no pointer argument at position {position}")
    # The exporter keeps the object alive for the life of the process (so the id stays valid).
    return ctypes.cast(pointers[positions.index(position)], ctypes.py_object).value


def _infer_pre_forward_shapes(spec: Zero3ExportSpec, node: Any, input_shapes: list, input_dtypes: list
                              ) -> tuple[list, list]:
    """Module inputs keep their shapes; the parameter outputs get their full shapes and dtypes."""
    count = _input_count(node, spec.input_count_position)
    params = spec.params_of(_pointer_argument(node, spec.binding_position))
    shapes = [*input_shapes[:count], *(list(spec.full_shape(param)) for param in params)]
    dtypes = [*input_dtypes[:count], *(torch_internals.onnx_element_type(param.dtype) for param in params)]
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
        raise ort_internals.OrtInternalsError(f"PythonOp {node.name} has no int argument at position {position}")
    return int(scalars[list(positions).index(position)])


def _retype_inputs(node: Any, index_types: dict[int, tuple[int, int]]) -> None:
    """Set ``input_tensor_ranks``/``input_tensor_types`` of a PythonOp's tensor inputs {index: (rank, type)}."""
    ranks = list(_attribute(node, "input_tensor_ranks") or [])
    types = list(_attribute(node, "input_tensor_types") or [])
    if len(ranks) != len(node.input) or len(types) != len(node.input):
        raise ort_internals.OrtInternalsError(f"PythonOp {node.name}: input_tensor_ranks/types do not match its inputs")
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
            raise ort_internals.OrtInternalsError(f"PythonOp {node.name}: expected one output per input before ORT's processing")
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
                retype[index] = (len(spec.full_shape(param)), torch_internals.onnx_element_type(param.dtype))
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
    trigger, trigger_type, trigger_shape = ort_internals.pull_weight_trigger()
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
