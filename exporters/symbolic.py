"""The scoped ``prim::PythonOp`` symbolic: our probes -> our PythonOp, other Functions -> what was there.

    with python_op_symbolic(opset=17):
        torch.onnx.export(model, args, f, opset_version=17, dynamo=False, ...)

torch's TorchScript exporter calls the ``prim::PythonOp`` symbolic for every autograd Function
without a ``symbolic`` staticmethod. Inside the block, a Function registered with
``register_probe_function`` is exported by exporters/pythonop.py; any other Function goes to the
symbolic that was active before (ORTModule's handler when ORT is imported), or fails with an error
naming it. Leaving the block restores the registry as it was.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

from .adapters import torch_internals as compat
from .pythonop import PythonOpExportError, emit_probe
from .registry import qualified_name, spec_for

PYTHON_OP_SYMBOLIC = "prim::PythonOp"


def _dispatch(previous: compat.Symbolic | None, g: Any, *args: Any, **kwargs: Any) -> Any:
    node = g.original_node
    function = compat.python_op_class(node)
    spec = spec_for(function)
    if spec is not None:
        return emit_probe(g, node, spec, args)
    if previous is None:
        raise PythonOpExportError(
            f"cannot export the autograd Function {qualified_name(function)}: it has no `symbolic` staticmethod, "
            "it is not a probe (exporters.register_probe_function) and no other prim::PythonOp exporter is "
            "registered (importing onnxruntime.training.ortmodule registers ORT's)"
        )
    return previous(g, *args, **kwargs)


@contextlib.contextmanager
def python_op_symbolic(opset: int) -> Iterator[None]:
    """Install the dispatching ``prim::PythonOp`` symbolic for exports at ``opset``, for the block only."""
    previous = compat.active_symbolic(PYTHON_OP_SYMBOLIC, opset)
    with compat.override_symbolic(PYTHON_OP_SYMBOLIC, opset, functools.partial(_dispatch, previous)):
        yield
