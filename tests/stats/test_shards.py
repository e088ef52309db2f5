"""Shard statistics merged exactly (probes.stats.shards), on one process: a tensor split in uneven contiguous
shards (empty ones too), each "rank"'s row computed alone, the rows merged as the all_gather would hand them;
the merged record equals numpy float64 on the whole tensor, and the record StepRows makes of the whole tensor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import assert_moments, same_values as _same
from probes.dump.columns import table_to_records
from probes.dump.rowblock import ACCUMULATED_WIDTH, Described, RecordNames
from probes.stats import kernel
from probes.stats.numerics import sample_indices
from probes.stats.rows import StepRows
from probes.stats.shards import ShardRows, ShardSpec, merge_shard_rows, shard_row

COUNT = 8  # samples per record
NAMES = RecordNames("blocks.0.fc.weight", 0, "blocks.0.fc", "Linear", "parameter", 3, "blocks.0.fc.weight", None)
EXACT = ("numel", "finite", "nan", "inf", "neg", "pos", "zero", "min", "max", "samples", "sample_indices", "shape",
         "dtype")


def _tensor(label: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if label == "specials":
        x = torch.randn(37, generator=g)
        x[[2, 20, 21, 30, 31, 36]] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, math.nan])
        return x.reshape(37)
    if label == "offset":  # mean huge next to the spread: the merge must not lose the spread
        return torch.randn(7, 5, generator=g, dtype=torch.float64) * 1e-3 + 1e4
    if label == "int64":
        return torch.tensor([-(2**62) - 1, 5, 2**62 + 1, -7, 0, 3, 11], dtype=torch.int64)  # float64 cannot hold the extremes
    if label == "all nan shard":
        x = torch.randn(10, generator=g)
        x[:4] = math.nan
        return x
    return torch.randn(3, 7, generator=g)  # 21 elements: odd, as in ZeRO-3's padded parameters


# (tensor, bounds): uneven, empty first/middle/last ranges, fewer elements than samples, a single element
CASES = {
    "two ranks, ZeRO-3 style": ("plain", ((0, 11), (11, 21))),
    "three uneven, middle empty": ("specials", ((0, 10), (10, 10), (10, 37))),
    "last rank empty": ("plain", ((0, 21), (21, 21))),
    "first rank empty": ("plain", ((0, 0), (0, 21))),
    "four, one element each but the last": ("specials", ((0, 1), (1, 2), (2, 3), (3, 37))),
    "offset": ("offset", ((0, 18), (18, 35))),
    "integer": ("int64", ((0, 4), (4, 7))),
    "a shard with no finite element": ("all nan shard", ((0, 4), (4, 10))),
}


def _reference(tensor: torch.Tensor) -> dict:
    """numpy float64 statistics of the whole tensor, written out here (not the library's)."""
    flat = tensor.reshape(-1).numpy()
    f = flat.astype(np.float64)
    good = f[np.isfinite(f)]
    mean = good.mean() if good.size else None
    integer = not tensor.dtype.is_floating_point
    return {
        "numel": f.size, "finite": good.size, "nan": int(np.isnan(f).sum()), "inf": int(np.isinf(f).sum()),
        "neg": int((f < 0).sum()), "pos": int((f > 0).sum()), "zero": int((f == 0).sum()),
        "min": (int(flat.min()) if integer else float(good.min())) if good.size else None,
        "max": (int(flat.max()) if integer else float(good.max())) if good.size else None,
        "mean": None if mean is None else float(mean),
        "std": float(np.sqrt(((good - mean) ** 2).sum() / (good.size - 1))) if good.size >= 2 else None,
        "norm": float(np.sqrt((good * good).sum())) if good.size else None,
        "sample_indices": sample_indices(f.size, COUNT),
        "samples": [int(flat[i]) if integer else float(f[i]) for i in sample_indices(f.size, COUNT)],
    }


def _merged_record(tensor: torch.Tensor, bounds: tuple) -> dict:
    spec = ShardSpec(tensor.numel(), bounds)
    flat = tensor.reshape(-1)
    rows = [shard_row(flat[start:end], spec, rank, sample_count=COUNT) for rank, (start, end) in enumerate(bounds)]
    gathered = torch.stack(rows).unsqueeze(1)  # (world, 1 tensor, width): what the all_gather hands every rank
    merged = merge_shard_rows(gathered, [spec], integer=[not tensor.dtype.is_floating_point])
    step_rows = StepRows(rank=0, sample_count=COUNT)
    described = Described(("shape", "dtype"), list(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                          integer=not tensor.dtype.is_floating_point, numel=tensor.numel())
    step_rows.add_row(NAMES, 4, "param", 9, merged[0], described)
    (block,) = step_rows.take()
    (record,) = table_to_records(block.to_table())
    return record


def _whole_record(tensor: torch.Tensor) -> dict:
    step_rows = StepRows(rank=0, sample_count=COUNT)
    assert step_rows.add_named(NAMES, 4, "param", 9, tensor) is None
    (block,) = step_rows.take()
    (record,) = table_to_records(block.to_table())
    return record


@pytest.fixture(params=["torch", "cpp"])
def backend(request, monkeypatch):
    if request.param == "cpp" and kernel.load(required=False) is None:
        pytest.skip("the C++ kernel cannot be built here")
    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_merged_shards_equal_numpy_on_the_whole_tensor(case: str, backend: str) -> None:
    label, bounds = CASES[case]
    tensor = _tensor(label)
    record = _merged_record(tensor, bounds)
    ref = _reference(tensor)
    assert (record["step"], record["phase"], record["seq"], record["name"]) == (4, "param", 9, NAMES[0])
    assert record["shape"] == list(tensor.shape)
    for key in ("numel", "finite", "nan", "inf", "neg", "pos", "zero", "min", "max", "sample_indices"):
        assert record[key] == ref[key], (case, key)
    assert _same(record["samples"], ref["samples"]), case
    # Shards' means are rounded apart (no shared shift): at mean 1e4, spread 1e-3 that bounds the std to ~1e-10
    # relative, as TensorSummary.merge documents; anywhere near a mean of 0, to the last bits.
    assert_moments(record, ref, case, rel=1e-9 if label == "offset" else 1e-12)
    # The same record as StepRows makes of the tensor read whole: counts, extremes and samples to the bit.
    whole = _whole_record(tensor)
    for key in EXACT:
        assert _same(record.get(key, "absent"), whole.get(key, "absent")), (case, key)


def test_sample_slots_come_from_the_rank_holding_each_position() -> None:
    tensor = torch.arange(100, dtype=torch.float32)
    bounds = ((0, 13), (13, 13), (13, 64), (64, 100))
    record = _merged_record(tensor, bounds)
    assert record["samples"] == [float(i) for i in sample_indices(100, COUNT)]
    assert record["mean"] == 49.5 and record["min"] == 0.0 and record["max"] == 99.0


def test_many_tensors_merge_in_one_call() -> None:
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=g) for n in (5, 1, 35, 7)]
    specs = [ShardSpec(t.numel(), ((0, math.ceil(t.numel() / 2)), (math.ceil(t.numel() / 2), t.numel())))
             for t in tensors]
    gathered = torch.stack([torch.stack([shard_row(t[slice(*spec.bounds[rank])], spec, rank, sample_count=COUNT)
                                         for t, spec in zip(tensors, specs)]) for rank in range(2)])
    merged = merge_shard_rows(gathered, specs, integer=[False] * 4)
    for index, tensor in enumerate(tensors):
        alone = merge_shard_rows(gathered[:, index:index + 1], specs[index:index + 1], integer=[False])
        used = ACCUMULATED_WIDTH + min(tensor.numel(), COUNT)  # slots past the samples are never read
        assert torch.equal(merged[index:index + 1, :used], alone[:, :used])
        f = tensor.double().numpy()
        assert merged[index, 2].item() == pytest.approx(f.mean(), rel=1e-14)  # mean
        assert merged[index, 3].item() == pytest.approx(((f - f.mean()) ** 2).sum(), rel=1e-12, abs=1e-300)  # m2
        assert merged[index, :ACCUMULATED_WIDTH].tolist()[0] == tensor.numel()


def test_shard_rows_of_one_rank_flush_into_records() -> None:
    step_rows = StepRows(rank=0, sample_count=COUNT)
    shards = ShardRows(step_rows)
    tensor = torch.randn(4, 5)
    assert shards.add(NAMES, 2, "grad", 0, tensor.reshape(-1), full_shape=(4, 5), bounds=((0, 20),), rank=0) is None
    error = shards.add(NAMES, 2, "optim", 1, torch.empty(3, device="meta"), full_shape=(3,), bounds=((0, 3),), rank=0)
    assert isinstance(error, TypeError) and len(shards) == 2
    shards.flush()
    assert len(shards) == 0
    (block,) = step_rows.take()
    grad, failed = table_to_records(block.to_table())
    whole = _whole_record(tensor)
    for key in (*EXACT, "mean", "std", "norm"):
        assert _same(grad.get(key, "absent"), whole.get(key, "absent")), key
    assert failed["unsupported"] and failed["shape"] == [3] and "mean" not in failed


def test_bounds_that_do_not_split_the_tensor_are_refused_with_what_is_wrong() -> None:
    shards = ShardRows(StepRows(rank=0, sample_count=COUNT))
    with pytest.raises(ValueError, match="contiguous ranges"):
        shards.add(NAMES, 0, "param", 0, torch.zeros(3), full_shape=(7,), bounds=((0, 3), (4, 7)), rank=0)
    with pytest.raises(ValueError, match="has 2 elements, but rank 1's bounds"):
        shards.add(NAMES, 0, "param", 0, torch.zeros(2), full_shape=(7,), bounds=((0, 4), (4, 7)), rank=1)
    with pytest.raises(ValueError, match="2 specs"):
        merge_shard_rows(torch.zeros(2, 1, ACCUMULATED_WIDTH + COUNT), [ShardSpec(1, ((0, 1), (1, 1)))] * 2,
                         integer=[False])
    assert len(shards) == 0


def test_rows_added_and_merged_read_nothing_back_to_the_host(monkeypatch) -> None:
    from benchmarks.host_reads import count_host_reads

    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", "torch")  # the path device tensors take
    tensor = torch.randn(35)
    spec = ShardSpec(35, ((0, 18), (18, 35)))
    step_rows = StepRows(rank=0, sample_count=COUNT)
    shards = ShardRows(step_rows)
    for attempt in range(2):  # the first fills the caches (sample positions, sources): once per run
        with count_host_reads() as reads:
            rows = [shard_row(tensor[start:end], spec, rank, sample_count=COUNT) for rank, (start, end) in
                    enumerate(spec.bounds)]
            merged = merge_shard_rows(torch.stack(rows).unsqueeze(1), [spec], integer=[False])
            shards.add(NAMES, attempt, "grad", 0, tensor, full_shape=(5, 7), bounds=((0, 35),), rank=0)
            shards.flush()
            step_rows.add_row(NAMES, attempt, "param", 1, merged[0], Described(("shape", "dtype"), [5, 7], "float32",
                                                                             numel=35))
    assert reads.total == 0, reads.describe()
    mean = pytest.approx(float(tensor.double().numpy().mean()), rel=1e-12)
    records = table_to_records(step_rows.take()[-1].to_table())
    assert [(record["phase"], record["mean"]) for record in records] == [("grad", mean), ("param", mean)]
