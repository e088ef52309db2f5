"""The 64-bit hash of a record's tensor (``hash=True``): against a numpy reference written here, on both
backends (the C++ kernel and the torch path), for every dtype, odd strides, views and empty tensors."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from probes import SubscriberManager, StatisticsSubscriber, load_dump
from probes.stats.one_tensor import tensor_record
from probes.stats.hashing import tensor_hash

G, M1, M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z = z * M1
    z = z ^ (z >> np.uint64(27))
    z = z * M2
    return z ^ (z >> np.uint64(31))


def reference_hash(data: bytes) -> int:
    """The documented hash (probes/stats/hashing.py), in numpy uint64 arithmetic, as a signed int64."""
    size = len(data)
    words = np.frombuffer(data + bytes(-size % 8), dtype="<u8")
    with np.errstate(over="ignore"):
        positions = np.arange(1, len(words) + 1, dtype=np.uint64)
        total = np.sum(_mix(words + positions * G), dtype=np.uint64) if len(words) else np.uint64(0)
        final = _mix(np.array([total], dtype=np.uint64) + np.uint64(size + 1) * G)
    return int(final.view(np.int64)[0])


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def logical_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's values in row-major order, each in its dtype's bytes, through numpy (not torch's copy)."""
    if tensor.dtype in (torch.bfloat16, *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))):
        tensor = tensor.view(_SAME_SIZE[tensor.element_size()])
    return np.ascontiguousarray(tensor.numpy()).tobytes()


def _cases() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(6, 10)
    cases = {
        "float32": base, "float64": base.double(), "float16": base.half(), "bfloat16": base.bfloat16(),
        "int8": (base * 50).to(torch.int8), "int16": (base * 1000).to(torch.int16), "int32": (base * 1e6).int(),
        "int64": (base * 1e12).long(), "uint8": (base * 50).abs().to(torch.uint8), "bool": base > 0,
        "transposed": base.t(), "strided slice": base[1:, ::3], "odd offset": base.reshape(-1)[3:],
        "odd bytes": torch.arange(7, dtype=torch.uint8), "scalar": torch.tensor(2.5), "empty": torch.zeros(0),
        "empty 2-d": torch.zeros(3, 0), "expanded": torch.randn(1, 5).expand(4, 5), "channels last":
            torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }
    if hasattr(torch, "float8_e4m3fn"):
        cases["float8_e4m3fn"] = base.to(torch.float8_e4m3fn)
    return cases


CASES = _cases()


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_the_record_hash_equals_the_numpy_reference_on_both_backends(backend, monkeypatch):
    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", backend)
    for label, tensor in CASES.items():
        record = tensor_record(tensor, hash=True)
        assert record["hash"] == reference_hash(logical_bytes(tensor)), label
        assert int(tensor_hash(tensor)) == record["hash"], label


def test_the_torch_definition_matches_the_reference_in_chunks_and_over_buckets(monkeypatch):
    tensor = torch.randn(1001)
    expected = reference_hash(tensor.numpy().tobytes())
    assert int(tensor_hash(tensor, chunk_words=7)) == expected
    assert tensor_record(tensor, hash=True, bucket_size=100)["hash"] == expected  # the kernel over buckets
    monkeypatch.setenv("PROBES_NUMERICS_BACKEND", "torch")
    assert tensor_record(tensor, hash=True, bucket_size=100)["hash"] == expected


def test_the_hash_changes_with_one_ulp_a_permutation_and_trailing_zero_bytes():
    tensor = torch.randn(64)
    ulp = tensor.clone()
    ulp[17] = torch.nextafter(ulp[17], torch.tensor(float("inf")))
    hashes = [tensor_record(x, hash=True)["hash"] for x in (tensor, ulp, tensor.flip(0), tensor.roll(1))]
    assert len(set(hashes)) == 4
    assert tensor_record(torch.tensor([1], dtype=torch.uint8), hash=True)["hash"] != \
        tensor_record(torch.tensor([1, 0], dtype=torch.uint8), hash=True)["hash"]


def test_a_lazily_negated_view_hashes_its_values():
    tensor = torch.randn(8)
    negated = torch._neg_view(tensor)
    assert tensor_record(negated, hash=True)["hash"] == reference_hash((-tensor).numpy().tobytes())


def test_odd_tensors_hash_what_their_statistics_summarise():
    complex_ = torch.randn(5, dtype=torch.complex64)
    record = tensor_record(complex_, hash=True)
    assert record["stats_of"] == "real_imag"
    assert record["hash"] == reference_hash(torch.view_as_real(complex_).numpy().tobytes())
    sparse = torch.eye(4).to_sparse()
    record = tensor_record(sparse, hash=True)
    assert record["stats_of"] == "values"
    assert record["hash"] == reference_hash(sparse.coalesce().values().numpy().tobytes())


def test_records_without_a_hash(tmp_path):
    assert "hash" not in tensor_record(torch.randn(3))
    model = torch.nn.Linear(3, 2)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "plain")]):
        model(torch.randn(4, 3)).sum().backward()
    records = load_dump(tmp_path / "plain")
    assert records and all(record.get("hash") is None for record in records)
    (step_file,) = (tmp_path / "plain" / "rank_0").glob("step_*.parquet")
    assert "hash" not in pq.ParquetFile(step_file).schema_arrow.names  # an optional column: absent when unused


@pytest.mark.parametrize("dump_format", ["parquet", "jsonl"])
def test_a_dump_with_hashes_holds_each_tensors_hash(tmp_path, dump_format):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    seen: dict[str, torch.Tensor] = {}
    model[0].register_forward_hook(lambda module, args, out: seen.__setitem__("0.output.0", out.detach().clone()))
    subscriber = StatisticsSubscriber(tmp_path / "run", hash=True, dump_format=dump_format)
    with SubscriberManager().subscribe(model, [subscriber]):
        model(torch.randn(5, 3)).sum().backward()
    records = {(r["phase"], r["name"]): r for r in load_dump(tmp_path / "run")}
    assert all(isinstance(record["hash"], int) for record in records.values())
    assert records["forward", "0.output.0"]["hash"] == reference_hash(seen["0.output.0"].numpy().tobytes())
