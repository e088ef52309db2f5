"""One traced probe call -> one ``com.microsoft::PythonOp`` node with the attributes ORT's kernel reads.

    outputs = emit_python_op(g, node, spec, args)     # inside a prim::PythonOp symbolic

The attribute schema is the one of ORT 1.19's PythonOp kernel (``orttraining`` PythonOpBase):

- ``func_name``: the Function's qualified class name; ORT looks the class up by it at run time.
- ``input_convention``: one char per ``apply`` argument, ``d`` for a tensor input, ``c`` for a constant.
- ``input_tensor_types`` / ``input_tensor_ranks``, ``output_tensor_types`` / ``output_tensor_ranks``:
  ONNX element types and ranks of the tensor inputs and outputs.
- Non-tensor arguments by kind, each with its positions in ``apply``'s argument list: bools and ints
  as ``input_{bool,int}_scalars``, floats as ``input_float_scalars``, non-empty tuples of one of those
  as ``input_*_tuples`` (+ ``_begins``), anything else by pointer (``input_pointer_scalars``: the
  object's ``id()``; a reference is held for the life of the process, so the id stays valid).
- ``training_mode``: 1 when exporting for training. ``comment``: the probe's site name.

Scalars and tuples are frozen into the graph at export. Pointers are live: the run sees the
object's state at run time, but always the same object.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from .adapters import torch_internals as compat
from .registry import ProbeFunctionSpec

PYTHON_OP = "com.microsoft::PythonOp"
_INT64 = (-(2**63), 2**63 - 1)


class _PointerArguments:
    """The objects exported graphs hold by pointer (``id()``), kept alive for the life of the process.

    Process-wide: an exported graph (a file, or ORTModule's cached graph) may run at any later time
    in this process and outlives every object of ours; its ids must stay valid, as ORT keeps its own.
    """

    def __init__(self) -> None:
        self._held: dict[int, Any] = {}

    def pointer(self, value: Any) -> int:
        """``id(value)``, with ``value`` kept alive so that the id stays valid."""
        self._held[id(value)] = value
        return id(value)


_POINTERS = _PointerArguments()


class PythonOpExportError(RuntimeError):
    """A traced autograd Function cannot be exported as PythonOp."""


def _describe_argument(position: int, value: Any) -> str:
    return f"argument {position} ({type(value).__qualname__})"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def _check_passable(spec: ProbeFunctionSpec, position: int, value: Any) -> None:
    # A tensor inside a non-tensor argument is not a graph input: the graph would keep the export-time
    # tensor forever and never see the values of later steps. That is a silent wrong result; refuse.
    if _holds_tensor(value):
        raise PythonOpExportError(
            f"probe {spec.name}: {_describe_argument(position, value)} holds a torch.Tensor inside a "
            "non-tensor argument; PythonOp would freeze it at its export-time value. Pass tensors as "
            "direct arguments of apply()."
        )
    values = value if isinstance(value, tuple) else (value,)
    for item in values:
        if isinstance(item, int) and not isinstance(item, bool) and not _INT64[0] <= item <= _INT64[1]:
            raise PythonOpExportError(
                f"probe {spec.name}: {_describe_argument(position, value)} holds the int {item}, which does "
                "not fit the int64 attributes PythonOp stores integers in"
            )


def _tensor_type(spec: ProbeFunctionSpec, what: str, value: torch._C.Value) -> tuple[int, int]:
    """(ONNX element type, rank) of a traced tensor value."""
    value_type = value.type()
    scalar = torch.onnx.JitScalarType.from_value(value, torch.onnx.JitScalarType.UNDEFINED)
    rank = value_type.dim() if isinstance(value_type, torch._C.TensorType) else None
    if scalar == torch.onnx.JitScalarType.UNDEFINED or rank is None:
        raise PythonOpExportError(
            f"probe {spec.name}: the {what} has no known element type and rank in the traced graph "
            f"(type {value_type}); PythonOp needs both"
        )
    return int(scalar.onnx_type()), rank


def _tuple_kind(value: Any) -> str | None:
    if not isinstance(value, tuple) or not value:
        return None
    if all(isinstance(v, bool) for v in value):
        return "bool"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return "int"
    if all(isinstance(v, float) for v in value):
        return "float"
    return None


def encode_arguments(spec: ProbeFunctionSpec, cconv: str, args: Sequence[Any]) -> tuple[list, dict[str, Any]]:
    """The tensor inputs and the input attributes (``g.op`` suffixed names) of one PythonOp."""
    if len(cconv) != len(args):
        raise PythonOpExportError(f"probe {spec.name}: calling convention {cconv!r} does not match {len(args)} arguments")
    tensors: list = []
    types: list[int] = []
    ranks: list[int] = []
    scalars: dict[str, tuple[list, list]] = {kind: ([], []) for kind in ("bool", "int", "float", "pointer")}
    tuples: dict[str, tuple[list, list, list]] = {kind: ([], [], []) for kind in ("bool", "int", "float")}
    for position, (convention, value) in enumerate(zip(cconv, args)):
        if convention == "d":
            element_type, rank = _tensor_type(spec, f"tensor argument {position}", value)
            tensors.append(value)
            types.append(element_type)
            ranks.append(rank)
            continue
        if convention != "c":
            raise PythonOpExportError(f"probe {spec.name}: unknown calling convention {convention!r} at {position}")
        _check_passable(spec, position, value)
        kind = _tuple_kind(value)
        if kind is not None:
            flat, positions, begins = tuples[kind]
            positions.append(position)
            begins.append(len(flat))
            flat.extend(int(v) if kind == "bool" else v for v in value)
            continue
        if isinstance(value, bool):
            kind, encoded = "bool", int(value)
        elif isinstance(value, int):
            kind, encoded = "int", value
        elif isinstance(value, float):
            kind, encoded = "float", value
        else:
            kind, encoded = "pointer", _POINTERS.pointer(value)
        values, positions = scalars[kind]
        values.append(encoded)
        positions.append(position)

    attributes: dict[str, Any] = {
        "input_convention_s": cconv,
        "input_tensor_types_i": types,
        "input_tensor_ranks_i": ranks,
    }
    for kind, (values, positions) in scalars.items():
        if values:
            attributes[f"input_{kind}_scalars_{'f' if kind == 'float' else 'i'}"] = values
            attributes[f"input_{kind}_scalar_positions_i"] = positions
    for kind, (flat, positions, begins) in tuples.items():
        if flat:
            attributes[f"input_{kind}_tuples_{'f' if kind == 'float' else 'i'}"] = flat
            attributes[f"input_{kind}_tuple_positions_i"] = positions
            attributes[f"input_{kind}_tuple_begins_i"] = begins
    return tensors, attributes


def emit_python_op(g: Any, node: torch._C.Node, spec: ProbeFunctionSpec, args: Sequence[Any]) -> Any:
    """Add the PythonOp for the traced ``node`` (a ``prim::PythonOp`` of ``spec.function``) to ``g``."""
    cconv = node.cconv()
    tensors, attributes = encode_arguments(spec, cconv, args)
    outputs = list(node.outputs())
    output_types = [_tensor_type(spec, f"output {i}", value) for i, value in enumerate(outputs)]
    if spec.identity and [t for t, _ in output_types] != attributes["input_tensor_types_i"]:
        raise PythonOpExportError(
            f"probe {spec.name} is registered as an identity, but its {len(outputs)} outputs do not match its "
            f"{len(tensors)} tensor inputs; register it with identity=False"
        )
    non_tensor_args = [value for convention, value in zip(cconv, args) if convention == "c"]
    result = g.op(
        PYTHON_OP,
        *tensors,
        outputs=len(outputs),
        func_name_s=spec.name,
        output_tensor_types_i=[t for t, _ in output_types],
        output_tensor_ranks_i=[r for _, r in output_types],
        training_mode_i=int(compat.export_training_mode()),
        comment_s=spec.describe(non_tensor_args),
        **attributes,
    )
    results = (result,) if len(outputs) == 1 else tuple(result)
    for traced, exported in zip(outputs, results):
        exported.setType(traced.type())  # keep the traced shapes: ONNX shape inference cannot see into PythonOp
    return result


class ProbeExportWarning(UserWarning):
    """A probe could not be exported; the exported graph passes its tensors through without it."""


def emit_probe(g: Any, node: torch._C.Node, spec: ProbeFunctionSpec, args: Sequence[Any]) -> Any:
    """``emit_python_op``, except that an identity probe that cannot become a PythonOp is left out of the
    graph (one ``ProbeExportWarning``) instead of failing the export: the model trains, that site unobserved."""
    try:
        return emit_python_op(g, node, spec, args)
    except PythonOpExportError as error:
        if not spec.identity:
            raise
        cconv = node.cconv()
        site = spec.describe([value for convention, value in zip(cconv, args) if convention == "c"]) or spec.name
        warnings.warn(f"{error}. The exported graph leaves this probe out: training goes on, and {site} is not "
                      "observed in the exported graph.", ProbeExportWarning, stacklevel=2)
        tensors = [value for convention, value in zip(cconv, args) if convention == "d"]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)


# ORT schema supplements for identity probes ---------------------------------------------------------


def identity_infer_shape(node: Any, input_shapes: list, input_dtypes: list) -> tuple[list, list]:
    """ORT shape inference of an identity probe: output i has the shape and type of tensor input i."""
    return list(input_shapes), list(input_dtypes)


def identity_alias_maps(cconv: str, training: bool = False) -> tuple[list[int], list[int]]:
    """The alias maps of an identity probe with calling convention ``cconv`` (ORT's ``alias_input`` format).

    Forward map: one entry per output (the context output excluded), the position in ``apply``'s
    argument list of the input it returns. Backward map: one entry per ``apply`` argument, the
    index of the incoming gradient it returns (-1 for non-tensor arguments, which get None).

    ORT checks a declared map once, on a PythonOp's first run, by matching data addresses: an output
    declared as reusing input i must have input i's address, and no other input's. It fails ("Fatal:
    ... detected inplace_map indicates it is reusing input index ...") when two inputs of one call share
    an address; an output that aliases an input without being declared is copied on every run. So:

    - forward, ``training`` graph: every output is declared. ORT runs a training PythonOp's first
      forward on a fresh copy of each tensor input, so no two share an address, even for a module
      returning ``(h, h)``; later runs take ORT's buffers directly, as declared.
    - forward, inference graph (``training`` False): ORT passes its own buffers to the first run as
      well, which may be one buffer twice; only a probe of one tensor declares its alias.
    - backward: only a probe of one tensor declares its alias. The check runs on ORT's own gradient
      buffers (two gradients of one call may be one buffer), and a gradient that arrives None is
      returned as fresh zeros (``probes.core.functions.grads_for_inputs``), not as an alias. A probe of
      several tensors therefore pays ORT's copy of each gradient it returns.
    """
    tensor_positions = [position for position, convention in enumerate(cconv) if convention == "d"]
    backward = [-1] * len(cconv)
    if len(tensor_positions) == 1:
        backward[tensor_positions[0]] = 0
    elif not training:
        return [-1] * len(tensor_positions), backward
    return tensor_positions, backward


def identity_alias_input(node_proto: bytes) -> tuple[list[int], list[int]]:
    """ORT's ``alias_input`` of an identity probe: its alias maps, from the node's ``input_convention``
    and ``training_mode``."""
    import onnx

    parsed = onnx.NodeProto()
    parsed.ParseFromString(node_proto)
    attributes = {attr.name: attr for attr in parsed.attribute}
    training = "training_mode" in attributes and attributes["training_mode"].i == 1
    return identity_alias_maps(attributes["input_convention"].s.decode(), training)


def reuse_map_attributes(cconv: str, training: bool = False) -> dict[str, list[int]]:
    """``tensor_reuse_map`` and ``bw_tensor_reuse_map`` of an identity probe node.

    ORTModule's graph builder derives these node attributes from the registered ``alias_input``
    (ORT's PythonOpRewriter); a plain InferenceSession does not run that rewriter, so a standalone
    export writes them itself. Forward: per node output, the context first (never an alias), the
    tensor input index it reuses. Backward: per tensor input, the PythonOpGrad input (the context is
    input 0) whose buffer its gradient reuses.
    """
    forward, backward = identity_alias_maps(cconv, training)
    tensor_index = {position: index for index, position in enumerate(p for p, c in enumerate(cconv) if c == "d")}
    tensor_reuse = [-1] + [tensor_index[position] if position != -1 else -1 for position in forward]
    bw_reuse = [backward[p] + 1 if backward[p] != -1 else -1 for p, c in enumerate(cconv) if c == "d"]
    return {"tensor_reuse_map": tensor_reuse, "bw_tensor_reuse_map": bw_reuse}
