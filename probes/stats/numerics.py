"""Exact summary statistics of tensors: a statistic is "summarize a shard" plus "merge shards".

    s = summarize(x); print(s.numel, s.mean, s.std, s.min, s.max, s.nan, s.inf)

Shards on several ranks or steps combine with ``TensorSummary.merge`` (Chan et al.'s parallel
update). Buckets of one tensor use the same update in its k-way form around one shared shift, which
keeps them exact even when the mean is huge next to the spread. Accumulation is float64; counts
and min/max are exact (integer min/max stay python ints).

CPU tensors of the common dtypes go through a fused single-pass C++ kernel
(``probes/stats/_stats_kernel.cpp``, built once per torch version with ``load_inline``); other devices and
dtypes, or a failed build, use a pure-torch path. ``backend()`` tells which one CPU tensors use;
``PROBES_NUMERICS_BACKEND=torch|cpp`` (or ``summarize(..., backend=...)``) forces one. float8 and
uint16/uint32 tensors, which torch cannot reduce, are converted bucket by bucket to float32 / int64
(exact). Only dense tensors with data are accepted: complex, sparse, nested, quantized, meta and
``__torch_dispatch__`` tensors raise TypeError (``probes.statistics`` summarises what they hold).
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import platform
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exporters import _torch_compat

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


# --- the C++ kernel -------------------------------------------------------------------------------

_KERNEL_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
})


def _widened_dtypes() -> dict[torch.dtype, torch.dtype]:
    """Dtypes torch cannot reduce or compare (in this version), each with one that holds all its values exactly."""
    wide = {"float8_e4m3fn": torch.float32, "float8_e5m2": torch.float32, "float8_e4m3fnuz": torch.float32,
            "float8_e5m2fnuz": torch.float32, "float8_e8m0fnu": torch.float32,
            "uint16": torch.int64, "uint32": torch.int64}
    return {getattr(torch, name): to for name, to in wide.items() if isinstance(getattr(torch, name, None), torch.dtype)}


# Converted one bucket at a time, so the memory bound of a statistics pass stays.
_WIDENED = _widened_dtypes()
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_BACKENDS = ("auto", "cpp", "torch")
_DEFAULT_BACKEND = os.environ.get("PROBES_NUMERICS_BACKEND", "auto").strip().lower() or "auto"
if _DEFAULT_BACKEND not in _BACKENDS:
    warnings.warn(f"PROBES_NUMERICS_BACKEND={_DEFAULT_BACKEND!r} is not one of {_BACKENDS}; using auto")
    _DEFAULT_BACKEND = "auto"
_TORCH_CPU_CHUNK = 1 << 16
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
    # CUDA builds of torch print "No CUDA runtime is found" on this import; we build no CUDA code.
    with contextlib.redirect_stderr(io.StringIO()):
        from torch.utils import cpp_extension

    source = Path(__file__).with_name("_stats_kernel.cpp").read_text()
    isa, isa_flags = _isa_flags()
    # One build per torch version and ISA: the torch_extensions cache is shared by all venvs.
    version = re.sub(r"[^0-9a-zA-Z]+", "_", torch.__version__)
    name = f"probes_stats_v1_torch{version}_{isa}"
    build = functools.partial(
        cpp_extension.load_inline,
        name=name,
        cpp_sources=[source],
        extra_cflags=["-O3", "-ffp-contract=fast", *isa_flags],
        verbose=False,
    )
    try:
        import fcntl
    except ImportError:  # no flock (Windows)
        return build()
    build_dir = _torch_compat.extension_build_directory(name)
    if build_dir is None:
        return build()
    os.makedirs(build_dir, exist_ok=True)
    # torch's own build lock is a file that stays behind when a building process is killed, and
    # then blocks every later process forever. An flock dies with its process: whoever holds it
    # knows that a leftover torch lock is stale.
    with open(os.path.join(build_dir, "probes_build.flock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            os.remove(os.path.join(build_dir, "lock"))
        except FileNotFoundError:
            pass
        return build()


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


def _resolve(choice: str) -> str:
    choice = choice.lower()
    if choice not in _BACKENDS:
        raise ValueError(f"unknown statistics backend {choice!r}; expected one of {_BACKENDS}")
    return choice


def backend() -> str:
    """The backend summarize() uses for CPU tensors: "cpp" (fused kernel) or "torch"."""
    choice = _DEFAULT_BACKEND
    if choice == "torch":
        return "torch"
    return "cpp" if _get_kernel(required=choice == "cpp") is not None else "torch"


# --- the torch path -------------------------------------------------------------------------------

def _torch_bucket(b: torch.Tensor, shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, shift): all statistics of one bucket as a float64 vector on b's device, no host sync.

    The mean is returned as an offset from `shift` (a 0-d float64 tensor; None: this bucket's mean),
    so buckets combine exactly. For integer dtypes the min/max slots hold int64 bit patterns.
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
        extremes = torch.stack([lo, hi])
        v.masked_fill_(bad, 0.0)
        if shift is None:
            shift = v.sum() / finite.clamp(min=1)
        deviation = v.sub_(shift).masked_fill_(bad, 0.0).sum() / finite.clamp(min=1)
        m2 = v.sub_(deviation).masked_fill_(bad, 0.0).square_().sum()
    else:
        finite = torch.full((), n, dtype=torch.int64, device=b.device)
        nan = torch.zeros((), dtype=torch.int64, device=b.device)
        extremes = torch.stack([b.min(), b.max()]).to(torch.int64).view(torch.float64)
        if shift is None:
            shift = v.sum() / n
        deviation = v.sub_(shift).sum() / n
        m2 = v.sub_(deviation).square_().sum()
    counts = torch.stack([nan, n - finite - nan, neg, pos, n - nan - neg - pos]).to(torch.float64)
    numel = torch.full((), n, dtype=torch.float64, device=b.device)
    head = torch.stack([numel, finite.to(torch.float64), shift + deviation, m2])
    return torch.cat([head, extremes, counts, torch.stack([shift, deviation])]), shift


def _decode(rows: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
    rows = rows.cpu()
    values = rows.tolist()
    extremes = rows[:, 4:6].view(torch.int64).tolist() if not dtype.is_floating_point else None
    out = []
    for i, row in enumerate(values):
        numel, finite, mean, m2, lo, hi, nan, inf, neg, pos, zero, shift, deviation = row
        finite = int(finite)
        if extremes is not None:
            lo, hi = extremes[i]
        if not finite:
            mean = lo = hi = None
        out.append((int(numel), finite, mean, m2, lo, hi, int(nan), int(inf), int(neg), int(pos),
                    int(zero), shift, deviation))
    return out


def _combine(rows: list[tuple]) -> TensorSummary:
    """Merges bucket rows that share one shift: two-pass over the bucket means, so rounding at the
    size of the mean (an offset) never enters m2, unlike a chain of pairwise merges."""
    if len(rows) == 1:
        return TensorSummary(*rows[0][:11])
    shift = rows[0][11]
    live = [row for row in rows if row[1]]
    finite = sum(row[1] for row in live)
    mean = m2 = None
    if finite:
        deviation = math.fsum(row[1] * row[12] for row in live) / finite
        mean = shift + deviation
        m2 = math.fsum(row[3] for row in live) + math.fsum(
            row[1] * (row[12] - deviation) ** 2 for row in live
        )
    lows = [row[4] for row in live]
    highs = [row[5] for row in live]
    return TensorSummary(
        numel=sum(row[0] for row in rows),
        finite=finite,
        mean=mean,
        m2=m2 if m2 is not None else 0.0,
        min=min(lows) if lows else None,
        max=max(highs) if highs else None,
        nan=sum(row[6] for row in rows),
        inf=sum(row[7] for row in rows),
        neg=sum(row[8] for row in rows),
        pos=sum(row[9] for row in rows),
        zero=sum(row[10] for row in rows),
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
    return type(tensor) not in _PLAIN_TYPES and torch._C._dispatch_keys(tensor).has(torch._C.DispatchKey.Python)


def _check_readable(tensor: torch.Tensor) -> None:
    """Raises TypeError unless `tensor` is a dense tensor with memory the statistics can read.

    The kernel reads raw memory: a tensor without a plain strided buffer (sparse, nested, quantized,
    meta, a __torch_dispatch__ subclass such as FakeTensor or DTensor) would be read as garbage or
    crash the process. probes.statistics.statistics_view turns most of them into one that is readable.
    """
    if is_dense(tensor):
        return
    if tensor.layout is not torch.strided or tensor.is_nested:
        kind = "a nested tensor" if tensor.is_nested else f"a {str(tensor.layout).removeprefix('torch.')} tensor"
    elif tensor.is_quantized:
        kind = "a quantized tensor"
    elif tensor.is_meta:
        kind = "a meta tensor (no data)"
    elif is_dispatch_subclass(tensor):
        kind = f"a {type(tensor).__qualname__} (a __torch_dispatch__ subclass)"
    else:
        return  # e.g. a __torch_function__-only subclass: a plain buffer underneath
    raise TypeError(f"summarize needs a dense tensor with data, got {kind}")


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
    choice = _DEFAULT_BACKEND if backend is None else _resolve(backend)
    _check_readable(tensor)
    if tensor.is_neg():  # a lazily negated view: the kernel reads memory, which holds -x
        tensor = tensor.resolve_neg()
    # Fast path (one kernel call, no copies): every CPU tensor that fits in one bucket.
    if (
        choice != "torch"
        and tensor.is_cpu
        and tensor.dtype in _KERNEL_DTYPES
        and 0 < tensor.numel() <= bucket_size
        and tensor.is_contiguous()
    ):
        kernel = _kernel or _get_kernel(required=choice == "cpp")
        if kernel is not None:
            return TensorSummary(*kernel.stats(tensor)[:11])

    if bucket_size < 1:
        raise ValueError("bucket_size must be positive")
    if tensor.is_complex():
        raise TypeError("summarize: complex tensors are not supported (summarize torch.view_as_real(x))")
    x = tensor.detach()
    if x.numel() == 0:
        return TensorSummary.empty()
    wide = _WIDENED.get(x.dtype)
    work_dtype = wide or x.dtype
    on_cpu = run_on_cpu or x.is_cpu
    kernel = None
    if on_cpu and choice != "torch" and work_dtype in _KERNEL_DTYPES:
        kernel = _get_kernel(required=choice == "cpp")
    if kernel is None and on_cpu:
        # Each bucket makes float64 temporaries; small ones skip page faults (1.6x faster at 1e6).
        bucket_size = min(bucket_size, _TORCH_CPU_CHUNK)
    if not x.is_contiguous():
        x = _memory_order(x)
    rows: list[tuple] = []
    device_rows: list[torch.Tensor] = []
    kernel_shift: float | None = None
    torch_shift: torch.Tensor | None = None
    for bucket in _buckets(x, bucket_size):
        if on_cpu:
            bucket = bucket.cpu()
        if wide is not None:
            bucket = bucket.to(wide)
        if kernel is not None:
            rows.append(kernel.stats(bucket.contiguous(), kernel_shift))
            kernel_shift = rows[0][11]
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
