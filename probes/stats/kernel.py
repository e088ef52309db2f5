"""The fused C++ statistics kernel: its build (once per torch version and CPU), its load, its named row.

    k = load(required=False)                 # a Kernel, or None (warned once) when it cannot be built
    row = k.stats(x) if k else None          # a KernelRow: row.numel, row.mean, ..., row.shift, row.deviation
    mean, m2 = row_getter("mean", "m2")(k.stats_tuple(x))   # the hot path: fields by name, no NamedTuple

``_stats_kernel.cpp`` is built with ``torch.utils.cpp_extension.load_inline`` into torch's extension
cache, under a name that carries the row's version, the torch version and the vector ISA. The module
says which fields its row has (``row_fields()``); a load checks them against ``KernelRow``, so the
C++ tuple and the Python names cannot drift apart. ``backend()`` tells which backend CPU tensors use;
``PROBES_NUMERICS_BACKEND=torch|cpp`` forces one. The variable is read each time a backend is chosen
(``default_backend()``: each ``summarize()`` without ``backend=``, each new subscriber's rows), so it may
be set after import. The kernel's build is tried once per process and never reset: a failed build is not
retried, and ``cpp`` chosen later raises its error.
"""

from __future__ import annotations

import operator
import os
import platform
import re
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, NamedTuple

import torch

from ..dump.statistics import ACCUMULATED
from ..utils.extensions import BuiltOnce, build_inline

__all__ = ["BACKENDS", "KERNEL_DTYPES", "Kernel", "KernelRow", "backend", "default_backend", "load",
           "resolve_backend", "row_getter"]

# Bump when the row changes: a build under the old name is then not reused from the shared cache.
ROW_VERSION = 5

KERNEL_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
})

BACKENDS = ("auto", "cpp", "torch")


# The statistics of one bucket: the registry's accumulated statistics (``probes.dump.statistics``), in
# its order, then the mean as ``shift + deviation``. Buckets of one tensor share one shift (the first
# bucket's), so they combine without rounding at the size of the mean. The kernel's integer min/max are
# python ints; mean, min and max are None when no element is finite.
KernelRow = NamedTuple("KernelRow", [*((stat.name, Any) for stat in ACCUMULATED), ("shift", float),
                                     ("deviation", float)])  # type: ignore[misc]
KernelRow.__doc__ = ("The statistics of one bucket, by name: ``row.numel``, ``row.mean``, ..., then "
                     "``row.shift + row.deviation`` (the mean, split so that buckets combine exactly).")


def row_getter(*names: str) -> operator.itemgetter:
    """A getter of the named fields of a KernelRow, or of a plain tuple in its order (``Kernel.stats_tuple``).

        extremes = row_getter("min", "max")   # extremes(row) == (row.min, row.max)
    """
    unknown = [name for name in names if name not in KernelRow._fields]
    if unknown:
        raise ValueError(f"KernelRow has no field {unknown[0]!r}; its fields are {KernelRow._fields}")
    return operator.itemgetter(*map(KernelRow._fields.index, names))


class Kernel:
    """The loaded C++ module, with rows read by name.

        row = kernel.stats(bucket, shift)   # shift: None, or the first bucket's row.shift

    ``stats_tuple`` is the module's own function: the same row as a plain tuple in KernelRow's order
    (checked on load), for a caller that reads it with ``row_getter`` and skips the NamedTuple.
    """

    __slots__ = ("fast_row", "hash_into", "row_into", "stats_tuple")
    stats_tuple: Callable[[torch.Tensor, float | None], tuple]
    # row_into(x, out, row, indices): the accumulated statistics, then the samples, into a float64 row
    # (probes.stats.rows); integer min/max and samples as int64 bit patterns.
    row_into: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], None]
    # fast_row(x, out, row, count, limit): row_into of a plain contiguous CPU tensor of a kernel dtype with
    # 0 < numel <= limit, its samples at numerics.sample_indices(numel, count), all checks in the one call;
    # False (nothing written) for any other tensor. The record path's common case (probes.stats.rows).
    fast_row: Callable[[torch.Tensor, torch.Tensor, int, int, int], bool]
    # hash_into(x, out, row, col): probes.stats.hashing's hash of a contiguous CPU tensor's bytes, as int64
    # bits into out[row, col].
    hash_into: Callable[[torch.Tensor, torch.Tensor, int, int], None]

    def __init__(self, module: ModuleType) -> None:
        fields = tuple(module.row_fields())
        if fields != KernelRow._fields:
            raise RuntimeError(
                f"probes stats kernel: its row fields {fields} differ from KernelRow's {KernelRow._fields}; "
                "change _stats_kernel.cpp's row_fields() and probes/stats/kernel.py together (and bump ROW_VERSION)"
            )
        self.stats_tuple = module.stats
        self.row_into = module.row_into
        self.fast_row = module.fast_row
        self.hash_into = module.hash_into

    def stats(self, x: torch.Tensor, shift: float | None = None) -> KernelRow:
        """Statistics of a contiguous CPU tensor of a KERNEL_DTYPES dtype."""
        # KernelRow._make without its length check, which the field check on load made redundant.
        return tuple.__new__(KernelRow, self.stats_tuple(x, shift))


def resolve_backend(choice: str) -> str:
    """``choice`` in lower case; a ValueError unless it is one of BACKENDS."""
    choice = choice.lower()
    if choice not in BACKENDS:
        raise ValueError(f"unknown statistics backend {choice!r}; expected one of {BACKENDS}")
    return choice


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


def _build() -> Kernel:
    source = Path(__file__).with_name("_stats_kernel.cpp").read_text()
    isa, isa_flags = _isa_flags()
    # One build per torch version and ISA: the torch_extensions cache is shared by all venvs.
    version = re.sub(r"[^0-9a-zA-Z]+", "_", torch.__version__)
    name = f"probes_stats_v{ROW_VERSION}_torch{version}_{isa}"
    return Kernel(build_inline(name, source, ["-O3", "-ffp-contract=fast", *isa_flags]))


class _StatsKernel:
    """The kernel of this process: loaded once, or the error of its one failed build; the backend setting.

    Process-wide: a loaded extension module stays in the interpreter (it cannot be unloaded), and a
    build takes seconds, so it is tried once per process; its failure is warned about once.
    """

    def __init__(self, build: Callable[[], Kernel]) -> None:
        self._kernel = BuiltOnce(build, required="probes.stats: the C++ statistics kernel was requested but could "
                                 "not be built", fallback="probes.stats: building the C++ statistics kernel failed; "
                                 "using the slower torch path")
        self._ignored_settings: set[str] = set()  # invalid PROBES_NUMERICS_BACKEND values warned about

    def default_backend(self) -> str:
        choice = os.environ.get("PROBES_NUMERICS_BACKEND", "auto").strip().lower() or "auto"
        if choice not in BACKENDS:
            if choice not in self._ignored_settings:
                self._ignored_settings.add(choice)
                warnings.warn(f"PROBES_NUMERICS_BACKEND={choice!r} is not one of {BACKENDS}; using auto")
            return "auto"
        return choice

    def load(self, *, required: bool) -> Kernel | None:
        return self._kernel.load(required=required, stacklevel=5)


_STATS_KERNEL = _StatsKernel(_build)


def default_backend() -> str:
    """What ``PROBES_NUMERICS_BACKEND`` asks for now: "auto" (unset or invalid, warned once), "cpp" or "torch"."""
    return _STATS_KERNEL.default_backend()


def load(*, required: bool) -> Kernel | None:
    """The kernel (built on first use), or None (warning once) if it cannot be built and was not required."""
    return _STATS_KERNEL.load(required=required)


def backend() -> str:
    """The backend summarize() uses for CPU tensors: "cpp" (fused kernel) or "torch".

        backend()   # "cpp" where a C++ compiler is installed
    """
    choice = default_backend()
    if choice == "torch":
        return "torch"
    return "cpp" if load(required=choice == "cpp") is not None else "torch"
