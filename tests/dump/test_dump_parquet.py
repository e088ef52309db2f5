"""The Parquet dump (the default format): exact round trip, the columnar view, size, crash and disk-full
safety, damaged files, and dumps of format version 1 (JSON Lines) read and joined.

The JSON Lines format's own tests are in test_dump.py.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager, load_dump, load_table
from probes.dump import DumpFormatError, DumpReader, DumpWriteError, stepfiles
from probes.dump.reader import list_steps
from probes.dump.writer import DumpWriter
from dump_records import write_record
from probes.dump.columns import SCHEMA
from probes.models import TinyTransformer, make_batch
from test_dump import IMPORT_DUMP_WITHOUT_TORCH

# Every kind of value a record may hold, in the order a record's keys would come.
AWKWARD = [
    {"name": "plain", "phase": "forward", "seq": 0, "mean": 0.1},
    {"name": "ints", "phase": "backward", "seq": 1, "shape": [None, 3], "dtype": "int64", "numel": 6,
     "min": -(1 << 63), "max": (1 << 64) - 1, "mean": None, "std": None, "samples": [1, -2, 3],
     "sample_indices": [0, 2, 5]},
    {"name": "odd floats", "phase": "forward", "seq": 2, "min": float("-inf"), "max": float("nan"),
     "samples": [1.5, float("nan"), float("inf"), -0.0], "stats_of": None, "dtype": None},
    {"name": "types\nnot their column's", "phase": "forward", "seq": True, "tensor_index": 1.0, "depth": "2",
     "samples": [1, 2.5], "min": True, "samples_int": 5, "nulls": ["x"], "extra": {"a": [1, {"b": None}]}},
    {"name": "empty", "phase": "recompute", "seq": 3, "samples": [], "sample_indices": [], "shape": []},
    {"name": "naïve ✓", "phase": "forward", "seq": 4, "unsupported": "meta tensor: it has no data",
     "layout": None, "rank_hint": float("nan")},
]


def same(a, b) -> bool:
    """Equal values of equal types, nan equal to nan (what a round trip must keep)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and str(a) == str(b))


def write(root: Path, steps: dict[int, list[dict]], **options) -> None:
    with DumpWriter(root, **options) as writer:
        for step, records in steps.items():
            for record in records:
                write_record(writer, step, record)
            writer.finish_step(step)


def train(out: Path, steps: int = 2, **options) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    manager = SubscriberManager()
    manager.subscribe(model, [StatisticsSubscriber(out, **options)])
    for step in range(steps):
        batch = make_batch(model.config, seed=step)
        model(batch["tokens"], labels=batch["labels"]).backward()
    manager.unsubscribe()


def test_every_value_comes_back_exactly_as_written(tmp_path):
    write(tmp_path / "d", {3: AWKWARD})
    step_file = tmp_path / "d" / "rank_0" / "step_000003.parquet"
    assert step_file.is_file() and not list(step_file.parent.glob("*.jsonl*"))
    loaded = load_dump(tmp_path / "d")
    expected = [{**record, "step": 3, "rank": 0} for record in AWKWARD]
    for got, want in zip(loaded, expected, strict=True):
        assert same(got, want), (got, want)


def test_a_training_run_loads_the_same_from_parquet_and_json_lines(tmp_path):
    train(tmp_path / "pq")
    train(tmp_path / "js", dump_format="jsonl")
    assert sorted(p.name for p in (tmp_path / "pq" / "rank_0").iterdir()) == ["step_000000.parquet", "step_000001.parquet"]
    for step in (0, 1):  # the footer holds the record count (what order.txt held)
        footer = pq.read_metadata(tmp_path / "pq" / "rank_0" / f"step_00000{step}.parquet")
        assert footer.metadata[b"probes.records"] == str(footer.num_rows).encode() and footer.num_rows > 50
    parquet, text = load_dump(tmp_path / "pq"), load_dump(tmp_path / "js")
    assert len(parquet) == len(text) > 50
    for a, b in zip(parquet, text):
        assert same(a, b) and list(a) == list(b)  # values, types and key order


def test_table_view_has_a_named_column_per_key(tmp_path):
    train(tmp_path / "pq", steps=3)
    train(tmp_path / "js", steps=3, dump_format="jsonl")
    records = load_dump(tmp_path / "pq")
    table = load_table(tmp_path / "pq")
    assert table.schema.equals(SCHEMA) and table.num_rows == len(records)
    assert table.column("name").to_pylist() == [r["name"] for r in records]
    means = table.column("mean").to_numpy(zero_copy_only=False)
    assert np.array_equal(means, np.array([r["mean"] for r in records], dtype=np.float64), equal_nan=True)
    samples = table.column("samples").to_pylist()
    assert samples == [r["samples"] for r in records]
    assert load_table(tmp_path / "js").equals(table)  # JSON Lines dumps have the same view
    picked = load_table(tmp_path / "pq", columns=["step", "name", "std"])
    assert picked.column_names == ["step", "name", "std"] and picked.num_rows == len(records)
    with pytest.raises(ValueError, match="no column 'stdev' in a probes dump; the columns are step, rank"):
        load_table(tmp_path / "pq", columns=["stdev"])
    # Any Parquet reader reads a step file without probes.
    plain = pq.read_table(tmp_path / "pq" / "rank_0" / "step_000002.parquet")
    assert plain.column("name").to_pylist() == [r["name"] for r in records if r["step"] == 2]


def test_integer_columns_keep_ints_and_the_float_column_serves_analysis(tmp_path):
    write(tmp_path / "d", {0: AWKWARD[:2]})
    table = load_table(tmp_path / "d")
    assert table.column("max_int").to_pylist() == [None, None]  # 2**64 - 1 does not fit int64: kept in extra
    assert json.loads(table.column("extra")[1].as_py()) == {"max": (1 << 64) - 1}
    assert table.column("min_int").to_pylist() == [None, -(1 << 63)]
    assert table.column("min").to_pylist() == [None, float(-(1 << 63))]
    assert table.column("samples_int").to_pylist() == [None, [1, -2, 3]]
    assert table.column("nulls").to_pylist() == [None, ["mean", "std"]]


def test_about_230_bytes_per_record_with_32_samples(tmp_path):
    train(tmp_path / "pq", steps=3)
    train(tmp_path / "js", steps=3, dump_format="jsonl")
    records = load_dump(tmp_path / "pq")
    assert all(len(r["samples"]) == 32 for r in records if r["numel"] >= 32)

    def per_record(root: Path, suffix: str) -> float:
        return sum(path.stat().st_size for path in (root / "rank_0").glob(f"*{suffix}")) / len(records)

    parquet, text = per_record(tmp_path / "pq", ".parquet"), per_record(tmp_path / "js", ".jsonl")
    assert parquet <= 300, f"{parquet:.0f} bytes per record"
    assert text > 4 * parquet


def test_a_synced_step_is_journaled_as_parquet_parts_until_it_is_finished(tmp_path):
    out = tmp_path / "d"
    writer = DumpWriter(out)
    write_record(writer, 0, AWKWARD[0])
    rank_dir = out / "rank_0"
    writer.flush()
    journal = rank_dir / "step_000000.parquet.partial"
    assert sorted(p.name for p in journal.iterdir()) == ["part_000000.parquet"]
    assert pq.read_table(journal / "part_000000.parquet").column("name").to_pylist() == ["plain"]  # Parquet, no JSON
    assert list_steps(out) == {0: {"finished": [], "unfinished": [0]}}
    assert [r["name"] for r in load_dump(out, include_partial=True)] == ["plain"]
    write_record(writer, 0, AWKWARD[1])
    assert [r["name"] for r in load_dump(journal, include_partial=True)] == ["plain", "ints"]  # a reader syncs
    with pytest.raises(ValueError, match="is an unfinished step; load it with include_partial=True"):
        load_dump(journal)
    assert sorted(p.name for p in journal.iterdir()) == ["part_000000.parquet", "part_000001.parquet"]
    expected = [{**record, "step": 0, "rank": 0} for record in AWKWARD[:2]]
    for got, want in zip(load_dump(out, include_partial=True), expected, strict=True):
        assert same(got, want), (got, want)  # the journal keeps every value, as the finished file does
    write_record(writer, 0, AWKWARD[2])
    writer.finish_step(0)
    writer.flush()
    assert sorted(p.name for p in rank_dir.iterdir()) == ["step_000000.parquet"]  # no journal left
    assert [r["name"] for r in load_dump(out)] == ["plain", "ints", "odd floats"]
    writer.close()


def test_close_after_an_exception_leaves_the_open_step_readable_as_unfinished(tmp_path):
    with pytest.raises(KeyError):
        with DumpWriter(tmp_path / "d") as writer:
            write_records = AWKWARD[:3]
            for record in write_records:
                write_record(writer, 0, record)
            raise KeyError("training failed")
    assert list_steps(tmp_path / "d") == {0: {"finished": [], "unfinished": [0]}}
    assert [r["name"] for r in load_dump(tmp_path / "d", include_partial=True)] == ["plain", "ints", "odd floats"]


CRASHING_CHILD = IMPORT_DUMP_WITHOUT_TORCH + r"""
import time

writer = DumpWriter(sys.argv[1])
for step in range(1000000):
    for index in range(50):
        write_record(writer, step, {"name": f"layer{index}", "phase": "forward", "seq": index, "samples": [0.5] * 32})
    writer.finish_step(step)
    if step == 2:
        writer.flush()
        print("ready", flush=True)
"""


def test_sigkill_while_steps_are_being_finished_keeps_every_finished_step_whole(tmp_path):
    out = tmp_path / "d"
    with subprocess.Popen([sys.executable, "-c", CRASHING_CHILD, str(out)], stdout=subprocess.PIPE,
                          text=True) as child:
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # Parquet files are being written and renamed now
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
    reader = DumpReader(out)
    finished = reader.steps()[0]["finished"]
    assert finished[:3] == [0, 1, 2] and finished == list(range(len(finished)))
    for step_file in reader.step_files():  # every finished file opens and is whole
        assert [r["name"] for r in reader.read(step_file)] == [f"layer{i}" for i in range(50)]
    leftovers = [p.name for p in (out / "rank_0").iterdir()
                 if not p.name.endswith((".parquet", ".order.txt", ".jsonl.partial"))]
    assert all(name.endswith(".parquet.tmp") for name in leftovers), leftovers  # never listed as a step


def test_disk_full_while_finishing_keeps_the_finished_steps(tmp_path, monkeypatch):
    out = tmp_path / "d"
    writer = DumpWriter(out)
    write_steps = {0: AWKWARD[:2], 1: AWKWARD[:2]}
    for step, records in write_steps.items():
        for record in records:
            write_record(writer, step, record)
        writer.finish_step(step)
    writer.flush()
    real_write = stepfiles.write_parquet

    def disk_full(path, table):
        with open(path, "wb") as file:
            file.write(b"PAR1")  # a start, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stepfiles, "write_parquet", disk_full)
    write_record(writer, 2, AWKWARD[0])
    writer.finish_step(2)
    with pytest.raises(DumpWriteError) as raised:
        writer.flush()
    assert raised.value.errno == errno.ENOSPC and raised.value.path == out / "rank_0" / "step_000002.parquet.tmp"
    assert "could not finish step" in str(raised.value) and "No space left" in str(raised.value)
    with pytest.raises(DumpWriteError):
        write_record(writer, 3, AWKWARD[0])
    writer.close()
    monkeypatch.setattr(stepfiles, "write_parquet", real_write)
    assert list_steps(out) == {0: {"finished": [0, 1], "unfinished": []}}
    assert [(r["step"], r["name"]) for r in load_dump(out)] == [(s, n) for s in (0, 1) for n in ("plain", "ints")]


def test_a_value_only_pickle_could_store_is_an_error_and_nothing_is_pickled(tmp_path, monkeypatch):
    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle was used")

    for name in ("dumps", "dump", "loads", "load"):
        monkeypatch.setattr(pickle, name, no_pickle)
    write(tmp_path / "ok", {0: AWKWARD})
    assert len(load_dump(tmp_path / "ok")) == len(AWKWARD) and load_table(tmp_path / "ok").num_rows == len(AWKWARD)
    metadata = pq.read_metadata(tmp_path / "ok" / "rank_0" / "step_000000.parquet").metadata or {}
    assert not any(b"pandas" in key or b"ARROW" in key for key in metadata)  # no pickled schema or index
    with DumpWriter(tmp_path / "bad") as writer:
        with pytest.raises(TypeError, match="not JSON serializable"):  # when its Arrow batch is made
            write_record(writer, 0, {"name": "bad", "phase": "forward", "seq": 0, "value": {1, 2}})
    assert list_steps(tmp_path / "bad") == {0: {"finished": [], "unfinished": []}}


@pytest.fixture
def finished(tmp_path) -> Path:
    write(tmp_path / "d", {0: AWKWARD, 1: AWKWARD})
    return tmp_path / "d"


def test_a_damaged_parquet_file_names_the_file(finished):
    path = finished / "rank_0" / "step_000001.parquet"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DumpFormatError, match="not a readable Parquet step file") as raised:
        load_dump(finished)
    assert raised.value.path == path
    with pytest.raises(DumpFormatError, match="step_000001.parquet"):
        load_table(finished)


def test_a_parquet_file_with_records_missing_or_misplaced_is_caught(finished):
    rank_dir = finished / "rank_0"
    table = pq.read_table(rank_dir / "step_000000.parquet")
    pq.write_table(table.slice(0, 4), rank_dir / "step_000001.parquet")  # a copy of another step, cut short
    with pytest.raises(DumpFormatError, match="truncated: its footer lists 6 records, the step file has 4"):
        load_dump(finished)  # the copy kept the footer's count
    pq.write_table(table, rank_dir / "step_000001.parquet")
    with pytest.raises(DumpFormatError, match="row 1 says step 0 but the file belongs to step 1"):
        load_dump(finished)
    with pytest.raises(DumpFormatError, match="row 1 says step 0 but the file belongs to step 1"):
        load_table(finished)
    pq.write_table(pa.table({"x": [1]}), rank_dir / "step_000001.parquet")
    with pytest.raises(DumpFormatError, match="not a probes step file: no step, rank, name, phase column"):
        load_dump(finished)


def test_one_step_finished_in_both_formats_is_an_error(finished):
    rank_dir = finished / "rank_0"
    (rank_dir / "step_000001.jsonl").write_text(json.dumps({"name": "x", "phase": "forward", "seq": 0}) + "\n")
    with pytest.raises(DumpFormatError, match="step 1 of rank 0 is finished twice"):
        load_dump(finished)


def test_a_version_1_dump_loads_and_another_rank_joins_it(tmp_path):
    out = tmp_path / "old"
    write(out, {0: AWKWARD[:2]}, format="jsonl")
    (out / "manifest.json").write_text(json.dumps({"format": "probes-dump", "version": 1}) + "\n")
    assert [r["name"] for r in load_dump(out)] == ["plain", "ints"]
    write(out, {0: AWKWARD[2:4]}, rank=1)  # the default writer joins it, and marks it version 2
    assert json.loads((out / "manifest.json").read_text())["version"] == 2
    assert [(r["rank"], r["name"]) for r in load_dump(out)] == [
        (0, "plain"), (0, "ints"), (1, "odd floats"), (1, "types\nnot their column's")]
    assert load_table(out).column("rank").to_pylist() == [0, 0, 1, 1]
    (out / "manifest.json").write_text(json.dumps({"format": "probes-dump", "version": 3}) + "\n")
    with pytest.raises(DumpFormatError, match="format version 3; this reader reads versions 1 and 2"):
        load_dump(out)


def test_ring_buffer_removes_parquet_steps(tmp_path):
    write(tmp_path / "d", {step: AWKWARD[:1] for step in range(5)}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "d" / "rank_0").iterdir()) == ["step_000003.parquet", "step_000004.parquet"]


def test_unknown_format_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown dump format 'csv'; expected one of parquet, jsonl"):
        DumpWriter(tmp_path / "d", format="csv")
    with pytest.raises(ValueError, match="unknown dump format 'json'"):
        StatisticsSubscriber(tmp_path / "s", dump_format="json")
    assert not (tmp_path / "d").exists() and not os.path.exists(tmp_path / "s")


def test_the_dump_is_a_dataset_pyarrow_reads_with_one_glob(tmp_path):
    """Every step file holds its rank and step as columns, so one glob over the rank directories is the dump."""
    import glob

    import pyarrow.dataset as ds

    for rank in (0, 1, 10):  # rank_10 sorts before rank_2 as text: the rows say their rank, not the path
        write(tmp_path / "d", {0: AWKWARD, 1: AWKWARD[:3], 2: AWKWARD[1:]}, rank=rank)
    train(tmp_path / "trained", steps=2)
    for root in (tmp_path / "d", tmp_path / "trained"):
        files = glob.glob(str(root / "rank_*" / "step_*.parquet"))
        for path in files:  # a step file alone says which rank and step it holds
            alone = pq.read_table(path, columns=["rank", "step"])
            assert alone.column("rank").null_count == 0 and alone.column("step").null_count == 0
        dataset = ds.dataset(files, format="parquet", schema=SCHEMA)
        keys = [("rank", "ascending"), ("step", "ascending"), ("seq", "ascending"), ("name", "ascending")]
        read = dataset.to_table().sort_by(keys)
        expected = load_table(root).sort_by(keys)
        assert read.num_rows == expected.num_rows > 0
        assert read.schema == expected.schema and same(read.to_pylist(), expected.to_pylist())  # nan equal to nan
        only_step_1 = dataset.to_table(filter=(ds.field("step") == 1) & (ds.field("rank") == 10))
        assert set(only_step_1.column("step").to_pylist()) <= {1}
    assert set(only_step_1.column("rank").to_pylist()) == set()  # the trained dump has rank 0 only


def test_a_dump_written_before_the_footer_count_still_reads_and_checks_its_order_files(finished):
    """Dumps of earlier versions: no count in the footer, an order.txt beside each Parquet step, a JSON Lines
    journal for an unfinished step."""
    rank_dir = finished / "rank_0"
    table = pq.read_table(rank_dir / "step_000001.parquet").replace_schema_metadata(None)
    order = "".join(f"{name}_{phase}\n".replace("\n", "\\n", name.count("\n")) for name, phase in
                    zip(table.column("name").to_pylist(), table.column("phase").to_pylist()))  # escaped as written
    for step in (0, 1):
        pq.write_table(table.set_column(0, "step", pa.array([step] * table.num_rows, pa.int64())),
                       rank_dir / f"step_00000{step}.parquet")
        (rank_dir / f"step_00000{step}.order.txt").write_text(order)
    (rank_dir / "step_000002.jsonl.partial").write_text(json.dumps({"name": "late", "phase": "forward", "seq": 0})
                                                         + "\n{\"name\": \"cut")
    assert pq.read_metadata(rank_dir / "step_000001.parquet").metadata.get(b"probes.records") is None
    loaded = load_dump(finished, include_partial=True)
    assert [(r["step"], r["name"]) for r in loaded] == [(0, r["name"]) for r in AWKWARD] + [
        (1, r["name"]) for r in AWKWARD] + [(2, "late")]
    assert load_table(finished).num_rows == 2 * len(AWKWARD)
    pq.write_table(table.slice(0, 4), rank_dir / "step_000001.parquet")  # cut short: its order.txt lists 6
    with pytest.raises(DumpFormatError, match="truncated: step_000001.order.txt lists 6 records, the step file has 4"):
        load_dump(finished)
