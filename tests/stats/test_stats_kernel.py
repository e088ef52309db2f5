"""The C++ statistics kernel: its named row, checked against the module's own field names, and the
backend choice (PROBES_NUMERICS_BACKEND, read when a backend is chosen) with its warn-once fallback to
the torch path."""

from __future__ import annotations

import math
import warnings
from typing import Callable

import pytest
import torch

from probes.stats import kernel, numerics
from probes.stats.kernel import Kernel, KernelRow, row_getter
from probes.stats.numerics import summarize
from probes.stats.rows import StepRows


def unloaded(monkeypatch: pytest.MonkeyPatch, *, build: Callable[[], Kernel]) -> None:
    """The kernel module as before its first load (restored after the test), building with ``build``."""
    monkeypatch.setattr(kernel, "_STATS_KERNEL", kernel._StatsKernel(build))


def test_the_row_is_named_by_the_module() -> None:
    fused = kernel.load(required=True)
    assert fused is not None
    row = fused.stats(torch.tensor([1.0, 3.0, math.nan]))
    assert type(row) is KernelRow
    assert (row.numel, row.finite, row.mean, row.m2, row.min, row.max) == (3, 2, 2.0, 2.0, 1.0, 3.0)
    assert (row.nan, row.inf, row.neg, row.pos, row.zero) == (1, 0, 0, 2, 0)
    assert (row.shift, row.deviation) == (1.0, 1.0)  # the first finite value, and mean - shift
    assert fused.stats(torch.tensor([5, 7]), 4.0).shift == 4.0  # a given shift is kept
    assert numerics.backend is kernel.backend


def test_row_getter_reads_a_row_or_its_plain_tuple_by_name() -> None:
    fused = kernel.load(required=True)
    assert fused is not None
    x = torch.tensor([2.0, -1.0, math.inf])
    row, raw = fused.stats(x), fused.stats_tuple(x, None)
    assert type(raw) is tuple and raw == tuple(row)
    extremes = row_getter("min", "max")
    assert extremes(row) == extremes(raw) == (row.min, row.max) == (-1.0, 2.0)
    assert row_getter("deviation")(raw) == row.deviation
    with pytest.raises(ValueError, match="KernelRow has no field 'std'"):
        row_getter("mean", "std")


class _Drifted:
    """A build of the kernel whose row has a field more than KernelRow."""

    @staticmethod
    def row_fields() -> tuple[str, ...]:
        return (*KernelRow._fields, "extra")

    @staticmethod
    def stats(x: torch.Tensor, shift: float | None = None) -> tuple:
        raise AssertionError("a row of unknown layout must never be read")


def test_a_row_that_drifted_from_kernelrow_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match=r"row fields .*'extra'.* differ from KernelRow's"):
        Kernel(_Drifted)  # type: ignore[arg-type]
    unloaded(monkeypatch, build=lambda: Kernel(_Drifted))  # type: ignore[arg-type]
    x = torch.tensor([1.0, 2.0, math.nan])
    with pytest.raises(RuntimeError, match="could not be built:\n.*differ from KernelRow"):
        summarize(x, backend="cpp")
    with pytest.warns(RuntimeWarning, match="differ from KernelRow"):
        s = summarize(x)
    assert (s.finite, s.mean, s.nan) == (2, 1.5, 1)


def test_backend_is_the_kernel_here() -> None:
    assert numerics.backend() == "cpp"  # gcc is on these machines: the kernel must build


def test_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Kernel:
        raise RuntimeError("Error building extension 'x':\nmain.cpp:1:1: error: expected something\nmore")

    unloaded(monkeypatch, build=broken)
    x = torch.tensor([1.0, 2.0, math.nan])
    with pytest.warns(RuntimeWarning, match="error: expected something"):
        s = summarize(x)
    assert (s.finite, s.mean, s.nan) == (2, 1.5, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summarize(x)
        assert numerics.backend() == "torch"
    with pytest.raises(RuntimeError, match="could not be built"):
        summarize(x, backend="cpp")


def test_the_backend_variable_is_read_when_a_backend_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.tensor([1.0, 2.0, math.nan])
    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", "torch")
    assert kernel.default_backend() == numerics.backend() == "torch"
    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", " CPP ")
    assert kernel.default_backend() == numerics.backend() == "cpp"
    monkeypatch.delenv("PROBES_NUMERICS_BACKEND")
    assert kernel.default_backend() == "auto"

    def broken() -> Kernel:
        raise RuntimeError("Error building extension 'x':\nmain.cpp:1:1: error: expected something")

    unloaded(monkeypatch, build=broken)
    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torch backend never tries the build
        assert summarize(x).mean == 1.5 and StepRows(rank=0, sample_count=0)._kernel is None
    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", "cpp")
    with pytest.raises(RuntimeError, match="could not be built"):
        summarize(x)
    with pytest.raises(RuntimeError, match="could not be built"):
        StepRows(rank=0, sample_count=0)


def test_an_unknown_backend_variable_warns_once_and_means_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    built = kernel.load(required=True)
    unloaded(monkeypatch, build=lambda: built)
    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", "fortran")
    with pytest.warns(UserWarning, match=r"PROBES_NUMERICS_BACKEND='fortran' is not one of \('auto', 'cpp', 'torch'\); using auto"):
        assert kernel.default_backend() == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel.default_backend() == "auto" and numerics.backend() == "cpp"


def test_fast_row_writes_row_into_s_row_and_declines_every_other_tensor() -> None:
    fused = kernel.load(required=True)
    assert fused is not None
    torch.manual_seed(0)
    cases = [(torch.randn(4, 8), 32), (torch.randn(100).to(torch.bfloat16), 7), (torch.randn(5).half(), 32),
             (torch.randint(-9, 9, (3, 5)), 1), (torch.tensor([True, False, True]), 2), (torch.randn(7).double(), 0),
             (torch.tensor([math.nan, -math.inf, 0.0, 2.5]), 3), (torch.arange(1000, dtype=torch.int32), 32)]
    for x, count in cases:
        width = 11 + count
        fast, slow = torch.full((3, width), 7.0, dtype=torch.float64), torch.full((3, width), 7.0, dtype=torch.float64)
        assert fused.fast_row(x, fast, 1, count, 4096) is True
        taken = min(count, x.numel())
        fused.row_into(x, slow, 1, numerics.sample_index_tensor(x.numel(), count, torch.device("cpu")))
        # bit for bit (nan where no element is finite), the rest of the buffer untouched
        assert torch.equal(fast.view(torch.int64), slow.view(torch.int64)), (x.dtype, count)
        assert (fast[1, 11 + taken:] == 7.0).all() and (fast[[0, 2]] == 7.0).all()
    out = torch.full((2, 43), 7.0, dtype=torch.float64)
    declined = [torch.randn(6, 6)[::2], torch.randn(4, 4).t(), torch._neg_view(torch.randn(3, 3)), torch.empty(0),
                torch.randn(65), torch.randn(2, dtype=torch.complex64), torch.zeros(3, dtype=torch.float8_e4m3fn),
                torch.randn(3, device="meta"), torch.randn(5).to_sparse()]
    for x in declined:
        assert fused.fast_row(x, out, 0, 32, 64) is False, x
    assert (out == 7.0).all()  # nothing written
    with pytest.raises(TypeError, match=r"fast_row\(x: Tensor, out: Tensor"):
        fused.fast_row(torch.randn(3), out, 0, 32)
    with pytest.raises(RuntimeError, match="row out of range"):
        fused.fast_row(torch.randn(3), out, 2, 32, 64)
