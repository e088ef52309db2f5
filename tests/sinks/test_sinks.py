"""Exports: TensorBoard scalars read back with TensorBoard's own reader, JSON Lines and CSV round trips,
the original onnxruntime hooks' layout (checked against the original's own output), and safe outputs."""

from __future__ import annotations

import csv
import json
import math
import re
import threading
import warnings

import pytest

from probes.sinks.tensorboard import DEFAULT_STATISTICS
import torch

from probes import StatisticsSubscriber, SubscriberManager
from probes.cli import main
from probes.dump import load_dump
from probes.dump.writer import DumpWriter
from dump_records import write_record
from probes.sinks import LiveTensorBoard, export_dump, write_tensorboard
from probes.sinks.tabular import CSV_COLUMNS
from probes.models import TinyTransformer, TransformerConfig, make_batch

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

CONFIG = TransformerConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
STEPS = 3
STATS = DEFAULT_STATISTICS  # ("min", "max", "mean", "std", "norm", "nan", "inf")


def train(model: torch.nn.Module, subscriber, steps: int = STEPS, manager_type=SubscriberManager) -> None:
    manager = manager_type()
    manager.subscribe(model, [subscriber])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        batch = make_batch(CONFIG, batch_size=2, seed=step)
        optimizer.zero_grad()
        model(batch["tokens"], labels=batch["labels"]).backward()
        optimizer.step()
    if hasattr(manager, "unsubscribe"):  # the original onnxruntime manager has none
        manager.unsubscribe()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    train(model(), StatisticsSubscriber(out))
    return out


def scalars(logdir):
    """{tag: {step: value}} as TensorBoard's own event reader sees them."""
    accumulator = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def same_float32(read, expected):
    if math.isnan(expected):
        return math.isnan(read)
    return read == float(torch.tensor(expected, dtype=torch.float32))  # event files hold float32 scalars


def expected_scalars(records, keep=lambda record: True):
    expected = {}
    for record in records:
        if keep(record):
            for stat in STATS:
                if isinstance(record.get(stat), (int, float)):
                    expected.setdefault(f"{record['phase']}/{record['name']}/{stat}", {})[record["step"]] = record[stat]
    return expected


def test_tensorboard_scalars_are_the_dumps_statistics_read_back_by_tensorboard(dump, tmp_path):
    summary = write_tensorboard(dump, tmp_path / "tb")
    read = scalars(tmp_path / "tb" / "rank_0")
    records = load_dump(dump)
    expected = expected_scalars(records)
    assert set(read) == set(expected)
    assert "forward/blocks.0.attn.output.0/std" in read and "backward/blocks.1.output.0/nan" in read
    for tag, by_step in expected.items():
        assert set(read[tag]) == set(range(STEPS)) == set(by_step)
        assert all(same_float32(read[tag][step], value) for step, value in by_step.items()), tag
    assert summary.records == len(records) and summary.steps == STEPS and summary.ranks == (0,)


def test_tensorboard_module_and_phase_filters(dump, tmp_path):
    write_tensorboard(dump, tmp_path / "tb", modules=["blocks.0.*"], phases=["backward"])
    read = scalars(tmp_path / "tb" / "rank_0")
    in_block = lambda r: r["module"] == "blocks.0" or r["module"].startswith("blocks.0.")  # noqa: E731 (the glob
    # matches a record name too: blocks.0's own "blocks.0.output.0")
    expected = expected_scalars(load_dump(dump), lambda r: r["phase"] == "backward" and in_block(r))
    assert read and set(read) == set(expected)


def test_tensorboard_refuses_a_log_directory_with_events_unless_overwrite(dump, tmp_path):
    write_tensorboard(dump, tmp_path / "tb", modules=["head"])
    before = sorted((tmp_path / "tb" / "rank_0").iterdir())
    with pytest.raises(FileExistsError, match="already holds TensorBoard event files"):
        write_tensorboard(dump, tmp_path / "tb")
    assert sorted((tmp_path / "tb" / "rank_0").iterdir()) == before
    write_tensorboard(dump, tmp_path / "tb", modules=["head"], overwrite=True)
    read = scalars(tmp_path / "tb" / "rank_0")
    assert all(len(by_step) == STEPS for by_step in read.values())  # replaced, not written twice


def test_tensorboard_writes_one_directory_per_rank(tmp_path):
    for rank in (0, 1):
        writer = DumpWriter(tmp_path / "run", rank=rank)
        write_record(writer, 0, {"name": "fc.output.0", "phase": "forward", "seq": 0, "module": "fc", "mean": 0.25 + rank,
                         "std": None})
        writer.finish_step(0)
        writer.close()
    write_tensorboard(tmp_path / "run", tmp_path / "tb")
    assert scalars(tmp_path / "tb" / "rank_0") == {"forward/fc.output.0/mean": {0: 0.25}}
    assert scalars(tmp_path / "tb" / "rank_1") == {"forward/fc.output.0/mean": {0: 1.25}}  # std None: left out


def test_live_tensorboard_from_the_subscriber_off_the_training_thread(tmp_path):
    threads = []

    class Watched(LiveTensorBoard):
        def __call__(self, step, path):
            threads.append(threading.current_thread())
            super().__call__(step, path)

    with Watched(tmp_path / "tb", modules=["head"]) as live:
        train(model(), StatisticsSubscriber(tmp_path / "run", on_step_written=live))
    assert live.steps == STEPS and threads and threading.main_thread() not in threads
    expected = expected_scalars(load_dump(tmp_path / "run"), lambda r: r["module"] == "head")
    read = scalars(tmp_path / "tb" / "rank_0")
    assert read and set(read) == set(expected)
    assert all(same_float32(read[tag][step], value) for tag, by_step in expected.items()
               for step, value in by_step.items())


def test_live_tensorboard_refuses_an_existing_log_directory_before_training(dump, tmp_path):
    write_tensorboard(dump, tmp_path / "tb", modules=["head"])
    with pytest.raises(FileExistsError, match="already holds TensorBoard event files"):
        LiveTensorBoard(tmp_path / "tb")
    with pytest.raises(ValueError, match="unknown phase forwards"):
        LiveTensorBoard(tmp_path / "tb2", phases=["forwards"])


def strict_loads(line):
    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")
    return json.loads(line, parse_constant=refuse)


def test_jsonl_is_strict_json_with_every_key_of_every_record(dump, tmp_path):
    summary = export_dump(dump, tmp_path / "run.jsonl", format="jsonl")
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert [strict_loads(line) for line in lines] == load_dump(dump)
    assert summary.records == len(lines) and str(summary).startswith(f"{len(lines)} records of {STEPS} steps")


def synthetic_dump(path, samples=(1.5, math.nan, math.inf, -math.inf)):
    writer = DumpWriter(path, rank=0)
    write_record(writer, 0, {"name": "fc.output.0", "phase": "forward", "seq": 0, "module": "fc", "min": -1e-30,
                     "max": 0.1 + 0.2, "mean": None, "samples": list(samples), "sample_indices": [0, 1, 2, 3],
                     "shape": [2, 2], "custom_key": {"k": 1}})
    writer.finish_step(0)
    writer.close()
    return path


def test_non_finite_numbers_in_jsonl_and_csv(tmp_path):
    run = synthetic_dump(tmp_path / "run")
    export_dump(run, tmp_path / "run.jsonl", format="jsonl")
    (row,) = [strict_loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert row["samples"] == [1.5, "NaN", "Infinity", "-Infinity"] and row["custom_key"] == {"k": 1}
    export_dump(run, tmp_path / "run.csv", format="csv")
    with open(tmp_path / "run.csv", newline="") as file:
        (line,) = list(csv.DictReader(file))
    assert float(line["min"]) == -1e-30 and float(line["max"]) == 0.1 + 0.2 and line["mean"] == ""
    assert json.loads(line["samples"]) == [1.5, "NaN", "Infinity", "-Infinity"]
    assert json.loads(line["shape"]) == [2, 2] and json.loads(line["extra"]) == {"custom_key": {"k": 1}}


def test_csv_has_named_columns_and_exact_numbers(dump, tmp_path):
    export_dump(dump, tmp_path / "run.csv", format="csv")
    with open(tmp_path / "run.csv", newline="") as file:
        reader = csv.DictReader(file)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        rows = list(reader)
    records = load_dump(dump)
    assert len(rows) == len(records)
    for row, record in zip(rows, records):
        assert (int(row["step"]), row["phase"], row["name"]) == (record["step"], record["phase"], record["name"])
        for column in ("min", "max", "mean", "std", "m2"):
            expected = record.get(column)  # repr: the exact float, read back by float(); None: an empty cell
            assert (row[column] == "") if expected is None else (float(row[column]) == expected), column
        for column in ("numel", "nan", "inf", "zero", "seq"):
            assert int(row[column]) == record[column]
        assert json.loads(row["samples"]) == record["samples"] and row["extra"] == ""
    assert sum(row["mean"] == "" for row in rows) < len(rows) / 2


ORIGINAL_HEADER = re.compile(r"^(>*)(\w+_\d+_\d+th_output) (forward|backward) run shape: torch\.Size\(\[[\d, ]*\]\) "
                             r"dtype: torch\.\w+ size: torch\.Size\(\[\d+\]\) $")


def test_ort_layout_has_the_originals_files_order_and_header(dump, tmp_path):
    summary = export_dump(dump, tmp_path / "ort", format="ort")
    records = load_dump(dump)
    assert sorted(p.name for p in (tmp_path / "ort").iterdir()) == [f"step_{s}" for s in range(STEPS)]
    for step in range(STEPS):
        step_dir = tmp_path / "ort" / f"step_{step}"
        order = (step_dir / "order.txt").read_text().splitlines()
        in_step = sorted((r for r in records if r["step"] == step), key=lambda r: r["seq"])
        assert order == [f"{r['legacy_name']}_{r['phase']}" for r in in_step]
        assert sorted(p.name for p in step_dir.iterdir()) == sorted([*order, "order.txt"])
        for record in in_step:
            lines = (step_dir / f"{record['legacy_name']}_{record['phase']}").read_text().splitlines()
            header = ORIGINAL_HEADER.match(lines[0])
            assert header and header[2] == record["legacy_name"] and header[3] == record["phase"]
            assert len(header[1]) == record["depth"] + 1  # the original counted the root as 1
            assert lines[1] == f"min: {record['min']} max: {record['max']}, mean: {record['mean']}, std: {record['std']} "
            assert lines[2] == f"nan: {record['nan']}, inf: {record['inf']}" and lines[-1] == "=" * 16
    assert summary.records == len(records)


def test_ort_layout_names_match_the_original_onnxruntime_subscribers(dump, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks = pytest.importorskip("onnxruntime.training.utils.hooks")
        from onnxruntime.training.utils.hooks._subscriber_manager import SubscriberManager as OriginalManager
        train(model(), hooks.StatisticsSubscriber(str(tmp_path / "original"), override_output_dir=True),
              manager_type=OriginalManager)
    export_dump(dump, tmp_path / "ours", format="ort")
    original_steps = sorted(p.name for p in (tmp_path / "original").iterdir())
    assert original_steps == sorted(p.name for p in (tmp_path / "ours").iterdir())
    for step_dir in original_steps:
        original = (tmp_path / "original" / step_dir / "order.txt").read_text().splitlines()
        ours = (tmp_path / "ours" / step_dir / "order.txt").read_text().splitlines()
        assert ours == original
        for name in original:  # the same first line but for the numbers' printing
            first = (tmp_path / "original" / step_dir / name).read_text().splitlines()[0]
            assert ORIGINAL_HEADER.match(first)
            assert first.split(" shape:")[0] == (tmp_path / "ours" / step_dir / name).read_text().split(" shape:")[0]


def test_ort_layout_keeps_names_from_the_model_inside_the_step_directory(tmp_path):
    writer = DumpWriter(tmp_path / "run", rank=0)
    for seq, legacy in enumerate(["../../escaped", "/abs/path", "Linear_1_0th_output", "Linear_1_0th_output"]):
        write_record(writer, 0, {"name": f"m{seq}.output.0", "phase": "forward", "seq": seq, "legacy_name": legacy})
    write_record(writer, 0, {"name": "m.output.0", "phase": "recompute", "seq": 9, "legacy_name": "Linear_2_0th_output"})
    writer.finish_step(0)
    writer.close()
    summary = export_dump(tmp_path / "run", tmp_path / "ort", format="ort")
    files = sorted(p.name for p in (tmp_path / "ort" / "step_0").iterdir())
    assert files == sorted(["%2E.%2F..%2Fescaped_forward", "%2Fabs%2Fpath_forward", "Linear_1_0th_output_forward",
                            "Linear_1_0th_output_forward_call1", "order.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ort", "run"]
    assert summary.records == 4 and "1 recomputation records left out" in str(summary)


def test_an_existing_output_is_kept_unless_overwrite(dump, tmp_path):
    target = tmp_path / "run.csv"
    target.write_text("precious\n")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_dump(dump, target, format="csv")
    assert target.read_text() == "precious\n"
    (tmp_path / "ort").mkdir()
    (tmp_path / "ort" / "mine.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        export_dump(dump, tmp_path / "ort", format="ort")
    assert (tmp_path / "ort" / "mine.txt").read_text() == "mine"
    export_dump(dump, tmp_path / "ort", format="ort", overwrite=True)
    assert not (tmp_path / "ort" / "mine.txt").exists() and (tmp_path / "ort" / "step_0" / "order.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ort", "run.csv"]  # no temporary left


def test_a_damaged_dump_leaves_the_previous_output_whole(tmp_path):
    writer = DumpWriter(tmp_path / "run", rank=0)
    for step in range(2):
        write_record(writer, step, {"name": "fc.output.0", "phase": "forward", "seq": 0})
        writer.finish_step(step)
    writer.close()
    export_dump(tmp_path / "run", tmp_path / "out.jsonl", format="jsonl")
    before = (tmp_path / "out.jsonl").read_bytes()
    step_file = tmp_path / "run" / "rank_0" / "step_000001.parquet"
    step_file.write_bytes(step_file.read_bytes()[:-3])  # cut the file short
    with pytest.raises(ValueError, match="truncated"):
        export_dump(tmp_path / "run", tmp_path / "out.jsonl", format="jsonl", overwrite=True)
    assert (tmp_path / "out.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "run"]


def test_bad_requests_are_clear_errors(dump, tmp_path):
    with pytest.raises(ValueError, match="inside the dump"):
        export_dump(dump, dump / "x.csv", format="csv")
    with pytest.raises(ValueError, match="no finished step of rank 3 .*its ranks: 0"):
        export_dump(dump, tmp_path / "x.csv", format="csv", rank=3)
    with pytest.raises(ValueError, match="unknown export format 'parquet'; choose from jsonl, csv, ort"):
        export_dump(dump, tmp_path / "x", format="parquet")


def test_the_command_line_exports_and_says_what_it_wrote(dump, tmp_path, capsys):
    assert main(["export", str(dump), "--format", "jsonl", "--output", str(tmp_path / "r.jsonl")]) == 0
    assert f"jsonl: {len(load_dump(dump))} records of {STEPS} steps" in capsys.readouterr().out
    assert main(["export", str(dump), "--format", "jsonl", "--output", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("probes export: error: ") and "--overwrite" in err[0]
    assert main(["tensorboard", str(dump), "--logdir", str(tmp_path / "tb"), "--module", "head",
                 "--phase", "forward"]) == 0
    assert "tensorboard --logdir" in capsys.readouterr().out
    assert set(scalars(tmp_path / "tb" / "rank_0")) == {f"forward/head.output.0/{s}" for s in STATS}
    assert main(["tensorboard", str(dump), "--logdir", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds TensorBoard event files" in err[0]
