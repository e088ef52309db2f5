"""Export embeddings whose weight DeepSpeed ZeRO-3 partitioned away (an empty ``(0,)`` tensor).

    with exporters.partitioned_embedding_export():
        exporters.export_onnx(model, (tokens,), "model.onnx")      # or ORTModule's first forward

ZeRO-3 replaces a partitioned parameter's data by an empty ``(0,)`` tensor and keeps the full shape
in ``param.ds_shape``. Two things then break an export:

1. The eager runs around it (ORTModule's output-schema run, the trace itself) call
   ``nn.Embedding.forward``, which fails with "'weight' must be 2-D". Inside the block, an
   ``nn.Embedding`` whose weight is partitioned returns, during export runs only, zeros of the right
   shape from ``PartitionedEmbedding``, whose symbolic exports the real embedding op. Outside
   export runs (a training step) the original forward runs unchanged.
2. A traced ``aten::embedding`` on a ``(0,)`` weight gets its output typed from the empty weight
   (ORT 1.19.2's symbolic gives it rank 1). Inside the block our ``aten::embedding`` symbolic
   exports it as ORT's ``org.pytorch.aten::ATen`` embedding with the output typed
   ``indices.shape + (embedding_dim,)``, the dim taken from ``ds_shape`` (or the module) when known.

Embeddings with an ordinary 2-D weight go to the symbolic that was active before: their export is
unchanged. Leaving the block removes everything.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from .adapters import deepspeed_internals, ort_internals
from .handles import Handle

from .adapters import torch_internals as compat

ATEN_OP = "org.pytorch.aten::ATen"
EMBEDDING_SYMBOLIC = "aten::embedding"


def is_partitioned(weight: torch.Tensor) -> bool:
    """True for a weight ZeRO-3 has partitioned away: an empty 1-D tensor."""
    # The storage size, unlike numel(), is a plain int while torch traces (no TracerWarning).
    return weight.dim() == 1 and weight.untyped_storage().nbytes() == 0


def _embedding_dim(weight: Any, fallback: int | None = None) -> int | None:
    full_shape = deepspeed_internals.declared_full_shape(weight)
    return int(full_shape[-1]) if full_shape else fallback


def _const(g: Any, value: Any) -> Any:
    if isinstance(value, torch._C.Value):
        return value
    return g.op("Constant", value_t=torch.tensor(value))


def _emit_embedding(g: Any, weight: Any, indices: Any, padding_idx: Any, scale_grad_by_freq: Any, sparse: Any,
                    embedding_dim: int | None) -> Any:
    """ORT's ATen embedding, typed from the indices and the full embedding dim, never from the weight."""
    output = g.op(ATEN_OP, weight, indices, _const(g, padding_idx), _const(g, scale_grad_by_freq), _const(g, sparse),
                  operator_s="embedding")
    indices_type = indices.type()
    sizes = indices_type.varyingSizes() if isinstance(indices_type, torch._C.TensorType) else None
    if sizes is not None:
        output.setType(weight.type().with_sizes([*sizes, embedding_dim]))
    return output


class PartitionedEmbedding(torch.autograd.Function):
    """Export-time stand-in for an embedding on a partitioned weight: zeros of the output's shape.

    Its symbolic exports the real (ATen) embedding, so the graph computes the lookup at run time,
    when the full weight is there.
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, indices: torch.Tensor, embedding_dim: int, padding_idx: int,
                scale_grad_by_freq: bool, sparse: bool) -> torch.Tensor:
        return weight.new_zeros((*indices.shape, embedding_dim))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        return (None,) * 6

    @staticmethod
    def symbolic(g: Any, weight: Any, indices: Any, embedding_dim: int, padding_idx: int, scale_grad_by_freq: bool,
                 sparse: bool) -> Any:
        return _emit_embedding(g, weight, indices, padding_idx, scale_grad_by_freq, sparse, embedding_dim)


def _full_embedding_dim(full_shapes: dict[str, tuple[int, ...]], graph_name: str) -> int | None:
    # ORTModule exports a wrapper of the user's module, so graph names may carry a prefix.
    matches = [shape for name, shape in full_shapes.items() if graph_name == name or graph_name.endswith("." + name)]
    return int(matches[0][-1]) if len(matches) == 1 else None


def _embedding_symbolic(previous: compat.Symbolic | None, full_shapes: dict[str, tuple[int, ...]], g: Any,
                        weight: Any, indices: Any, padding_idx: Any, scale_grad_by_freq: Any, sparse: Any,
                        *rest: Any, **kwargs: Any) -> Any:
    weight_type = weight.type()
    rank = weight_type.dim() if isinstance(weight_type, torch._C.TensorType) else None
    if rank is None or rank == 2:
        if previous is None:
            raise RuntimeError(f"no symbolic is registered for {EMBEDDING_SYMBOLIC} at opset {compat.export_opset()}")
        return previous(g, weight, indices, padding_idx, scale_grad_by_freq, sparse, *rest, **kwargs)
    embedding_dim = _full_embedding_dim(full_shapes, weight.debugName())
    return _emit_embedding(g, weight, indices, padding_idx, scale_grad_by_freq, sparse, embedding_dim)


def _export_time_forward(original: Any, module: torch.nn.Embedding, indices: torch.Tensor) -> torch.Tensor:
    weight = module._parameters.get("weight")  # not module.weight: ZeRO-3's module dict would gather it
    if weight is None or not is_partitioned(weight) or not ort_internals.is_exporting():
        return original(module, indices)
    return PartitionedEmbedding.apply(weight, indices, _embedding_dim(weight, module.embedding_dim),
                                      -1 if module.padding_idx is None else module.padding_idx,
                                      module.scale_grad_by_freq, module.sparse)


@contextlib.contextmanager
def partitioned_embedding_export(model: torch.nn.Module | None = None, opsets: tuple[int, ...] = (17,)
                                 ) -> Iterator[None]:
    """Let exports inside the block handle ZeRO-3 partitioned embedding weights (see the module doc).

    ``model``: where to read the full shapes (``ds_shape``) of partitioned weights that reach the
    graph as a traced ``aten::embedding`` (the exporter only sees value names there); without it,
    such an output keeps its rank but gets a symbolic last dimension. ``opsets``: the export opsets to register the ``aten::embedding`` symbolic for (ORTModule's
    default and ``export_onnx``'s is 17). Under ORTModule, enter the block after constructing the
    ORTModule: ORT re-registers its own embedding symbolic when an ORTModule is constructed.
    """
    original_forward = torch.nn.Embedding.forward
    full_shapes = {name: shape for name, parameter in (model.named_parameters() if model else ())
                   if is_partitioned(parameter) and (shape := deepspeed_internals.declared_full_shape(parameter))}
    overrides = Handle.chain([
        compat.override_symbolic(
            EMBEDDING_SYMBOLIC, opset,
            functools.partial(_embedding_symbolic, compat.active_symbolic(EMBEDDING_SYMBOLIC, opset), full_shapes))
        for opset in opsets
    ])

    def forward(module: torch.nn.Embedding, indices: torch.Tensor) -> torch.Tensor:
        return _export_time_forward(original_forward, module, indices)

    torch.nn.Embedding.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Embedding.forward = original_forward  # type: ignore[method-assign]
        overrides.remove()
