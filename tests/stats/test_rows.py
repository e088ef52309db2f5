"""Statistics rows (probes.stats.rows) and their columns (probes.dump.rowblock): the kernel path and the torch
path (what device tensors take) give the same records, numpy float64 agrees with both, and the columns built
from rows are the ones ``records_to_table`` builds from the same records."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from helpers import assert_moments, same_values as _same
from probes.dump.columns import records_to_table, table_to_records, write_parquet
from probes.dump.rowblock import EntryColumns, RecordNames
from probes.dump.statistics import ACCUMULATED, DERIVED, STATISTICS, names
from probes.stats import kernel
from probes.stats.rows import StepRows

NAMES = RecordNames("t.output.0", 0, "t", "T", "output", 1, "T_0_0th_output", None)
EXACT = ("numel", "finite", "nan", "inf", "neg", "pos", "zero", "min", "max", "samples", "sample_indices", "shape",
         "dtype", "stats_of", "layout")


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 11, generator=g)
    specials = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.5, -2.5])
    return {
        "float32": x,
        "float64 offset": x.double() * 1e-3 + 1e4,
        "float16": x.half(),
        "bfloat16": x.bfloat16(),
        "specials": specials,
        "all nan": torch.full((5,), math.nan),
        "empty": torch.empty(0, 3),
        "one": torch.tensor([3.0]),
        "transposed": x.t(),
        "expanded": torch.ones(1, 4).expand(6, 4),
        "int64 extremes": torch.tensor([-(2**63), 2**63 - 1, 0, 7]),
        "int8": torch.randint(-128, 127, (50,), dtype=torch.int8, generator=g),
        "uint8": torch.randint(0, 255, (50,), dtype=torch.uint8, generator=g),
        "bool": torch.rand(40, generator=g) > 0.5,
        "complex": torch.randn(6, dtype=torch.complex64, generator=g),
        "big": torch.randn(5000, generator=g),
    }


def rows_of(values: dict[str, torch.Tensor], *, torch_path: bool, bucket_size: int = 1 << 22) -> list[dict]:
    rows = StepRows(rank=0, sample_count=8, bucket_size=bucket_size)
    if torch_path:
        rows._kernel = None  # the path every device tensor takes, here on the CPU
    for seq, tensor in enumerate(values.values()):
        assert rows.add_named(NAMES, 0, "forward", seq, tensor) is None
    (block,) = rows.take()
    table = block.to_table()
    records = table_to_records(block.to_table())
    # The columns built from rows are exactly the ones records_to_table builds from the same records.
    expected = records_to_table(records)
    assert table.schema.equals(expected.schema)
    for name in table.column_names:
        assert _same(table.column(name).to_pylist(), expected.column(name).to_pylist()), name
    return records


def reference(tensor: torch.Tensor) -> dict:
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    a = tensor.detach().float().numpy().reshape(-1) if tensor.dtype in (torch.float16, torch.bfloat16) \
        else tensor.detach().numpy().reshape(-1)
    f = a.astype(np.float64)
    good = f[np.isfinite(f)]
    return {"numel": a.size, "finite": good.size, "mean": float(good.mean()) if good.size else None,
            "std": float(good.std(ddof=1)) if good.size >= 2 else None,
            "norm": float(np.sqrt((good * good).sum())) if good.size else None,
            "nan": int(np.isnan(f).sum()), "inf": int(np.isinf(f).sum())}


@pytest.mark.parametrize("bucket_size", [1 << 22, 7], ids=["one bucket", "buckets of 7"])
def test_kernel_and_torch_paths_agree_and_match_numpy(bucket_size: int) -> None:
    if kernel.load(required=False) is None:
        pytest.skip("the C++ kernel cannot be built here")
    values = tensors()
    fused = rows_of(values, torch_path=False, bucket_size=bucket_size)
    plain = rows_of(values, torch_path=True, bucket_size=bucket_size)
    for (label, tensor), a, b in zip(values.items(), fused, plain, strict=True):
        for key in EXACT:
            assert _same(a.get(key, "absent"), b.get(key, "absent")), (label, key, a.get(key), b.get(key))
        ref = reference(tensor)
        for record in (a, b):
            for key in ("numel", "finite", "nan", "inf"):
                assert record[key] == ref[key], (label, key)
            assert_moments(record, ref, label)
    extremes = fused[list(values).index("int64 extremes")]
    assert (extremes["min"], extremes["max"]) == (-(2**63), 2**63 - 1)  # exact: int64 bit patterns in the rows


def test_a_record_without_statistics_and_one_with_share_a_block() -> None:
    rows = StepRows(rank=2, sample_count=4)
    rows.add_named(NAMES, 5, "backward", 0, torch.randn(3))
    error = rows.add_named(NAMES, 5, "backward", 1, torch.empty(2, device="meta"))
    assert isinstance(error, TypeError)
    (block,) = rows.take()
    first, second = table_to_records(block.to_table())
    assert first["rank"] == 2 and first["step"] == 5 and "unsupported" not in first
    assert second["unsupported"] and second["dtype"] == "float32" and "mean" not in second
    assert rows.take() == []


def test_steps_get_a_block_each_and_the_rows_are_read_once_per_call() -> None:
    rows = StepRows(rank=0, sample_count=2)
    for step in (0, 0, 1):
        rows.add_named(NAMES, step, "forward", step, torch.tensor([1.0, math.nan]))
    seen = []
    rows.anomalies(lambda stats, entries: seen.append((stats[:, 0].tolist(), len(entries))))
    rows.anomalies(lambda stats, entries: seen.append("again"))  # nothing new since the last read
    assert seen == [([1.0, 1.0, 1.0], 3)]
    blocks = rows.take()
    assert [(block.step, len(block.entries)) for block in blocks] == [(0, 2), (1, 1)]


def test_the_registry_is_what_the_views_show() -> None:
    assert [stat.name for stat in ACCUMULATED] == list(kernel.KernelRow._fields[:len(ACCUMULATED)])
    assert {stat.name for stat in DERIVED} == {"std", "norm"}
    assert names(compared="moment") == ("min", "max", "mean", "std", "norm")
    assert names(compared="count") == ("nan", "inf")
    assert all(pa.types.is_integer(records_to_table([]).schema.field(stat.name).type) == (stat.column == "int")
               for stat in STATISTICS)


class _StaleColumns(EntryColumns):
    """Takes the last block's columns again whatever the entries hold: what the identity check prevents."""

    def find(self, names, phases, described):  # type: ignore[no-untyped-def]
        return self._built


def _same_table(a: pa.Table, b: pa.Table) -> bool:
    return a.schema.equals(b.schema) and all(_same(a.column(name).to_pylist(), b.column(name).to_pylist())
                                             for name in a.column_names)


def test_columns_taken_again_from_the_last_step_are_the_ones_built_afresh(tmp_path: Path) -> None:
    site_a, site_b, site_c = (RecordNames("a.output.0", 0, "a", "A", "output", 1, "A_0_0th_output", None),
                              RecordNames("b.output.0", 0, "b", "B", "output", 1, "B_0_0th_output", None),
                              RecordNames("c.output.0", 0, "c", "C", "output", 2, "C_0_0th_output", None))
    g = torch.Generator().manual_seed(0)
    steps = [  # (names, phase, tensor) per record, step after step
        [(site_a, "forward", torch.randn(3, 4, generator=g)), (site_b, "forward", torch.randn(5, generator=g))],
        [(site_a, "forward", torch.randn(3, 4, generator=g)), (site_b, "forward", torch.randn(5, generator=g))],
        [(site_a, "forward", torch.randn(3, 4, generator=g)), (site_b, "forward", torch.randn(5, generator=g)),
         (site_c, "forward", torch.randn(2, 2, generator=g))],  # a site added
        [(site_a, "forward", torch.randn(3, 4, generator=g)), (site_c, "forward", torch.randn(2, 2, generator=g))],
        [(site_a, "forward", torch.randn(6, 2, generator=g)),  # the same sites, other kinds of tensor
         (site_c, "forward", torch.tensor([[1, -2], [3, 4]]))],
        [(site_a, "backward", torch.randn(6, 2, generator=g)),  # another phase, a record without finite values
         (site_c, "forward", torch.full((2, 2), math.nan))],
        [(RecordNames(*site_a), "backward", torch.randn(6, 2, generator=g)),  # equal names, not the same tuple
         (site_c, "forward", torch.empty(2, device="meta"))],  # a record without statistics
    ]
    rows = StepRows(rank=0, sample_count=4, hash=True)
    reuse, stale = EntryColumns(), _StaleColumns()
    reused, stale_differs = [], []
    for step, records in enumerate(steps):
        for seq, (site, phase, tensor) in enumerate(records):
            rows.add_named(site, step, phase, seq, tensor)
        (block,) = rows.take()
        kept = reuse._built
        fresh, again = block.to_table(), block.to_table(reuse)
        assert _same_table(again, fresh), step
        write_parquet(tmp_path / "fresh.parquet", fresh, durable=False)
        write_parquet(tmp_path / "again.parquet", again, durable=False)
        assert (tmp_path / "fresh.parquet").read_bytes() == (tmp_path / "again.parquet").read_bytes(), step
        reused.append(reuse._built is kept)
        if stale._built is not None and len(stale._built.names) == len(block.entries):
            stale_differs.append(not _same_table(block.to_table(stale), fresh))
        else:  # a table of another length: it builds and keeps this step's columns
            stale._built = None
            block.to_table(stale)
    assert reused == [False, True, False, False, False, False, False]
    # Taking the columns again without looking would have been caught: steps 1 and 4 to 6 have as many records as
    # the step before, and all but step 1 (the same entries) come out different.
    assert stale_differs == [False, True, True, True]
