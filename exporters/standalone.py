"""Standalone ONNX export of a probed model: one ``com.microsoft::PythonOp`` per probe call.

    import exporters
    model_proto = exporters.export_onnx(model, (tokens,), "model.onnx", opset=17, training=True)

The graph is ORT-ready: each PythonOp has the Python context as its first output, as ORT's kernel
produces it, is named ``<Function>_<index>`` and, for identity probes, carries ORT's buffer reuse
maps; the probe's site is in its ``comment`` attribute. ``exporters.inference_session`` runs it.
The probes' pointer arguments are ``id()``s of live objects: the file runs in ORT only inside the
process that exported it (see docs/exporters.md). During the export the probes report nothing and
the step counter does not move (the probe Functions skip their work while torch exports).
"""

from __future__ import annotations

import io
import os
from typing import Any, Mapping, Sequence

import torch

from .adapters import ort_internals

from .adapters import torch_internals as compat
from .pythonop import PYTHON_OP, reuse_map_attributes
from .registry import registered_specs
from .symbolic import python_op_symbolic

_DOMAIN, _OP_TYPE = PYTHON_OP.split("::")


def export_onnx(model: torch.nn.Module, args: Any, path: str | os.PathLike | None = None, *, opset: int = 17,
                training: bool = True, input_names: Sequence[str] | None = None,
                output_names: Sequence[str] | None = None,
                dynamic_axes: Mapping[str, Any] | None = None, check: bool = True) -> Any:
    """Export ``model(*args)`` with torch's TorchScript exporter; returns the ``onnx.ModelProto``.

    ``training=True`` exports the training graph (dropout kept, no constant folding, PythonOps in
    training mode). The model is checked with ``onnx.checker`` and written to ``path`` if given.
    """
    import onnx

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"export_onnx needs a torch.nn.Module, got {type(model).__qualname__}")
    if ort_internals.is_ortmodule(model):
        raise TypeError("export_onnx exports the PyTorch module; pass the module an ORTModule wraps, not the ORTModule")
    buffer = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    with python_op_symbolic(opset):
        compat.onnx_export(
            model,
            args if isinstance(args, tuple) else (args,),
            buffer,
            opset_version=opset,
            training=mode,
            do_constant_folding=not training,
            input_names=list(input_names) if input_names else None,
            output_names=list(output_names) if output_names else None,
            dynamic_axes=dict(dynamic_axes) if dynamic_axes else None,
        )
    model_proto = onnx.load_model_from_string(buffer.getvalue())
    _finish_python_ops(model_proto)
    if check:
        onnx.checker.check_model(model_proto)
    if path is not None:
        onnx.save(model_proto, os.fspath(path))
    return model_proto


def _finish_python_ops(model_proto: Any) -> None:
    """Make the PythonOps what ORT's kernel runs: a leading context output (ORTModule adds it the same
    way) and, for identity probes, the buffer reuse maps ORTModule would derive from ``alias_input``."""
    import onnx

    identities = {spec.name for spec in registered_specs() if spec.identity}
    for index, node in enumerate(model_proto.graph.node):
        if node.domain != _DOMAIN or node.op_type != _OP_TYPE:
            continue
        outputs = list(node.output)
        del node.output[:]
        node.output.extend([f"{outputs[0]}_ctx", *outputs])
        attributes = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
        func_name = attributes["func_name"].decode()
        node.name = f"{func_name.rsplit('.', 1)[-1]}_{index}"
        if func_name in identities:
            training = attributes.get("training_mode") == 1
            for name, values in reuse_map_attributes(attributes["input_convention"].decode(), training).items():
                node.attribute.append(onnx.helper.make_attribute(name, values))
