"""Exact summary statistics of tensors: a statistic is "summarize a shard" plus "merge shards".

    s = summarize(x); print(s.numel, s.mean, s.std, s.min, s.max, s.nan, s.inf)

Shards on several ranks or steps combine with ``TensorSummary.merge`` (Chan et al.'s parallel
update). Buckets of one tensor use the same update in its k-way form around one shared shift, which
keeps them exact even when the mean is huge next to the spread. Accumulation is float64; counts
and min/max are exact (integer min/max stay python ints).

CPU tensors of the common dtypes go through a fused single-pass C++ kernel (``kernel.py``); other
devices and dtypes, or a failed build, use a pure-torch path that computes the same row
(``KernelRow``). ``backend()`` tells which one CPU tensors use; ``PROBES_NUMERICS_BACKEND=torch|cpp``
(or ``summarize(..., backend=...)``) forces one. float8 and uint16/uint32 tensors, which torch cannot
reduce, are converted bucket by bucket to float32 / int64 (exact). Only dense tensors with data are
accepted: complex, sparse, nested, quantized, meta and ``__torch_dispatch__`` tensors raise TypeError
(``views.statistics_view`` gives the dense tensor that describes them).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch

from ..dump.statistics import ACCUMULATED, DERIVED, Statistic
from ..utils.checks import check_int
from . import kernel
from .kernel import KERNEL_DTYPES, KernelRow, backend, default_backend, row_getter
from .views import check_readable

__all__ = ["TensorSummary", "backend", "decode_row", "device_row", "device_samples", "kernel_reads_whole", "merge_rows", "sample_index_tensor", "sample_indices",
           "summarize", "take_samples"]

Number = float | int


class _SummaryMethods:
    """Statistics of a tensor (or of several merged shards); its fields are the registry's accumulated
    statistics (``probes.dump.statistics``), its properties the derived ones (``std``, ``norm``).

    mean, m2, min and max are over the finite elements; the five counts are over all elements
    (neg and pos exclude nan; -inf counts as neg and as inf; -0.0 counts as zero).

        s = summarize(x); s.mean, s.std, s.norm; a.merge(b); TensorSummary.from_dict(s.to_dict())
    """

    __slots__ = ()

    @classmethod
    def empty(cls) -> TensorSummary:
        """The summary of no elements."""
        return cls(**{stat.name: None if stat.finite_only else (0.0 if stat.column == "float" else 0)
                      for stat in ACCUMULATED})

    def merge(self, other: TensorSummary) -> TensorSummary:
        """Summary of the concatenation of both shards (commutative, bitwise).

        Each shard's mean is a float64, rounded by up to half an ulp of the mean; on data whose
        spread is tiny next to its mean (mean 1e4, std 1e-3) that limits a merged std to ~1e-11
        relative. summarize() does not go through here: its buckets share a shift and are exact.
        """
        a, b = self, other
        # Canonical order makes a.merge(b) and b.merge(a) identical to the last bit.
        if (b.finite, b.mean or 0.0, b.m2) > (a.finite, a.mean or 0.0, a.m2):
            a, b = b, a
        n = a.finite + b.finite
        if b.finite == 0:
            moments = {"mean": a.mean, "m2": a.m2}
        else:
            delta = b.mean - a.mean
            moments = {"mean": a.mean + delta * (b.finite / n), "m2": a.m2 + b.m2 + delta * delta * (a.finite * b.finite / n)}
        values = {}
        for stat in ACCUMULATED:
            x, y = getattr(a, stat.name), getattr(b, stat.name)
            values[stat.name] = moments[stat.merge] if stat.merge in moments else _MERGE_VALUES[stat.merge](x, y)
        return type(self)(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every statistic, accumulated then derived (None where undefined)."""
        d = {name: getattr(self, name) for name in _ACCUMULATED_NAMES}
        for stat in DERIVED:
            d[stat.name] = getattr(self, stat.name)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSummary:
        """The summary a ``to_dict()`` (or a record) holds; derived statistics are recomputed, not read."""
        return cls(**{stat.name: _COERCE[stat.column](d[stat.name]) for stat in ACCUMULATED})


def _number(v: Any) -> Number | None:
    return None if v is None else v if isinstance(v, int) else float(v)


DEFAULT_BUCKET_SIZE = 1 << 22  # elements; bounds the extra memory of one statistics pass

_COERCE = {"int": int, "float": lambda v: None if v is None else float(v), "number": _number}


def _pick(choose: Any, x: Number | None, y: Number | None) -> Number | None:
    if x is None:
        return y
    if y is None:
        return x
    return choose(x, y)


# The merge rules on python values (the device rows' own are in merge_rows).
_MERGE_VALUES: dict[str, Callable[[Any, Any], Any]] = {
    "sum": operator.add, "min": lambda x, y: _pick(min, x, y), "max": lambda x, y: _pick(max, x, y)}
_ACCUMULATED_NAMES = tuple(stat.name for stat in ACCUMULATED)


def _derived_property(stat: Statistic) -> property:
    def value(self: _SummaryMethods) -> float | None:
        result = float(stat.derive({name: _nan_if_none(getattr(self, name)) for name in _ACCUMULATED_NAMES}))
        return None if math.isnan(result) else result
    value.__doc__ = stat.doc
    return property(value)


def _nan_if_none(value: Any) -> float:
    return math.nan if value is None else float(value)


for _stat in DERIVED:
    setattr(_SummaryMethods, _stat.name, _derived_property(_stat))

TensorSummary = dataclasses.make_dataclass(
    "TensorSummary", [(name, Any) for name in _ACCUMULATED_NAMES], bases=(_SummaryMethods,), frozen=True,
    slots=True, namespace={"__module__": __name__})
TensorSummary.__doc__ = _SummaryMethods.__doc__


# Converted one bucket at a time, so the memory bound of a statistics pass stays.
def _widened_dtypes() -> dict[torch.dtype, torch.dtype]:
    """Dtypes torch cannot reduce or compare (in this version), each with one that holds all its values exactly."""
    wide = {"float8_e4m3fn": torch.float32, "float8_e5m2": torch.float32, "float8_e4m3fnuz": torch.float32,
            "float8_e5m2fnuz": torch.float32, "float8_e8m0fnu": torch.float32,
            "uint16": torch.int64, "uint32": torch.int64}
    return {getattr(torch, name): to for name, to in wide.items() if isinstance(getattr(torch, name, None), torch.dtype)}


_WIDENED = _widened_dtypes()
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TORCH_CPU_CHUNK = 1 << 16


# --- the torch path -------------------------------------------------------------------------------

class _Bucket:
    """One bucket's statistics as 0-d float64 tensors on its device, no host sync; the registry's
    ``bucket`` functions read them by name. They are computed together because they share temporaries.

    The mean is ``shift + deviation`` around `shift` (a 0-d float64 tensor; None: this bucket's mean), so
    buckets combine exactly. For integer dtypes min and max hold int64 bit patterns.
    """

    def __init__(self, b: torch.Tensor, shift: torch.Tensor | None) -> None:
        n = b.numel()
        v = b.to(torch.float64, copy=True)  # private: the in-place ops below allocate nothing more
        neg = (b < 0).sum()
        pos = (b > 0).sum()
        if b.dtype.is_floating_point:
            bad = ~torch.isfinite(v)
            finite = n - bad.sum()
            nan = torch.isnan(v).sum()
            lo = v.masked_fill_(bad, math.inf).min()
            hi = v.masked_fill_(bad, -math.inf).max()
            v.masked_fill_(bad, 0.0)
            if shift is None:
                shift = v.sum() / finite.clamp(min=1)
            deviation = v.sub_(shift).masked_fill_(bad, 0.0).sum() / finite.clamp(min=1)
            m2 = v.sub_(deviation).masked_fill_(bad, 0.0).square_().sum()
        else:
            finite = torch.full((), n, dtype=torch.int64, device=b.device)
            nan = torch.zeros((), dtype=torch.int64, device=b.device)
            lo, hi = torch.stack([b.min(), b.max()]).to(torch.int64).view(torch.float64)
            if shift is None:
                shift = v.sum() / n
            deviation = v.sub_(shift).sum() / n
            m2 = v.sub_(deviation).square_().sum()
        counts = torch.stack([finite, nan, n - finite - nan, neg, pos, n - nan - neg - pos]).to(torch.float64)
        self.finite, self.nan, self.inf, self.neg, self.pos, self.zero = counts
        self.numel = torch.full((), n, dtype=torch.float64, device=b.device)
        self.mean, self.m2, self.min, self.max = shift + deviation, m2, lo, hi
        self.shift, self.deviation = shift, deviation


def _torch_bucket(b: torch.Tensor, shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, shift): all statistics of one bucket as a float64 vector in KernelRow's order on b's device."""
    stats = _Bucket(b, shift)
    return torch.stack([stat.bucket(stats) for stat in ACCUMULATED] + [stats.shift, stats.deviation]), stats.shift


_AT = {name: index for index, name in enumerate(KernelRow._fields)}
_NUMBER_SLOTS = [_AT[stat.name] for stat in ACCUMULATED if stat.column == "number"]
_INT_SLOTS = [_AT[stat.name] for stat in ACCUMULATED if stat.column == "int"]


def merge_rows(rows: torch.Tensor, integer: bool) -> torch.Tensor:
    """The accumulated statistics of a tensor from its bucket rows (``_torch_bucket``'s, sharing one shift),
    merged on their device with no host sync: a float64 vector in the registry's accumulated order.

    The moments merge in the k-way form around the shared shift, so rounding at the size of the mean
    never enters m2. ``integer``: min and max hold int64 bit patterns. ``rows`` may have leading batch
    dimensions (``(..., k, columns)``: k rows of each of several tensors), merged in one pass into ``(..., accumulated)``.
    """
    if rows.shape[-2] == 1:
        return rows[..., 0, :len(ACCUMULATED)]
    finite = rows[..., _AT["finite"]]
    total = finite.sum(-1, keepdim=True)
    deviations = rows[..., _AT["deviation"]]
    deviation = (finite * deviations).sum(-1, keepdim=True) / total.clamp(min=1)
    merged = {}
    for stat in ACCUMULATED:
        column = rows[..., _AT[stat.name]]
        if integer and stat.column == "number":
            column = column.view(torch.int64)
        if stat.merge == "sum":
            value = column.sum(-1)
        elif stat.merge == "min":
            value = column.amin(-1)
        elif stat.merge == "max":
            value = column.amax(-1)
        elif stat.merge == "mean":
            value = rows[..., 0, _AT["shift"]] + deviation[..., 0]
        else:  # "m2"
            value = column.sum(-1) + (finite * (deviations - deviation).square()).sum(-1)
        merged[stat.name] = value.view(torch.float64) if value.dtype == torch.int64 else value
    return torch.stack([merged[stat.name] for stat in ACCUMULATED], dim=-1)


_FINITE_ONLY = [stat.name for stat in ACCUMULATED if stat.finite_only]
_SUMMARY_FIELDS = row_getter(*_ACCUMULATED_NAMES)  # TensorSummary's fields, by name


def _summary(row: KernelRow | tuple) -> TensorSummary:
    """The TensorSummary part of a row (a KernelRow, or a plain tuple in its order)."""
    return TensorSummary(*_SUMMARY_FIELDS(row))


def _combine(rows: list[KernelRow]) -> TensorSummary:
    """Merges bucket rows that share one shift: two-pass over the bucket means, so rounding at the
    size of the mean (an offset) never enters m2, unlike a chain of pairwise merges."""
    if len(rows) == 1:
        return _summary(rows[0])
    shift = rows[0].shift
    live = [row for row in rows if row.finite]
    finite = sum(row.finite for row in live)
    moments: dict[str, Any] = {"mean": None, "m2": 0.0}
    if finite:
        deviation = math.fsum(row.finite * row.deviation for row in live) / finite
        moments["mean"] = shift + deviation
        moments["m2"] = math.fsum(row.m2 for row in live) + math.fsum(
            row.finite * (row.deviation - deviation) ** 2 for row in live
        )
    values = {}
    for stat in ACCUMULATED:
        if stat.merge in moments:
            values[stat.name] = moments[stat.merge]
        else:
            column = [getattr(row, stat.name) for row in rows]
            value = column[0]
            for item in column[1:]:
                value = _MERGE_VALUES[stat.merge](value, item)
            values[stat.name] = value
    return TensorSummary(**values)


# --- bucketing ------------------------------------------------------------------------------------


def _memory_order(x: torch.Tensor) -> torch.Tensor:
    """x with dims permuted to decreasing stride (statistics ignore element order)."""
    dims = sorted((d for d in range(x.dim()) if x.shape[d] != 1), key=x.stride, reverse=True)
    if not dims:
        return x.reshape(1)
    return x.permute(*dims, *[d for d in range(x.dim()) if d not in dims]).squeeze()


def _buckets(x: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """Views covering every element of x once, each of at most `size` elements."""
    if x.is_contiguous():
        flat = x.reshape(-1)
        for start in range(0, flat.numel(), size):
            yield flat[start:start + size]
        return
    if x.numel() <= size:
        yield x
        return
    inner = x[0].numel()
    if inner <= size:
        step = size // inner
        for start in range(0, x.shape[0], step):
            yield x[start:start + step]
    else:
        for i in range(x.shape[0]):
            yield from _buckets(x[i], size)


# --- public entry points --------------------------------------------------------------------------


def kernel_reads_whole(tensor: torch.Tensor, bucket_size: int) -> bool:
    """Whether the C++ kernel reads `tensor` in one call: a contiguous, non-empty CPU tensor of one bucket."""
    return (tensor.is_cpu and tensor.dtype in KERNEL_DTYPES and 0 < tensor.numel() <= bucket_size
            and tensor.is_contiguous())


def _fast_kernel(tensor: torch.Tensor, bucket_size: int, choice: str) -> kernel.Kernel | None:
    """The C++ kernel when it reads `tensor` in one call, else None."""
    if choice != "torch" and kernel_reads_whole(tensor, bucket_size):
        return kernel.load(required=choice == "cpp")
    return None


def device_row(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """The accumulated statistics of a readable, non-empty tensor as a float64 vector on its device (the
    registry's order; integer min/max as int64 bit patterns), computed bucket by bucket and merged there,
    with no host sync."""
    wide = _WIDENED.get(x.dtype)
    if x.is_cpu:
        # Each bucket makes float64 temporaries; small ones skip page faults (1.6x faster at 1e6).
        bucket_size = min(bucket_size, _TORCH_CPU_CHUNK)
    if not x.is_contiguous():
        x = _memory_order(x)
    rows: list[torch.Tensor] = []
    shift: torch.Tensor | None = None
    for bucket in _buckets(x, bucket_size):
        row, shift = _torch_bucket(bucket if wide is None else bucket.to(wide), shift)
        rows.append(row)
    return merge_rows(torch.stack(rows), integer=not (wide or x.dtype).is_floating_point)


def summarize(
    tensor: torch.Tensor,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    run_on_cpu: bool = False,
    *,
    backend: str | None = None,
) -> TensorSummary:
    """Exact statistics of `tensor`, working through buckets of at most `bucket_size` elements.

    run_on_cpu: copy one bucket at a time to the CPU and compute there.
    backend: "auto" (default), "cpp" (fail if the kernel cannot be built) or "torch".
    A host API: the statistics of a device tensor are read back (one transfer).
    """
    choice = default_backend() if backend is None else kernel.resolve_backend(backend)
    check_readable(tensor)
    if tensor.is_neg():  # a lazily negated view: the kernel reads memory, which holds -x
        tensor = tensor.resolve_neg()
    fused = _fast_kernel(tensor, bucket_size, choice)  # one kernel call, no copies
    if fused is not None:
        return _summary(fused.stats_tuple(tensor, None))

    bucket_size = check_int(operator.index(bucket_size), "bucket_size", minimum=1)  # numpy ints stay accepted
    if tensor.is_complex():
        raise TypeError("summarize: complex tensors are not supported (summarize torch.view_as_real(x))")
    x = tensor.detach()
    if x.numel() == 0:
        return TensorSummary.empty()
    wide = _WIDENED.get(x.dtype)
    work_dtype = wide or x.dtype
    on_cpu = run_on_cpu or x.is_cpu
    fused = None
    if on_cpu and choice != "torch" and work_dtype in KERNEL_DTYPES:
        fused = kernel.load(required=choice == "cpp")
    if fused is None and not run_on_cpu:
        return decode_row(device_row(x, bucket_size).cpu(), integer=not work_dtype.is_floating_point)
    if fused is None:
        bucket_size = min(bucket_size, _TORCH_CPU_CHUNK)
    if not x.is_contiguous():
        x = _memory_order(x)
    rows: list[KernelRow] = []
    device_rows: list[torch.Tensor] = []
    kernel_shift: float | None = None
    torch_shift: torch.Tensor | None = None
    for bucket in _buckets(x, bucket_size):
        bucket = bucket.cpu()
        if wide is not None:
            bucket = bucket.to(wide)
        if fused is not None:
            rows.append(fused.stats(bucket.contiguous(), kernel_shift))
            kernel_shift = rows[0].shift
        else:
            row, torch_shift = _torch_bucket(bucket, torch_shift)
            device_rows.append(row)
    if device_rows:
        return decode_row(merge_rows(torch.stack(device_rows), integer=not work_dtype.is_floating_point),
                          integer=not work_dtype.is_floating_point)
    return _combine(rows)


def decode_row(row: torch.Tensor, *, integer: bool) -> TensorSummary:
    """The TensorSummary of a CPU row of ``device_row`` (or a device row's first slots)."""
    raw = row.tolist()
    if integer:
        for slot, number in zip(_NUMBER_SLOTS, row[_NUMBER_SLOTS].view(torch.int64).tolist()):
            raw[slot] = number
    for slot in _INT_SLOTS:
        raw[slot] = int(raw[slot])
    if not raw[_AT["finite"]]:
        for stat in _FINITE_ONLY:
            raw[_AT[stat]] = None
    return TensorSummary(*raw[:len(ACCUMULATED)])


def sample_indices(numel: int, count: int) -> list[int]:
    """`count` evenly spaced flat indices in [0, numel), first and last included; deterministic."""
    if numel <= 0 or count <= 0:
        return []
    if count >= numel:
        return list(range(numel))
    if count == 1:
        return [0]
    # Steps are >= 1 since numel - 1 >= count - 1, so the floor never repeats an index.
    return [i * (numel - 1) // (count - 1) for i in range(count)]


def sample_index_tensor(numel: int, count: int, device: torch.device) -> torch.Tensor:
    """``sample_indices(numel, count)`` as an int64 tensor made on ``device`` by the same integer formula
    (a copy from a host list would be a blocking copy on CUDA)."""
    if count <= 0 or numel <= 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if count >= numel:
        return torch.arange(numel, dtype=torch.int64, device=device)
    if count == 1:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return torch.arange(count, dtype=torch.int64, device=device) * (numel - 1) // (count - 1)


def device_samples(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x's values at flat (logical, row-major) indices as float64 on x's device, no host sync; the values
    of integer and bool tensors as int64 bit patterns (exact).

    torch.take indexes the logical row-major order of any layout without copying the tensor.
    """
    wide = _WIDENED.get(x.dtype)
    if wide is not None:  # no take kernel: gather the bits as an integer of the same size
        values = torch.take(x.view(_SAME_SIZE_INT[x.element_size()]), indices).view(x.dtype).to(wide)
    else:
        values = torch.take(x, indices)
    if values.dtype.is_floating_point:
        return values.to(torch.float64)
    return values.to(torch.int64).view(torch.float64)


def take_samples(tensor: torch.Tensor, indices: Sequence[int] | torch.Tensor) -> list[Number]:
    """Values at flat (logical, row-major) indices as python floats (nan/inf included) or ints."""
    x = tensor.detach()
    if not isinstance(indices, torch.Tensor):
        idx = [int(i) for i in indices]
        if idx and (min(idx) < 0 or max(idx) >= x.numel()):
            raise IndexError(f"take_samples: index out of range for a tensor of {x.numel()} elements")
        indices = torch.tensor(idx, dtype=torch.int64, device=x.device)
    if indices.numel() == 0:
        return []
    values = device_samples(x, indices).cpu()
    if (_WIDENED.get(x.dtype) or x.dtype).is_floating_point:
        return values.tolist()
    return values.view(torch.int64).tolist()
