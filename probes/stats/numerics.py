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

import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..utils import check_int
from . import kernel
from .kernel import DEFAULT_BACKEND, KERNEL_DTYPES, KernelRow, backend, row_getter
from .views import check_readable

__all__ = ["TensorSummary", "backend", "sample_indices", "summarize", "take_samples"]

Number = float | int


@dataclass(frozen=True, slots=True)
class TensorSummary:
    """Statistics of a tensor (or of several merged shards).

    mean, m2, min and max are over the finite elements; the five counts are over all elements
    (neg and pos exclude nan; -inf counts as neg and as inf; -0.0 counts as zero).
    """

    numel: int
    finite: int
    mean: float | None
    m2: float
    min: Number | None
    max: Number | None
    nan: int
    inf: int
    neg: int
    pos: int
    zero: int

    @property
    def std(self) -> float | None:
        """Unbiased (n - 1) standard deviation over the finite elements."""
        if self.finite < 2:
            return None
        return math.sqrt(max(self.m2, 0.0) / (self.finite - 1))

    @staticmethod
    def empty() -> TensorSummary:
        return TensorSummary(0, 0, None, 0.0, None, None, 0, 0, 0, 0, 0)

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
            mean, m2 = a.mean, a.m2
        else:
            assert a.mean is not None and b.mean is not None
            delta = b.mean - a.mean
            mean = a.mean + delta * (b.finite / n)
            m2 = a.m2 + b.m2 + delta * delta * (a.finite * b.finite / n)
        return TensorSummary(
            numel=a.numel + b.numel,
            finite=n,
            mean=mean,
            m2=m2,
            min=_pick(min, a.min, b.min),
            max=_pick(max, a.max, b.max),
            nan=a.nan + b.nan,
            inf=a.inf + b.inf,
            neg=a.neg + b.neg,
            pos=a.pos + b.pos,
            zero=a.zero + b.zero,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields plus "std"."""
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}  # asdict() deep-copies: slow
        d["std"] = self.std
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TensorSummary:
        def number(v: Any) -> Number | None:
            return None if v is None else v if isinstance(v, int) else float(v)

        return TensorSummary(
            numel=int(d["numel"]),
            finite=int(d["finite"]),
            mean=None if d["mean"] is None else float(d["mean"]),
            m2=float(d["m2"]),
            min=number(d["min"]),
            max=number(d["max"]),
            nan=int(d["nan"]),
            inf=int(d["inf"]),
            neg=int(d["neg"]),
            pos=int(d["pos"]),
            zero=int(d["zero"]),
        )


def _pick(choose: Any, x: Number | None, y: Number | None) -> Number | None:
    if x is None:
        return y
    if y is None:
        return x
    return choose(x, y)


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

def _torch_bucket(b: torch.Tensor, shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, shift): all statistics of one bucket as a float64 vector on b's device, no host sync.

    The vector holds KernelRow's fields in its order. The mean is returned as an offset from `shift`
    (a 0-d float64 tensor; None: this bucket's mean), so buckets combine exactly. For integer dtypes
    the min/max slots hold int64 bit patterns.
    """
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
    row = KernelRow(numel=torch.full((), n, dtype=torch.float64, device=b.device), mean=shift + deviation, m2=m2,
                    min=lo, max=hi, shift=shift, deviation=deviation,
                    **dict(zip(("finite", "nan", "inf", "neg", "pos", "zero"), counts)))
    return torch.stack(row), shift


_EXTREMES = [KernelRow._fields.index("min"), KernelRow._fields.index("max")]


def _decode(rows: torch.Tensor, dtype: torch.dtype) -> list[KernelRow]:
    """The rows of _torch_bucket, read back to the host in one transfer."""
    rows = rows.cpu()
    values = rows.tolist()
    extremes = rows[:, _EXTREMES].view(torch.int64).tolist() if not dtype.is_floating_point else None
    out = []
    for i, raw in enumerate(values):
        row = KernelRow._make(raw)
        finite = int(row.finite)
        lo, hi = (row.min, row.max) if extremes is None else extremes[i]
        out.append(KernelRow(
            numel=int(row.numel), finite=finite, mean=row.mean if finite else None, m2=row.m2,
            min=lo if finite else None, max=hi if finite else None,
            nan=int(row.nan), inf=int(row.inf), neg=int(row.neg), pos=int(row.pos), zero=int(row.zero),
            shift=row.shift, deviation=row.deviation,
        ))
    return out


_SUMMARY_FIELDS = row_getter(*TensorSummary.__dataclass_fields__)  # TensorSummary's fields, by name


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
    mean = m2 = None
    if finite:
        deviation = math.fsum(row.finite * row.deviation for row in live) / finite
        mean = shift + deviation
        m2 = math.fsum(row.m2 for row in live) + math.fsum(
            row.finite * (row.deviation - deviation) ** 2 for row in live
        )
    lows = [row.min for row in live]
    highs = [row.max for row in live]
    return TensorSummary(
        numel=sum(row.numel for row in rows),
        finite=finite,
        mean=mean,
        m2=m2 if m2 is not None else 0.0,
        min=min(lows) if lows else None,
        max=max(highs) if highs else None,
        nan=sum(row.nan for row in rows),
        inf=sum(row.inf for row in rows),
        neg=sum(row.neg for row in rows),
        pos=sum(row.pos for row in rows),
        zero=sum(row.zero for row in rows),
    )


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


def summarize(
    tensor: torch.Tensor,
    bucket_size: int = 1 << 22,
    run_on_cpu: bool = False,
    *,
    backend: str | None = None,
) -> TensorSummary:
    """Exact statistics of `tensor`, working through buckets of at most `bucket_size` elements.

    run_on_cpu: copy one bucket at a time to the CPU and compute there.
    backend: "auto" (default), "cpp" (fail if the kernel cannot be built) or "torch".
    """
    choice = DEFAULT_BACKEND if backend is None else kernel.resolve_backend(backend)
    check_readable(tensor)
    if tensor.is_neg():  # a lazily negated view: the kernel reads memory, which holds -x
        tensor = tensor.resolve_neg()
    # Fast path (one kernel call, no copies): every CPU tensor that fits in one bucket.
    if (
        choice != "torch"
        and tensor.is_cpu
        and tensor.dtype in KERNEL_DTYPES
        and 0 < tensor.numel() <= bucket_size
        and tensor.is_contiguous()
    ):
        fused = kernel.load(required=choice == "cpp")
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
    if fused is None and on_cpu:
        # Each bucket makes float64 temporaries; small ones skip page faults (1.6x faster at 1e6).
        bucket_size = min(bucket_size, _TORCH_CPU_CHUNK)
    if not x.is_contiguous():
        x = _memory_order(x)
    rows: list[KernelRow] = []
    device_rows: list[torch.Tensor] = []
    kernel_shift: float | None = None
    torch_shift: torch.Tensor | None = None
    for bucket in _buckets(x, bucket_size):
        if on_cpu:
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
        rows = _decode(torch.stack(device_rows), work_dtype)  # one device-to-host transfer per tensor
    return _combine(rows)


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
    # torch.take indexes the logical row-major order of any layout without copying the tensor.
    wide = _WIDENED.get(x.dtype)
    if wide is not None:  # no take kernel: gather the bits as an integer of the same size
        carrier = _SAME_SIZE_INT[x.element_size()]
        values = torch.take(x.view(carrier), indices).view(x.dtype).to(wide).tolist()
    else:
        values = torch.take(x, indices).tolist()
    if x.dtype == torch.bool:
        values = [int(v) for v in values]
    return values
