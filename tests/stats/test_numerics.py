"""probes.stats.numerics against an independent numpy float64 reference, on both backends."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from probes.stats.numerics import TensorSummary, sample_indices, summarize, take_samples

BACKENDS = ["cpp", "torch"]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


# --- the reference ----------------------------------------------------------------------------------


def reference(t: torch.Tensor) -> dict:
    """The statistics computed by numpy in float64 from the tensor's values (its own code path)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()  # exact widening; numpy has no bfloat16
    a = t.numpy().reshape(-1)
    f = a.astype(np.float64)
    good = f[np.isfinite(f)]
    if t.dtype.is_floating_point:
        lo = float(good.min()) if good.size else None
        hi = float(good.max()) if good.size else None
    else:
        ints = a.astype(np.int64)  # exact, unlike float64 beyond 2**53
        lo, hi = int(ints.min()), int(ints.max())
    return {
        "numel": a.size,
        "finite": good.size,
        "mean": float(np.mean(good)) if good.size else None,
        "std": float(np.std(good, ddof=1)) if good.size >= 2 else None,
        "norm": float(np.sqrt(np.sum(good * good))) if good.size else None,
        "min": lo,
        "max": hi,
        "nan": int(np.isnan(f).sum()),
        "inf": int(np.isinf(f).sum()),
        "neg": int((f < 0).sum()),
        "pos": int((f > 0).sum()),
        "zero": int((f == 0).sum()),
    }


def assert_matches(s: TensorSummary, ref: dict, rtol: float = 1e-12) -> None:
    for key in ("numel", "finite", "nan", "inf", "neg", "pos", "zero"):
        assert getattr(s, key) == ref[key], key
    assert s.min == ref["min"] and s.max == ref["max"]
    assert type(s.min) is type(ref["min"]) and type(s.max) is type(ref["max"])
    if ref["mean"] is None:
        assert s.mean is None
    else:
        scale = abs(ref["mean"]) + (ref["std"] or 0.0)
        assert abs(s.mean - ref["mean"]) <= rtol * scale, (s.mean, ref["mean"])
    if ref["std"] is None:
        assert s.std is None
    else:
        assert s.std == pytest.approx(ref["std"], rel=rtol, abs=1e-300), (s.std, ref["std"])
    if ref["norm"] is None:
        assert s.norm is None
    elif math.isfinite(ref["norm"]):  # numpy's sum of squares overflows where m2 + n * mean^2 may not
        assert s.norm == pytest.approx(ref["norm"], rel=rtol, abs=1e-300), (s.norm, ref["norm"])


def assert_close(a: TensorSummary, b: TensorSummary, rtol: float = 1e-12) -> None:
    """Same counts/min/max exactly, same mean/std to rtol."""
    for key in ("numel", "finite", "min", "max", "nan", "inf", "neg", "pos", "zero"):
        assert getattr(a, key) == getattr(b, key), key
    for key in ("mean", "std", "norm"):
        x, y = getattr(a, key), getattr(b, key)
        assert (x is None) == (y is None), key
        if x is not None:
            assert x == pytest.approx(y, rel=rtol, abs=1e-300), key


def specials(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, math.nan], dtype=dtype)


def sample(dtype: torch.dtype, n: int = 5000, seed: int = 0) -> torch.Tensor:
    """n values of dtype spanning several kernel blocks plus a tail; floats carry nan/inf/+-0."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.3
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -1000), min(info.max, 1000)
        return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
    x[1234:1240] = specials(dtype)  # inside a full block: forces that block onto the scalar path
    x[-3:] = specials(dtype)[:3]  # in the tail
    x[100] = 0.0
    return x


# --- every dtype ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_dtypes_match_numpy(backend: str, dtype: torch.dtype) -> None:
    x = sample(dtype)
    s = summarize(x, backend=backend)
    ref = reference(x)
    assert_matches(s, ref)
    if dtype.is_floating_point:
        assert (s.nan, s.inf) == (3, 4)  # concrete: specials() once, then its first three
    assert_close(summarize(x, bucket_size=777, backend=backend), s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concrete_small_case(backend: str) -> None:
    x = torch.tensor([1.0, 2.0, 4.0, math.nan, -math.inf, -0.0, 0.0, -3.0])
    s = summarize(x, backend=backend)
    finite = [1.0, 2.0, 4.0, -0.0, 0.0, -3.0]
    assert (s.numel, s.finite, s.nan, s.inf, s.neg, s.pos, s.zero) == (8, 6, 1, 1, 2, 3, 2)
    assert (s.min, s.max) == (-3.0, 4.0)
    assert s.mean == pytest.approx(4.0 / 6, rel=1e-15)
    assert s.std == pytest.approx(float(np.std(finite, ddof=1)), rel=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_zero_in_a_vector_block(backend: str) -> None:
    x = torch.randn(4096)
    x[[5, 77, 2000]] = -0.0
    x[3000] = 0.0
    s = summarize(x, backend=backend)
    assert_matches(s, reference(x))
    assert s.zero == 4


# --- shapes and layouts -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_dim_and_empty(backend: str) -> None:
    s = summarize(torch.tensor(2.5), backend=backend)
    assert (s.numel, s.finite, s.mean, s.min, s.max, s.pos, s.std) == (1, 1, 2.5, 2.5, 2.5, 1, None)
    s = summarize(torch.tensor(-7, dtype=torch.int64), backend=backend)
    assert (s.mean, s.min, s.max, s.neg) == (-7.0, -7, -7, 1)
    for empty in (torch.empty(0), torch.empty(0, 3, dtype=torch.int32)):
        assert summarize(empty, backend=backend) == TensorSummary.empty()


def layouts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(37, 53, generator=g)
    image = torch.randn(2, 5, 7, 9, generator=g)
    return {
        "transposed": base.t(),
        "row_step": base[::3],
        "col_step": base[:, 1::2],
        "both_steps": base[1::2, ::5],
        "channels_last": image.contiguous(memory_format=torch.channels_last),
        "channels_last_sliced": image.contiguous(memory_format=torch.channels_last)[:, 1:4, ::2],
        "expanded": torch.randn(1, 53, generator=g).expand(37, 53),
        "one_d_step": torch.randn(999, generator=g)[::7],
        "permuted_3d": torch.randn(4, 6, 8, generator=g).permute(2, 0, 1),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(layouts()))
def test_non_contiguous(backend: str, name: str) -> None:
    x = layouts()[name]
    ref = reference(x)
    assert_matches(summarize(x, backend=backend), ref)
    for bucket_size in (1, 10, 100):
        assert_matches(summarize(x, bucket_size=bucket_size, backend=backend), ref)


# --- adversarial values -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_huge_offset_has_no_cancellation(backend: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (1e4 + 1e-3 * torch.randn(20000, generator=g, dtype=torch.float64)).to(dtype)
    ref = reference(x)
    assert ref["std"] > 1e-4  # the data really has the tiny spread
    for bucket_size in (1 << 22, 5000, 333, 64):
        assert_matches(summarize(x, bucket_size=bucket_size, backend=backend), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_whose_sum_overflows_float16(backend: str) -> None:
    x = torch.full((10000,), 60000.0, dtype=torch.float16)
    x[::2] = 49984.0  # representable, unlike 50000
    assert torch.isinf(x.sum())  # float16 accumulation overflows (max 65504)
    s = summarize(x, backend=backend)
    assert_matches(s, reference(x))
    assert s.mean == 54992.0 and s.inf == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_beyond_2_pow_53_keeps_exact_min_max(backend: str) -> None:
    values = [2**62 + 1, 2**62 + 3, 2**63 - 1, -(2**63), 2**53 + 1, -(2**53) - 1] * 300
    x = torch.tensor(values, dtype=torch.int64)
    s = summarize(x, backend=backend)
    assert s.min == -(2**63) and s.max == 2**63 - 1
    assert type(s.min) is int and type(s.max) is int
    ref = reference(x)
    assert s.mean == pytest.approx(ref["mean"], rel=1e-9)
    assert s.std == pytest.approx(ref["std"], rel=1e-9)
    s = summarize(torch.tensor([2**62 + 1, 2**62 + 3], dtype=torch.int64), backend=backend)
    assert (s.min, s.max) == (2**62 + 1, 2**62 + 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_finite_and_single_finite(backend: str) -> None:
    x = torch.tensor([math.nan, math.inf, -math.inf] * 500)
    s = summarize(x, backend=backend)
    assert (s.finite, s.mean, s.std, s.min, s.max) == (0, None, None, None, None)
    assert (s.nan, s.inf, s.neg, s.pos, s.zero) == (500, 1000, 500, 500, 0)
    d = json.loads(json.dumps(s.to_dict()))
    assert d["std"] is None and d["min"] is None and d["mean"] is None
    s = summarize(torch.tensor([math.nan, 3.0, math.inf]), backend=backend)
    assert (s.finite, s.mean, s.std, s.min, s.max, s.m2) == (1, 3.0, None, 3.0, 3.0, 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_min_max_are_ints(backend: str) -> None:
    s = summarize(torch.tensor([True, False, True]), backend=backend)
    assert (s.min, s.max, s.pos, s.zero, s.neg) == (0, 1, 2, 1, 0)
    assert type(s.min) is int
    assert s.mean == pytest.approx(2 / 3, rel=1e-15)


# --- buckets, backends, merging ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
def test_buckets_equal_one_bucket(backend: str, dtype: torch.dtype) -> None:
    x = sample(dtype, n=12000, seed=3)
    whole = summarize(x, backend=backend)
    for bucket_size in (7, 1000, 1024, 4097):
        assert_close(summarize(x, bucket_size=bucket_size, backend=backend), whole)
    assert_close(summarize(x, bucket_size=1000, run_on_cpu=True, backend=backend), whole)
    head = x[:300]
    assert_close(summarize(head, bucket_size=1, backend=backend), summarize(head, backend=backend))


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_backends_agree(dtype: torch.dtype) -> None:
    x = sample(dtype, n=20000, seed=4)
    assert_close(summarize(x, backend="cpp"), summarize(x, backend="torch"))


def parts_of(x: torch.Tensor, cuts: list[int]) -> list[TensorSummary]:
    bounds = [0, *cuts, x.numel()]
    return [summarize(x[a:b]) for a, b in zip(bounds, bounds[1:])]


def test_merge_of_parts_equals_whole() -> None:
    x = sample(torch.float32, n=10000, seed=5)
    whole = summarize(x)
    a, b = parts_of(x, [3000])
    assert_close(a.merge(b), whole)
    p, q, r = parts_of(x, [1234, 7000])
    assert_close(p.merge(q).merge(r), whole)
    assert_close(p.merge(q.merge(r)), whole)
    assert_close(r.merge(p).merge(q), whole)


def test_merge_is_commutative_bitwise_and_empty_is_identity() -> None:
    x = 1e4 + 1e-3 * torch.randn(5000, dtype=torch.float64)
    a, b = parts_of(x, [1700])
    assert a.merge(b) == b.merge(a)
    assert a.merge(TensorSummary.empty()) == a == TensorSummary.empty().merge(a)
    assert TensorSummary.empty().merge(TensorSummary.empty()) == TensorSummary.empty()
    # Two float64 means each carry up to half an ulp of 1e4 (~1e-12), which is ~1e-9 of this
    # spread: merging summaries (not buckets, which share a shift) is accurate to that limit.
    assert_close(a.merge(b), summarize(x), rtol=1e-10)


def test_merge_with_nothing_finite_part() -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    merged = summarize(x).merge(summarize(torch.tensor([math.nan, -math.inf])))
    assert (merged.numel, merged.finite, merged.mean, merged.min, merged.max) == (5, 3, 2.0, 1.0, 3.0)
    assert (merged.nan, merged.inf, merged.neg, merged.pos) == (1, 1, 1, 3)
    assert merged.std == pytest.approx(1.0, rel=1e-15)


# --- dict / JSON ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
def test_dict_round_trip_and_json(dtype: torch.dtype) -> None:
    s = summarize(sample(dtype, n=3000, seed=6))
    d = s.to_dict()
    assert d["std"] == s.std
    fields = {"numel", "finite", "mean", "m2", "min", "max", "nan", "inf", "neg", "pos", "zero"}
    assert set(d) == fields | {"std", "norm"}
    assert TensorSummary.from_dict(d) == s
    back = TensorSummary.from_dict(json.loads(json.dumps(d)))
    assert back == s
    assert type(back.min) is type(s.min)
    assert TensorSummary.from_dict(TensorSummary.empty().to_dict()) == TensorSummary.empty()


# --- samples ----------------------------------------------------------------------------------------


def test_sample_indices_properties() -> None:
    for numel, count in [(10, 3), (1000, 16), (17, 16), (2**40, 64), (5, 2)]:
        idx = sample_indices(numel, count)
        assert len(idx) == count
        assert idx[0] == 0 and idx[-1] == numel - 1
        assert all(a < b for a, b in zip(idx, idx[1:]))
        assert idx == sample_indices(numel, count)
    assert sample_indices(10, 3) == [0, 4, 9]
    assert sample_indices(5, 5) == sample_indices(5, 50) == [0, 1, 2, 3, 4]
    assert sample_indices(7, 1) == [0]
    assert sample_indices(0, 4) == sample_indices(9, 0) == []
    idx = sample_indices(1000, 16)
    gaps = [b - a for a, b in zip(idx, idx[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spread


def test_take_samples_follows_logical_row_major_order() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    x = base.t()[:, ::2]  # non-contiguous view, shape (10, 3)
    idx = [0, 1, 2, 3, 29]
    assert take_samples(x, idx) == [0.0, 20.0, 40.0, 1.0, 49.0]
    assert take_samples(x, idx) == [x.reshape(-1)[i].item() for i in idx]
    y = torch.tensor([[math.nan, 1.5], [math.inf, -math.inf]], dtype=torch.bfloat16)
    got = take_samples(y, [0, 1, 2, 3])
    assert math.isnan(got[0]) and got[1:] == [1.5, math.inf, -math.inf]
    assert all(type(v) is float for v in got)
    assert take_samples(torch.tensor([2**62 + 1, -5]), [0, 1]) == [2**62 + 1, -5]
    assert take_samples(torch.tensor([True, False]), [0, 1]) == [1, 0]
    assert take_samples(torch.tensor(3.0), [0]) == [3.0]
    assert take_samples(x, []) == []
    with pytest.raises(IndexError):
        take_samples(x, [30])
    assert json.dumps(take_samples(x, sample_indices(x.numel(), 4)))


def test_bad_arguments() -> None:
    with pytest.raises(TypeError):
        summarize(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError):
        summarize(torch.zeros(3), bucket_size=0)
    with pytest.raises(ValueError):
        summarize(torch.zeros(3), backend="fast")


def test_requires_grad_and_no_graph() -> None:
    w = torch.randn(100, requires_grad=True)
    for backend in BACKENDS:
        s = summarize(w * 2, backend=backend)
        assert s.numel == 100 and s.mean == pytest.approx(2 * w.detach().double().mean().item(), rel=1e-12)


def test_torch_path_reads_back_once_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"tolist": 0, "item": 0}
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counting_tolist(self: torch.Tensor):  # type: ignore[no-untyped-def]
        calls["tolist"] += 1
        return tolist(self)

    def counting_item(self: torch.Tensor):  # type: ignore[no-untyped-def]
        calls["item"] += 1
        return item(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    summarize(sample(torch.float32, n=5000), bucket_size=512, backend="torch")
    assert calls == {"tolist": 1, "item": 0}


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 32, 33, 1000, 10**12 + 7])
@pytest.mark.parametrize("count", [0, 1, 2, 5, 32, 33])
def test_the_device_sample_indices_are_the_host_ones(numel: int, count: int) -> None:
    from probes.stats.numerics import sample_index_tensor

    assert sample_index_tensor(numel, count, torch.device("cpu")).tolist() == sample_indices(numel, count)
