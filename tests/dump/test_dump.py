"""Dump I/O: the background writer, atomic steps, crash and disk-full safety, the reader, the table.

Over 400 lines: one page for the whole dump format, its writer and reader sharing the helpers below.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from probes import dump
from dump_records import row_block, write_record
from probes.dump import DumpFormatError, DumpReader, DumpWriteError, load_dump, stepfiles
from probes.dump.layout import safe_component
from probes.dump.reader import StepFile, list_steps
from probes.dump.table import format_records
from probes.dump.writer import DumpWriter
from probes.cli.show import show as show_main

# This page is the writer's and reader's (the default format, Parquet, records handed over as rows or Arrow), and
# the JSON Lines format's reading (format="jsonl", and every dump of format version 1); the Parquet format's own
# (round trip of every value, journal, footer) are in tests/dump/test_dump_parquet.py.
JsonLinesWriter = functools.partial(DumpWriter, format="jsonl")

DUMP_SOURCE = Path(dump.__file__).resolve().parent  # the package probes/dump
ROOT = DUMP_SOURCE.parents[1]

# Source for a fresh interpreter: imports probes.dump as ``dump`` without torch (fast). The __init__ of
# probes, probes.utils and exporters import torch, so they are skipped: empty packages with their paths.
IMPORT_DUMP_WITHOUT_TORCH = f"""
import os, sys, types
for _name in ("exporters", "probes", "probes.utils"):
    _package = types.ModuleType(_name)
    _package.__path__ = [os.path.join({str(ROOT)!r}, *_name.split("."))]
    sys.modules[_name] = _package
from probes import dump
from probes.dump.writer import DumpWriter
sys.path.insert(0, {str(ROOT / "tests")!r})
from dump_records import write_record
assert "torch" not in sys.modules
"""


def record(step: int, index: int, phase: str = "forward", **extra) -> dict:
    return {
        "name": f"layer{index}",
        "phase": phase,
        "seq": index,
        "shape": [2, 3],
        "dtype": "torch.float32",
        "min": -1.5,
        "max": 2.25,
        "mean": 0.125 * index,
        "std": 1.0,
        "nan": 0,
        "inf": 0,
        "samples": [0.5, -0.25],
        **extra,
    }


def write_steps(writer: DumpWriter, steps, per_step: int = 3) -> None:
    """Each step's records as the subscriber hands them over: statistics rows of real tensors (``row_block``)."""
    for step in steps:
        tensors = [torch.linspace(-1.5, 2.25, 6).reshape(2, 3) * (index + 1) for index in range(per_step)]
        writer.write(step, row_block(step, tensors, names=[f"layer{index}" for index in range(per_step)],
                                     rank=writer.config.rank))
        writer.finish_step(step)


def names(records) -> list[tuple[int, int, str]]:
    return [(r["rank"], r["step"], r["name"]) for r in records]


# ------------------------------------------------------------------------------------ round trip


def test_round_trip_keeps_records_and_adds_rank_and_step(tmp_path):
    out = tmp_path / "dump"
    with DumpWriter(out, rank=0) as writer:
        write_steps(writer, [0, 1])
    loaded = load_dump(out)
    assert len(loaded) == 6
    for loaded_record, (step, index) in zip(loaded, [(s, i) for s in (0, 1) for i in range(3)]):
        values = (np.linspace(-1.5, 2.25, 6, dtype=np.float32) * np.float32(index + 1)).astype(np.float64)  # reference
        assert {key: loaded_record[key] for key in ("rank", "step", "name", "phase", "seq", "shape", "dtype")} == {
            "rank": 0, "step": step, "name": f"layer{index}", "phase": "forward", "seq": index, "shape": [2, 3],
            "dtype": "float32"}
        assert loaded_record["samples"] == values.tolist() and loaded_record["sample_indices"] == list(range(6))
        assert loaded_record["min"] == values.min() and loaded_record["max"] == values.max()
        assert loaded_record["mean"] == pytest.approx(values.mean(), rel=1e-12, abs=1e-15)
        assert (loaded_record["numel"], loaded_record["nan"], loaded_record["inf"]) == (6, 0, 0)
    assert json.loads((out / "manifest.json").read_text()) == {"format": "probes-dump", "version": 2}
    assert sorted(p.name for p in (out / "rank_0").iterdir()) == ["step_000000.parquet", "step_000001.parquet"]
    assert load_dump(out / "rank_0") == loaded
    assert load_dump(out / "rank_0" / "step_000001.parquet") == loaded[3:]
    assert list_steps(out) == {0: {"finished": [0, 1], "unfinished": []}}


def test_order_is_call_order_per_step_and_the_seq_column_is_the_execution_order(tmp_path):
    out = tmp_path / "dump"
    writer = DumpWriter(out, queue_size=7)
    for index in range(300):  # two steps interleaved, through a small queue
        write_record(writer, 0, {"name": f"a{index}", "phase": "forward", "seq": index})
        write_record(writer, 1, {"name": f"b{index}", "phase": "backward", "seq": 299 - index})
    writer.finish_step(1)
    writer.finish_step(0)
    writer.close()
    loaded = load_dump(out)
    assert [r["name"] for r in loaded] == [f"a{i}" for i in range(300)] + [f"b{i}" for i in range(300)]
    # step 1 was written in reverse execution order: its rows keep write order, seq says the execution order
    step_1 = [r for r in loaded if r["step"] == 1]
    assert [r["name"] for r in sorted(step_1, key=lambda r: r["seq"])] == [f"b{i}" for i in reversed(range(300))]
    assert sorted(p.name for p in (out / "rank_0").iterdir()) == ["step_000000.parquet", "step_000001.parquet"]
    # a JSON Lines step still lists its records in execution order beside it (its count, for a cut at a line end)
    text = JsonLinesWriter(tmp_path / "text")
    for index in range(3):
        write_record(text, 0, {"name": f"b{index}", "phase": "backward", "seq": 2 - index})
    text.close()
    order = (tmp_path / "text" / "rank_0" / "step_000000.order.txt").read_text().splitlines()
    assert order == ["b2_backward", "b1_backward", "b0_backward"]


def test_two_ranks_share_a_directory_and_load_sorted(tmp_path):
    out = tmp_path / "dump"
    writers = [DumpWriter(out, rank=1), DumpWriter(out, rank=0)]  # rank 1 first: rank 0 joins its dump
    for writer in writers:
        write_steps(writer, [1, 0], per_step=2)
        writer.close()
    assert names(load_dump(out)) == [
        (rank, step, f"layer{i}") for rank in (0, 1) for step in (0, 1) for i in range(2)
    ]
    assert list_steps(out) == {rank: {"finished": [0, 1], "unfinished": []} for rank in (0, 1)}


def test_backpressure_blocks_and_never_drops(tmp_path, monkeypatch):
    gate = threading.Event()
    real_append = stepfiles.OpenSteps.append

    def gated_append(self, step, batch):  # the writer thread takes a batch, then waits
        gate.wait()
        return real_append(self, step, batch)

    monkeypatch.setattr(stepfiles.OpenSteps, "append", gated_append)
    writer = DumpWriter(tmp_path / "dump", queue_size=2)
    done = threading.Event()

    def produce():
        for index in range(20):
            write_record(writer, 0, record(0, index))
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    assert not done.wait(0.3), "write() returned although the queue was full"
    gate.set()
    producer.join(10)
    assert done.is_set()
    writer.close()
    assert [r["name"] for r in load_dump(tmp_path / "dump")] == [f"layer{i}" for i in range(20)]


# ------------------------------------------------------------------------------------ atomic steps


def test_step_is_invisible_until_finished(tmp_path):
    out = tmp_path / "dump"
    writer = JsonLinesWriter(out)
    write_steps(writer, [0])
    for index in range(3):
        write_record(writer, 1, record(1, index))
    writer.flush()
    partial = out / "rank_0" / "step_000001.jsonl.partial"
    assert partial.is_file() and len(partial.read_bytes().splitlines()) == 3
    assert [r["step"] for r in load_dump(out)] == [0, 0, 0]
    assert list_steps(out) == {0: {"finished": [0], "unfinished": [1]}}
    assert [r["step"] for r in load_dump(out, include_partial=True)] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="include_partial=True"):
        load_dump(partial)
    assert len(load_dump(partial, include_partial=True)) == 3

    writer.finish_step(1)
    writer.flush()
    assert not partial.exists()
    assert [r["step"] for r in load_dump(out)] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="already finished"):
        write_record(writer, 1, record(1, 9))
    writer.close()


def test_ints_are_checked_before_anything_is_written(tmp_path):
    for kwargs, what in (({"rank": -1}, "rank"), ({"rank": True}, "rank"), ({"queue_size": 0}, "queue_size")):
        with pytest.raises(ValueError, match=f"^{what} must be"):
            DumpWriter(tmp_path / "never", **kwargs)
    assert not (tmp_path / "never").exists()
    with DumpWriter(tmp_path / "dump") as writer:
        for step in (-1, True, 1.0, "1"):
            with pytest.raises(ValueError, match="^step must be"):
                writer.write(step, row_block(0, [torch.ones(2)]))
            with pytest.raises(ValueError, match="^step must be"):
                writer.finish_step(step)
    assert list_steps(tmp_path / "dump") == {0: {"finished": [], "unfinished": []}}


def test_close_finishes_open_steps_but_an_exception_leaves_them_unfinished(tmp_path):
    with DumpWriter(tmp_path / "a") as writer:
        write_record(writer, 0, record(0, 0))
    assert list_steps(tmp_path / "a") == {0: {"finished": [0], "unfinished": []}}
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        write_record(writer, 1, record(1, 0))

    with pytest.raises(KeyError):
        with DumpWriter(tmp_path / "b") as writer:
            write_record(writer, 0, record(0, 0))
            raise KeyError("training failed")
    assert list_steps(tmp_path / "b") == {0: {"finished": [], "unfinished": [0]}}


CRASHING_CHILD = IMPORT_DUMP_WITHOUT_TORCH + r"""
import time

writer = DumpWriter(sys.argv[1])
pad = "x" * 200
for step in (0, 1):
    for index in range(50):
        write_record(writer, step, {"name": f"layer{index}", "phase": "forward", "seq": index, "pad": pad})
    writer.finish_step(step)
for index in range(20):
    write_record(writer, 2, {"name": f"layer{index}", "phase": "forward", "seq": index, "pad": pad})
writer.flush()
print("ready", flush=True)
index = 20
while True:  # keeps writing step 2 until killed
    write_record(writer, 2, {"name": f"layer{index}", "phase": "forward", "seq": index, "pad": pad})
    index += 1
    if index % 100 == 0:
        time.sleep(0.001)
"""


def test_sigkill_mid_write_keeps_finished_steps(tmp_path):
    out = tmp_path / "dump"
    command = [sys.executable, "-c", CRASHING_CHILD, str(out)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.3)  # step 2 is being written now
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
    assert child.returncode == -signal.SIGKILL

    assert list_steps(out) == {0: {"finished": [0, 1], "unfinished": [2]}}
    journal = out / "rank_0" / "step_000002.parquet.partial"  # what the flush reached: its Parquet journal
    assert [p.name for p in journal.iterdir()] == ["part_000000.parquet"]
    assert not list((out / "rank_0").glob("*.jsonl*"))  # no JSON on the way
    loaded = load_dump(out)
    assert [(r["step"], r["name"]) for r in loaded] == [(s, f"layer{i}") for s in (0, 1) for i in range(50)]
    with_partial = load_dump(out, include_partial=True)
    unfinished = [r["name"] for r in with_partial if r["step"] == 2]
    assert len(unfinished) >= 20  # everything flushed before "ready", in order
    assert unfinished == [f"layer{i}" for i in range(len(unfinished))]


# ------------------------------------------------------------------------------------ write errors


class FaultyFile:
    """A step file whose write() fails with ENOSPC on the n-th call overall (an injected disk-full)."""

    calls = 0

    def __init__(self, file, fail_on: int):
        self._file = file
        self._fail_on = fail_on

    def write(self, data):
        FaultyFile.calls += 1
        if FaultyFile.calls == self._fail_on:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)


@pytest.fixture
def disk_full_on(monkeypatch):
    def install(fail_on: int) -> None:
        FaultyFile.calls = 0
        real_open = stepfiles._open_step_file
        monkeypatch.setattr(stepfiles, "_open_step_file", lambda path: FaultyFile(real_open(path), fail_on))

    return install


def test_disk_full_raises_on_the_training_thread_and_keeps_finished_steps(tmp_path, disk_full_on):
    out = tmp_path / "dump"
    disk_full_on(4)  # a block per step 0 and 1, then the records of step 2: its 2nd record
    writer = JsonLinesWriter(out)
    write_steps(writer, [0, 1])
    write_record(writer, 2, record(2, 0))
    write_record(writer, 2, record(2, 1))
    write_record(writer, 2, record(2, 2))
    with pytest.raises(DumpWriteError) as raised:
        writer.flush()
    error = raised.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert error.path == out / "rank_0" / "step_000002.jsonl.partial"
    assert "step_000002.jsonl.partial" in str(error) and "No space left" in str(error)
    assert isinstance(error.__cause__, OSError)
    assert writer.error is error
    with pytest.raises(DumpWriteError):  # stays raised: the dump is broken
        write_record(writer, 3, record(3, 0))
    with pytest.raises(DumpWriteError):
        writer.finish_step(2)
    writer.close()  # already reported: close() does not raise it again

    assert names(load_dump(out)) == [(0, step, f"layer{i}") for step in (0, 1) for i in range(3)]
    assert list_steps(out) == {0: {"finished": [0, 1], "unfinished": [2]}}
    # what reached the file before the failure is complete lines only
    assert [r["name"] for r in load_dump(out, include_partial=True) if r["step"] == 2] == ["layer0"]


def test_disk_full_is_raised_by_the_next_write_or_by_close(tmp_path, disk_full_on):
    disk_full_on(1)
    writer = JsonLinesWriter(tmp_path / "a")
    write_record(writer, 0, record(0, 0))
    writer.wait_written()  # records reach the writer thread in batches: this one now (a reader's barrier)
    deadline = time.monotonic() + 10
    while writer.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(DumpWriteError, match="step_000000.jsonl.partial"):
        write_record(writer, 0, record(0, 1))
    writer.close()

    disk_full_on(1)
    writer = JsonLinesWriter(tmp_path / "b")
    write_record(writer, 0, record(0, 0))
    with pytest.raises(DumpWriteError, match="No space left"):
        writer.close()
    writer.close()
    assert list_steps(tmp_path / "b") == {0: {"finished": [], "unfinished": [0]}}


def test_fsync_failure_when_finishing_a_step(tmp_path, monkeypatch):
    out = tmp_path / "dump"
    writer = JsonLinesWriter(out)
    write_steps(writer, [0])
    writer.flush()
    real_fsync = os.fsync

    def failing_fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    write_record(writer, 1, record(1, 0))
    writer.finish_step(1)
    with pytest.raises(DumpWriteError, match="step_000001.jsonl.partial") as raised:
        writer.flush()
    assert raised.value.errno == errno.EIO
    monkeypatch.setattr(os, "fsync", real_fsync)
    writer.close()
    assert list_steps(out) == {0: {"finished": [0], "unfinished": [1]}}
    assert len(load_dump(out)) == 3


# ------------------------------------------------------------------------------------ output directory


def test_existing_dump_needs_override(tmp_path):
    out = tmp_path / "dump"
    with DumpWriter(out) as writer:
        write_steps(writer, [0, 1])
    with pytest.raises(FileExistsError, match="override_output_dir=True") as raised:
        DumpWriter(out)
    assert "choose another directory" in str(raised.value)
    assert len(load_dump(out)) == 6  # untouched

    with DumpWriter(out, override=True) as writer:
        write_record(writer, 5, record(5, 0))
    assert names(load_dump(out)) == [(0, 5, "layer0")]


def test_override_never_deletes_a_directory_that_is_not_a_dump(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    for override in (False, True):
        with pytest.raises(FileExistsError, match="not a probes dump"):
            DumpWriter(precious, override=override)
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in precious.iterdir()) == ["thesis.tex"]

    empty = tmp_path / "empty"
    empty.mkdir()
    DumpWriter(empty).close()  # an empty directory is used as is
    assert (empty / "manifest.json").is_file()


def test_unwritable_location_fails_at_construction(tmp_path):
    # Works as root too: nothing can be created below a regular file.
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with pytest.raises(OSError, match="Choose a writable output directory") as raised:
        DumpWriter(blocker / "dump")
    assert str(blocker) in str(raised.value)
    assert raised.value.errno == errno.ENOTDIR


def test_read_only_directory_fails_at_construction(tmp_path):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        try:
            (read_only / "probe").write_text("x")
        except PermissionError:
            pass
        else:
            pytest.skip("chmod does not stop this user (root); the regular-file test covers the error path")
        with pytest.raises(PermissionError, match="Choose a writable output directory") as raised:
            DumpWriter(read_only / "dump")
        assert str(read_only) in str(raised.value)
    finally:
        read_only.chmod(0o700)


# ------------------------------------------------------------------------------------ names and paths


@pytest.mark.parametrize("name", ["../../escaped", "/abs/olute", "a\\b", "nul\0byte", "..", ".hidden", "x" * 5000])
def test_model_names_never_reach_paths(tmp_path, name):
    out = tmp_path / "inner" / "dump"
    with JsonLinesWriter(out) as writer:
        write_record(writer, 0, {"name": name, "phase": "forward", "seq": 0})
    every_path = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")}
    assert every_path == {
        "inner",
        "inner/dump",
        "inner/dump/manifest.json",
        "inner/dump/rank_0",
        "inner/dump/rank_0/step_000000.jsonl",
        "inner/dump/rank_0/step_000000.order.txt",
    }
    assert [r["name"] for r in load_dump(out)] == [name]


def test_safe_component():
    hostile = ["../x", "..", ".", "a/b", "a\\b", "a\0b", ".bashrc", "é ü", "%2F", "/", "x" * 1000, "x" * 999 + "y"]
    results = [safe_component(name) for name in hostile]
    for result in results:
        assert result not in (".", "..") and not result.startswith(".")
        assert not set(result) & {"/", "\\", "\0"}
        assert 0 < len(result) <= 100
        assert re.fullmatch(r"[A-Za-z0-9._%~-]+", result)
    assert len(set(results)) == len(hostile)  # distinct names stay distinct, also when cut
    assert safe_component("layer1.weight_grad") == "layer1.weight_grad"
    assert safe_component("a/b") == "a%2Fb"
    assert safe_component("..") == "%2E."
    assert len(safe_component("y" * 300, max_length=64)) == 64
    with pytest.raises(ValueError):
        safe_component("")
    with pytest.raises(TypeError):
        safe_component(3)


# ------------------------------------------------------------------------------------ no pickle


def test_records_are_json_not_pickle(tmp_path, monkeypatch):
    source = "\n".join(module.read_text() for module in sorted(DUMP_SOURCE.glob("*.py")))
    assert "def _open_step_file" in source  # the writer's modules are all read
    assert not re.search(r"^\s*(import|from)\s+(pickle|cPickle|dill|marshal|shelve)\b", source, re.MULTILINE)
    import pickle

    def no_pickle(*args, **kwargs):
        raise AssertionError("the dump writer pickled something")

    monkeypatch.setattr(pickle, "dumps", no_pickle)
    monkeypatch.setattr(pickle, "dump", no_pickle)
    out = tmp_path / "dump"
    with JsonLinesWriter(out) as writer:
        write_steps(writer, [0])
    for line in (out / "rank_0" / "step_000000.jsonl").read_text().splitlines():
        assert json.loads(line)["name"].startswith("layer")

    # A value only pickle could store is an error when its Arrow batch is made, not silently stored.
    with JsonLinesWriter(tmp_path / "other") as writer:
        with pytest.raises(TypeError, match="not JSON serializable"):
            write_record(writer, 0, {"name": "bad", "phase": "forward", "seq": 0, "value": {1, 2}})
    assert list_steps(tmp_path / "other") == {0: {"finished": [], "unfinished": []}}


# ------------------------------------------------------------------------------------ reader errors


@pytest.fixture
def finished_dump(tmp_path) -> Path:
    out = tmp_path / "dump"
    with JsonLinesWriter(out) as writer:
        write_steps(writer, [0, 1])
    return out


def rewrite_line(path: Path, number: int, text: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number - 1] = text
    path.write_text("".join(lines))


def test_corrupted_line_names_file_and_line(finished_dump):
    step_file = finished_dump / "rank_0" / "step_000001.jsonl"
    rewrite_line(step_file, 2, '{"name": "layer1", "mean": 0.\n')
    with pytest.raises(DumpFormatError) as raised:
        load_dump(finished_dump)
    assert raised.value.path == step_file and raised.value.line == 2
    assert str(step_file) in str(raised.value) and "line 2" in str(raised.value) and "invalid JSON" in str(raised.value)


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"phase": "forward"}\n', "missing key 'name'"),
        ("[1, 2]\n", "expected a JSON object"),
        ("\n", "empty line"),
        ('{"name": "x", "step": 7}\n', "step 7"),
    ],
)
def test_invalid_record_names_file_and_line(finished_dump, text, problem):
    step_file = finished_dump / "rank_0" / "step_000000.jsonl"
    rewrite_line(step_file, 3, text)
    with pytest.raises(DumpFormatError, match=re.escape(problem)) as raised:
        load_dump(step_file)
    assert f"{step_file}, line 3" in str(raised.value)


def test_truncated_finished_file_is_corruption_but_a_truncated_partial_is_expected(finished_dump):
    rank_dir = finished_dump / "rank_0"
    data = (rank_dir / "step_000001.jsonl").read_bytes()
    (rank_dir / "step_000001.jsonl").write_bytes(data[:-10])
    with pytest.raises(DumpFormatError, match="truncated last line") as raised:
        load_dump(finished_dump)
    assert raised.value.line == 3 and "step_000001.jsonl, line 3" in str(raised.value)

    # The same bytes as an unfinished step: the cut line is skipped, the complete ones load.
    (rank_dir / "step_000001.jsonl").rename(rank_dir / "step_000001.jsonl.partial")
    assert [r["step"] for r in load_dump(finished_dump)] == [0, 0, 0]
    loaded = load_dump(finished_dump, include_partial=True)
    assert [(r["step"], r["name"]) for r in loaded[3:]] == [(1, "layer0"), (1, "layer1")]


def test_a_finished_step_that_lost_whole_lines_is_truncated(finished_dump, tmp_path):
    rank_dir = finished_dump / "rank_0"
    step_file = rank_dir / "step_000001.jsonl"
    step_file.write_text("".join(step_file.read_text().splitlines(keepends=True)[:2]))  # cut at a line boundary
    problem = "truncated: step_000001.order.txt lists 3 records, the step file has 2"
    for path in (finished_dump, rank_dir, step_file):
        with pytest.raises(DumpFormatError, match=re.escape(problem)) as raised:
            load_dump(path)
        assert raised.value.path == step_file and raised.value.line == 3
    assert list_steps(finished_dump) == {0: {"finished": [0, 1], "unfinished": []}}  # listing reads no records

    # Without an order file to count against (a lone copy, or an order file gone) there is nothing to check.
    lone = tmp_path / "step_000001.jsonl"
    lone.write_text("".join(json.dumps({**json.loads(line), "rank": 0, "step": 1}) + "\n"
                            for line in step_file.read_text().splitlines()))
    assert [r["name"] for r in load_dump(lone)] == ["layer0", "layer1"]
    (rank_dir / "step_000001.order.txt").unlink()
    assert len(load_dump(finished_dump)) == 5


def test_dump_reader(tmp_path):
    out = tmp_path / "dump"
    writer = JsonLinesWriter(out)
    write_steps(writer, [0, 1])
    write_record(writer, 2, record(2, 0))
    writer.flush()
    rank_dir = out / "rank_0"
    reader = DumpReader(out)  # the live writer is waited for
    assert reader.path == out
    assert reader.step_files() == [StepFile(rank_dir / f"step_00000{step}.jsonl", 0, step, True) for step in (0, 1)]
    assert reader.step_files(include_partial=True)[-1] == StepFile(rank_dir / "step_000002.jsonl.partial", 0, 2, False)
    assert reader.steps() == list_steps(out) == {0: {"finished": [0, 1], "unfinished": [2]}}
    assert reader.read(reader.step_files()[1]) == load_dump(rank_dir / "step_000001.jsonl")
    assert reader.records() == load_dump(out)
    assert reader.records(include_partial=True) == load_dump(out, include_partial=True)
    assert len(reader.records(include_partial=True)) == 7

    lone = DumpReader(rank_dir / "step_000002.jsonl.partial")  # a lone step file: listed finished or not
    assert lone.step_files() == [StepFile(rank_dir / "step_000002.jsonl.partial", 0, 2, False)]
    assert lone.steps() == {0: {"finished": [], "unfinished": [2]}}
    with pytest.raises(ValueError, match="include_partial=True"):
        lone.records()
    assert [r["name"] for r in lone.records(include_partial=True)] == ["layer0"]
    writer.close()
    assert DumpReader(out).steps() == {0: {"finished": [0, 1, 2], "unfinished": []}}
    assert reader.steps() == {0: {"finished": [0, 1], "unfinished": [2]}}  # listed once, when opened

    for bad, error in ((tmp_path / "missing", FileNotFoundError), (tmp_path, DumpFormatError)):
        with pytest.raises(error):
            DumpReader(bad)


def test_not_a_dump(tmp_path):
    (tmp_path / "somewhere").mkdir()
    with pytest.raises(DumpFormatError, match="not a probes dump"):
        load_dump(tmp_path / "somewhere")
    with pytest.raises(FileNotFoundError):
        list_steps(tmp_path / "missing")


# ------------------------------------------------------------------------------------ display


def test_format_records_table():
    rows = [
        {**record(3, 0), "rank": 0, "step": 3, "std": None},
        {**record(3, 1, phase="backward"), "rank": 0, "step": 3, "name": "evil\x1b[2J"},
    ]
    lines = format_records(rows).splitlines()
    header = ["step", "phase", "seq", "name", "shape", "dtype", "min", "max", "mean", "std", "norm", "nan", "inf"]
    assert lines[0].split() == header
    first = ["3", "forward", "0", "layer0", "[2,", "3]", "torch.float32", "-1.5", "2.25", "0", "-", "0", "0"]
    assert lines[1].split() == first
    assert "\x1b" not in lines[2] and "backward" in lines[2]
    assert len(lines) == 3
    assert format_records([{**rows[0], "rank": 1}, rows[0]]).splitlines()[0].split()[0] == "rank"


def test_show_main(finished_dump, capsys):
    assert show_main([str(finished_dump), "--step", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["step", "phase", "seq", "name"]
    assert [line.split()[0] for line in out[1:]] == ["1", "1", "1"]

    assert show_main([str(finished_dump), "--step", "9"]) == 2
    assert "no records match" in capsys.readouterr().err
    assert show_main([str(finished_dump / "nowhere")]) == 2
    assert "error" in capsys.readouterr().err
    assert show_main(["--bogus"]) == 2


def test_a_rank_joins_while_another_rank_is_still_writing_the_manifest(tmp_path):
    # Rank 0 has created the directory and is between writing its temporary manifest and renaming it.
    root = tmp_path / "dump"
    (root / "rank_0").mkdir(parents=True)
    (root / ".manifest.json.12345.140000000000.tmp").write_text("{}")
    writer = DumpWriter(root, rank=1)
    write_record(writer, 0, {"name": "x", "phase": "forward", "seq": 0})
    writer.close()
    assert [r["rank"] for r in load_dump(root / "rank_1")] == [1]
    # A directory holding anything else is still refused.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a probes dump"):
        DumpWriter(tmp_path / "other", rank=0)
