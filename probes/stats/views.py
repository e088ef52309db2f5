"""What the statistics can read: dense real tensors as they are, other tensors through a view of what they hold.

    values, stats_of = statistics_view(torch.randn(3, dtype=torch.complex64))   # (3, 2) float32, "real_imag"
    check_readable(values)                     # TypeError for a tensor the kernel cannot read (meta, FakeTensor, ...)

``summarize`` reads memory, so it accepts only tensors with a plain strided buffer (``check_readable``);
``statistics_view`` turns sparse, nested, quantized, complex and DTensor tensors into such a tensor,
and raises ``UnsupportedTensor`` for tensors without readable data.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from exporters.adapters import torch_internals

__all__ = ["UnsupportedTensor", "check_readable", "dtype_name", "is_dense", "is_dispatch_subclass", "is_dtensor",
           "layout_name", "or_none", "shape_of", "statistics_view"]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


class UnsupportedTensor(TypeError):
    """Raised by ``statistics_view`` for a tensor without data the statistics can read."""


def is_dense(tensor: torch.Tensor) -> bool:
    """A plain strided tensor with data (not sparse, nested, quantized, meta or a subclass): what the
    kernel reads directly.

        is_dense(torch.randn(3))   # True
    """
    return (type(tensor) in _PLAIN_TYPES and tensor.layout is torch.strided
            and not (tensor.is_nested or tensor.is_quantized or tensor.is_meta))


def is_dispatch_subclass(tensor: torch.Tensor) -> bool:
    """True for __torch_dispatch__ subclasses (FakeTensor, DTensor, jagged nested, user wrappers).

        is_dispatch_subclass(torch.randn(3))   # False
    """
    return type(tensor) not in _PLAIN_TYPES and torch_internals.has_python_dispatch(tensor)


def check_readable(tensor: torch.Tensor) -> None:
    """Raises TypeError unless `tensor` is a dense tensor with memory the statistics can read.

        check_readable(torch.empty(2, device="meta"))   # TypeError: ... got a meta tensor (no data)

    The kernel reads raw memory: a tensor without a plain strided buffer (sparse, nested, quantized,
    meta, a __torch_dispatch__ subclass such as FakeTensor or DTensor) would be read as garbage or
    crash the process. statistics_view turns most of them into one that is readable.
    """
    if is_dense(tensor):
        return
    if tensor.layout is not torch.strided or tensor.is_nested:
        kind = "a nested tensor" if tensor.is_nested else f"a {layout_name(tensor)} tensor"
    elif tensor.is_quantized:
        kind = "a quantized tensor"
    elif tensor.is_meta:
        kind = "a meta tensor (no data)"
    elif is_dispatch_subclass(tensor):
        kind = f"a {type(tensor).__qualname__} (a __torch_dispatch__ subclass)"
    else:
        return  # e.g. a __torch_function__-only subclass: a plain buffer underneath
    raise TypeError(f"summarize needs a dense tensor with data, got {kind}")


def _is_ordinary(tensor: torch.Tensor) -> bool:
    """A dense, real, readable tensor: summarised as it is (the common case, checked first)."""
    return is_dense(tensor) and not tensor.is_complex()


def is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a DTensor (FSDP2's parameters, tensor parallelism). Its module is loaded once one exists, so
    nothing is imported here."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # public from torch 2.5
        dtensor = getattr(sys.modules.get(name), "DTensor", None)
        if isinstance(dtensor, type) and isinstance(tensor, dtensor):
            return True
    return False


def layout_name(tensor: torch.Tensor) -> str:
    """The record's ``"layout"``: torch's layout name, or ``nested_strided`` / ``nested_jagged``.

        layout_name(torch.eye(2).to_sparse())   # "sparse_coo"
    """
    name = str(tensor.layout).removeprefix("torch.")
    return f"nested_{name}" if tensor.is_nested else name


def dtype_name(tensor: torch.Tensor) -> str:
    """The record's ``"dtype"``: ``"float32"``, ..."""
    return str(tensor.dtype).removeprefix("torch.")


def or_none(describe: Callable[[torch.Tensor], str], tensor: torch.Tensor) -> str | None:
    """``describe(tensor)``, or None when a broken subclass cannot say (keep what could be read)."""
    try:
        return describe(tensor)
    except Exception:
        return None


def shape_of(tensor: torch.Tensor) -> list[int | None] | None:
    """The shape as ints; a ragged (nested) or symbolic dimension is None; None when there is none.

        shape_of(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))   # [2, None]
    """
    try:
        dims = tensor.dim()
    except Exception:
        return None
    shape: list[int | None] = []
    for dim in range(dims):
        try:
            size = tensor.size(dim)
        except Exception:  # an irregular dimension of a strided nested tensor
            size = None
        shape.append(size if isinstance(size, int) else None)
    return shape


def _components(tensor: torch.Tensor) -> torch.Tensor:
    """All elements of a nested tensor's components, flattened and concatenated (a copy)."""
    parts = [part.reshape(-1) for part in tensor.unbind()]
    if not parts:
        return torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return torch.cat(parts)


def _container_view(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """(a strided tensor with data, what it is of) for sparse, nested, DTensor; raises UnsupportedTensor."""
    if is_dispatch_subclass(tensor):
        if is_dtensor(tensor):
            return tensor.to_local(), "local_shard"
        if tensor.is_nested:
            return _components(tensor), "components"
        if any(cls.__name__ == "FakeTensor" for cls in type(tensor).__mro__):
            raise UnsupportedTensor("FakeTensor: it has no data (made under a FakeTensorMode)")
        raise UnsupportedTensor(f"tensor subclass {type(tensor).__qualname__} (__torch_dispatch__): "
                                "its data is not a plain tensor the statistics can read")
    if tensor.is_meta:
        raise UnsupportedTensor("meta tensor: it has no data")
    # detach(): values() is a view of the sparse tensor, which no view op (view_as_real) can replay.
    if tensor.layout is torch.sparse_coo:
        # Statistics of the tensor's values: an uncoalesced copy is summed like the tensor (never in place).
        return tensor.coalesce().values().detach(), "values"
    if tensor.layout in _SPARSE_LAYOUTS:
        return tensor.values().detach(), "values"
    if tensor.is_nested:
        return _components(tensor), "components"
    if tensor.layout is not torch.strided:
        raise UnsupportedTensor(f"layout {layout_name(tensor)}: not supported")
    return tensor, None


def _element_view(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """(a real tensor, what it is of) for quantized and complex elements."""
    if tensor.is_quantized:
        return tensor.dequantize(), "dequantized"
    if tensor.is_complex():
        # view_as_real refuses a lazily conjugated tensor; resolve_conj copies only then.
        return torch.view_as_real(tensor.resolve_conj()), "real_imag"
    return tensor, None


def statistics_view(tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """The dense real tensor whose statistics describe ``tensor``, and the record's ``"stats_of"``.

        values, stats_of = statistics_view(torch.randn(3, dtype=torch.complex64))   # (3, 2) float32, "real_imag"

    ``stats_of`` is None for an ordinary tensor (summarised as it is), else "real_imag" (complex: the
    real and imaginary parts together, ``torch.view_as_real``), "values" (sparse: the stored values,
    of a coalesced copy for COO), "dequantized", "components" (nested: all elements of all components)
    or "local_shard" (DTensor: this rank's shard), joined by "/" when several apply
    ("values/real_imag"). Raises UnsupportedTensor for tensors without readable data.
    """
    if _is_ordinary(tensor):
        return tensor, None
    tensor, outer = _container_view(tensor)
    if outer == "local_shard":  # the shard is a tensor of its own: complex, sparse, ...
        tensor, inner = statistics_view(tensor)
    else:
        tensor, inner = _element_view(tensor)
    return tensor, "/".join(label for label in (outer, inner) if label) or None
