"""Exact summary statistics of tensors: one "summarize a shard" and one "merge two shards" definition.

Buckets of one tensor, shards on several ranks and repeated steps all combine through
``TensorSummary.merge`` (Chan et al.'s parallel update), so every path gives the same numbers.
Accumulation is float64; min/max and counts are exact, integer min/max stay python ints.

    s = summarize(x); print(s.numel, s.mean, s.std, s.min, s.max, s.nan, s.inf)

CPU tensors of the common dtypes go through a fused single-pass C++ kernel
(``probes/_stats_kernel.cpp``, built once per torch version with ``load_inline``); other devices and
dtypes, or a failed build, use a pure-torch path. ``backend()`` tells which one CPU tensors use;
``PROBES_NUMERICS_BACKEND=torch|cpp`` (or ``summarize(..., backend=...)``) forces one.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

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
        """Summary of the concatenation of both shards (commutative, bitwise)."""
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
        d = asdict(self)
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


def _merge_all(parts: list[TensorSummary]) -> TensorSummary:
    # Pairwise, so rounding in the running mean grows with log(len(parts)), not len(parts).
    if not parts:
        return TensorSummary.empty()
    while len(parts) > 1:
        merged = [parts[i].merge(parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            merged.append(parts[-1])
        parts = merged
    return parts[0]


# --- the C++ kernel -------------------------------------------------------------------------------

_KERNEL_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
})
_BACKENDS = ("auto", "cpp", "torch")
_DEFAULT_BACKEND = os.environ.get("PROBES_NUMERICS_BACKEND", "auto").strip().lower() or "auto"
_kernel_lock = threading.Lock()
_kernel: Any = None
_kernel_error: BaseException | None = None
_warned = False


def _isa_flags() -> tuple[str, list[str]]:
    """(tag, compiler flags) for the widest vector ISA this CPU has that the kernel uses."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic", []
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if {"avx2", "fma", "f16c"} <= set(flags):
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "x86_64", []


def _build_kernel() -> Any:
    from torch.utils.cpp_extension import load_inline

    source = (Path(__file__).with_name("_stats_kernel.cpp")).read_text()
    isa, isa_flags = _isa_flags()
    # One build per torch version and ISA: the torch_extensions cache is shared by all venvs.
    version = re.sub(r"[^0-9a-zA-Z]+", "_", torch.__version__)
    return load_inline(
        name=f"probes_stats_v1_torch{version}_{isa}",
        cpp_sources=[source],
        extra_cflags=["-O3", "-ffp-contract=fast", *isa_flags],
        verbose=False,
    )


def _first_lines(error: BaseException, count: int = 6) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return "\n".join((lines[:1] + errors[: count - 1]) if errors else lines[:count])


def _get_kernel(required: bool) -> Any:
    """The kernel module, or None (warning once) if it cannot be built and was not required."""
    global _kernel, _kernel_error, _warned
    with _kernel_lock:
        if _kernel is None and _kernel_error is None:
            try:
                _kernel = _build_kernel()
            except Exception as error:  # compiler, ninja or loader failure
                _kernel_error = error
        if _kernel is not None:
            return _kernel
        if required:
            raise RuntimeError(
                "probes.numerics: the C++ statistics kernel was requested but could not be built:\n"
                + _first_lines(_kernel_error)
            ) from _kernel_error
        if not _warned:
            _warned = True
            warnings.warn(
                "probes.numerics: building the C++ statistics kernel failed; using the slower torch "
                "path:\n" + _first_lines(_kernel_error),
                RuntimeWarning,
                stacklevel=3,
            )
        return None


def _resolve(choice: str | None) -> str:
    choice = (choice or _DEFAULT_BACKEND).lower()
    if choice not in _BACKENDS:
        raise ValueError(f"unknown statistics backend {choice!r}; expected one of {_BACKENDS}")
    return choice


def backend() -> str:
    """The backend summarize() uses for CPU tensors: "cpp" (fused kernel) or "torch"."""
    choice = _resolve(None)
    if choice == "torch":
        return "torch"
    return "cpp" if _get_kernel(required=choice == "cpp") is not None else "torch"


# --- the torch path -------------------------------------------------------------------------------

_STATS_WIDTH = 11  # the TensorSummary fields, in order


def _torch_bucket(b: torch.Tensor) -> torch.Tensor:
    """All statistics of one bucket as a float64 vector on b's device (no host sync).

    For integer dtypes the min/max slots hold int64 bit patterns, so they stay exact.
    """
    n = b.numel()
    values = b.to(torch.float64)
    neg = (values < 0).sum()
    pos = (values > 0).sum()
    if b.dtype.is_floating_point:
        keep = torch.isfinite(values)
        finite = keep.sum()
        nan = torch.isnan(values).sum()
        mean = torch.where(keep, values, 0.0).sum() / finite.clamp(min=1)
        m2 = torch.where(keep, values - mean, 0.0).square().sum()
        lo = torch.where(keep, values, math.inf).min()
        hi = torch.where(keep, values, -math.inf).max()
        extremes = torch.stack([lo, hi])
    else:
        finite = torch.full((), n, dtype=torch.int64, device=b.device)
        nan = torch.zeros((), dtype=torch.int64, device=b.device)
        mean = values.sum() / n
        m2 = (values - mean).square().sum()
        extremes = torch.stack([b.min(), b.max()]).to(torch.int64).view(torch.float64)
    counts = torch.stack([nan, n - finite - nan, neg, pos, n - nan - neg - pos]).to(torch.float64)
    head = torch.stack([finite.to(torch.float64), mean, m2])
    numel = torch.full((1,), n, dtype=torch.float64, device=b.device)
    return torch.cat([numel, head, extremes, counts])


def _decode(rows: torch.Tensor, dtype: torch.dtype) -> list[TensorSummary]:
    rows = rows.cpu()
    values = rows.tolist()
    if not dtype.is_floating_point:
        extremes = rows[:, 4:6].view(torch.int64).tolist()
        for row, (lo, hi) in zip(values, extremes):
            row[4:6] = lo, hi
    out = []
    for numel, finite, mean, m2, lo, hi, nan, inf, neg, pos, zero in values:
        finite = int(finite)
        out.append(TensorSummary(
            int(numel), finite, mean if finite else None, m2, lo if finite else None,
            hi if finite else None, int(nan), int(inf), int(neg), int(pos), int(zero),
        ))
    return out


# --- bucketing ------------------------------------------------------------------------------------


def _memory_order(x: torch.Tensor) -> torch.Tensor:
    """x with dims permuted to decreasing stride (statistics ignore element order)."""
    dims = [d for d in range(x.dim()) if x.shape[d] != 1]
    dims.sort(key=lambda d: x.stride(d), reverse=True)
    return x.permute(*dims, *[d for d in range(x.dim()) if d not in dims]).squeeze() if dims else x.reshape(1)


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
    if bucket_size < 1:
        raise ValueError("bucket_size must be positive")
    if tensor.is_complex():
        raise TypeError("summarize: complex tensors are not supported")
    choice = _resolve(backend)
    x = tensor.detach()
    numel = x.numel()
    if numel == 0:
        return TensorSummary.empty()
    on_cpu = run_on_cpu or x.device.type == "cpu"
    kernel = None
    if on_cpu and choice != "torch" and x.dtype in _KERNEL_DTYPES:
        kernel = _get_kernel(required=choice == "cpp")
    if kernel is not None and numel <= bucket_size and x.device.type == "cpu" and x.is_contiguous():
        return TensorSummary(*kernel.stats(x))

    if not x.is_contiguous():
        x = _memory_order(x)
    parts: list[TensorSummary] = []
    rows: list[torch.Tensor] = []
    for bucket in _buckets(x, bucket_size):
        if on_cpu:
            bucket = bucket.cpu()
        if kernel is not None:
            parts.append(TensorSummary(*kernel.stats(bucket.contiguous())))
        else:
            rows.append(_torch_bucket(bucket))
    if rows:
        parts = _decode(torch.stack(rows), x.dtype)  # one device-to-host transfer per tensor
    return _merge_all(parts)


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


def take_samples(tensor: torch.Tensor, indices: Sequence[int]) -> list[Number]:
    """Values at flat (logical, row-major) indices as python floats (nan/inf included) or ints."""
    idx = [int(i) for i in indices]
    if not idx:
        return []
    x = tensor.detach()
    numel = x.numel()
    if min(idx) < 0 or max(idx) >= numel:
        raise IndexError(f"take_samples: index out of range for a tensor of {numel} elements")
    if x.dim() == 0:
        values = [x.item()] * len(idx)
    else:
        flat = torch.tensor(idx, dtype=torch.int64, device=x.device)
        coords = []
        for size in reversed(x.shape):
            coords.append(flat % size)
            flat = flat // size
        values = x[tuple(reversed(coords))].tolist()
    if x.dtype == torch.bool:
        values = [int(v) for v in values]
    return values
