"""Reading a dump this process is still writing, and exiting with a dump directory that is gone.

Readers (DumpReader, load_dump, list_steps, compare, assert_parity) wait for the live writer of the directory
they read, so every finished step is visible without a sleep; at interpreter exit, what could not be
written is one warning line, never a traceback.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager
from probes.compare import compare_dumps
from probes.compare.reading import read_dump
from probes.dump import DumpReader, DumpWriteError, load_dump
from probes.dump.live import flush_writers
from probes.dump.reader import list_steps
from probes.dump.writer import DumpWriter
from dump_records import write_record
from probes.dump import reader as dump_reader
from probes.dump import stepfiles
from probes.models import TinyTransformer, TransformerConfig, make_batch
from probes.testing import assert_parity
from test_dump import IMPORT_DUMP_WITHOUT_TORCH

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def record(index: int, phase: str = "forward") -> dict:
    return {"name": f"layer{index}", "phase": phase, "seq": index, "shape": [2], "dtype": "float32",
            "numel": 2, "min": 0.0, "max": 1.0, "mean": 0.5, "std": 0.7, "nan": 0, "inf": 0}


def write_steps(writer: DumpWriter, steps, per_step: int = 3) -> None:
    for step in steps:
        for index in range(per_step):
            write_record(writer, step, record(index))
        writer.finish_step(step)


@pytest.fixture
def slow_writer(monkeypatch):
    """Makes finishing a step take 50 ms on the writer thread, so a reader that does not wait misses steps."""
    real = stepfiles.fsync_dir

    def slow(path):
        time.sleep(0.05)
        real(path)

    monkeypatch.setattr(stepfiles, "fsync_dir", slow)


def finished(path) -> list[int]:
    return list_steps(path)[0]["finished"]


# ------------------------------------------------------------------------------------ readers wait


def test_the_race_is_real_without_waiting(tmp_path, slow_writer):
    writer = DumpWriter(tmp_path / "d")
    write_steps(writer, range(STEPS))
    assert len(dump_reader._list_steps(tmp_path / "d")[0]["finished"]) < STEPS  # what readers saw before the fix
    writer.close()


def test_every_reader_sees_every_finished_step_without_a_sleep(tmp_path, slow_writer, monkeypatch):
    out = tmp_path / "d"
    writers = [DumpWriter(out), DumpWriter(tmp_path / "e")]
    for writer in writers:
        write_steps(writer, range(STEPS))
    assert finished(out) == list(range(STEPS))

    write_steps(writers[0], [STEPS])
    assert {r["step"] for r in load_dump(out)} == set(range(STEPS + 1))
    for writer in writers[1:]:
        write_steps(writer, [STEPS])
    assert read_dump(tmp_path / "e", progress=False).steps_by_rank == {0: list(range(STEPS + 1))}

    for writer in writers:
        write_steps(writer, [STEPS + 1])
    report = compare_dumps(out, tmp_path / "e")
    assert report.agrees and report.base_steps == report.other_steps == {0: list(range(STEPS + 2))}
    for writer in writers:
        write_steps(writer, [STEPS + 2])
    assert_parity(out, tmp_path / "e")
    write_steps(writers[0], [STEPS + 3])
    assert [step_file.step for step_file in DumpReader(out).step_files()] == list(range(STEPS + 4))
    for writer in writers:
        writer.close()


@pytest.mark.parametrize("spelling", ["rank_dir", "step_file", "relative", "symlink"])
def test_the_path_read_may_be_any_spelling_of_the_writers_directory(tmp_path, slow_writer, monkeypatch, spelling):
    out = tmp_path / "d"
    writer = DumpWriter(out)
    write_steps(writer, range(STEPS))
    if spelling == "rank_dir":
        assert [r["step"] for r in load_dump(out / "rank_0")][-1] == STEPS - 1
    elif spelling == "step_file":  # the renamed file exists only once the writer got to it
        assert len(load_dump(out / "rank_0" / f"step_{STEPS - 1:06d}.parquet")) == 3
    elif spelling == "relative":
        monkeypatch.chdir(tmp_path)
        assert finished("d") == list(range(STEPS))
    else:
        (tmp_path / "link").symlink_to(out, target_is_directory=True)
        assert finished(tmp_path / "link") == list(range(STEPS))
    writer.close()


def test_open_steps_show_their_lines_to_include_partial(tmp_path):
    writer = DumpWriter(tmp_path / "d")
    for index in range(5):
        write_record(writer, 0, record(index))
    assert [r["name"] for r in load_dump(tmp_path / "d", include_partial=True)] == [f"layer{i}" for i in range(5)]
    assert list_steps(tmp_path / "d") == {0: {"finished": [], "unfinished": [0]}}
    writer.close()


def test_readers_wait_only_for_writers_of_the_directory_they_read(tmp_path, monkeypatch):
    release = threading.Event()
    real = stepfiles.fsync_dir

    def blocking(path):
        if "blocked" in str(path) and threading.current_thread().name.startswith("probes-dump-writer"):
            release.wait(30)
        real(path)

    monkeypatch.setattr(stepfiles, "fsync_dir", blocking)
    free, blocked = DumpWriter(tmp_path / "free"), DumpWriter(tmp_path / "blocked")
    try:
        write_steps(blocked, [0])
        write_steps(free, [0])
        started = time.monotonic()
        assert finished(tmp_path / "free") == [0]
        assert time.monotonic() - started < 5
    finally:
        release.set()
    assert finished(tmp_path / "blocked") == [0]
    free.close()
    blocked.close()


class FailingFile:
    """A step file whose every write fails with ENOSPC (an injected disk-full)."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._file, name)


def test_a_reader_never_raises_the_error_of_a_failed_writer(tmp_path, monkeypatch):
    out = tmp_path / "d"
    writer = DumpWriter(out)
    write_steps(writer, [0, 1])
    writer.flush()
    def disk_full(path, table, durable=True):  # the journal of step 2, written at a reader's sync
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(stepfiles, "write_parquet", disk_full)
    write_record(writer, 2, record(0))
    deadline = time.monotonic() + 10
    while writer.error is None and time.monotonic() < deadline:
        assert finished(out) == [0, 1]  # the reader reads what is there, before and after the failure
    assert writer.error is not None
    assert [r["step"] for r in load_dump(out)] == [0, 0, 0, 1, 1, 1]
    assert read_dump(out, progress=False).steps_by_rank == {0: [0, 1]}
    with pytest.raises(DumpWriteError, match="No space left"):  # the training thread still gets it
        write_record(writer, 2, record(1))
    writer.close()


# ------------------------------------------------------------------------------------ training + TemporaryDirectory


class FinishedSteps(StatisticsSubscriber):
    """StatisticsSubscriber that remembers which steps the manager finished."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished: list[int] = []

    def on_event(self, event) -> None:
        super().on_event(event)
        if event.kind == "step_end":
            self.finished.append(event.step)


def train(model, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        batch = make_batch(model.config, batch_size=2, seed=step)
        optimizer.zero_grad()
        model(batch["tokens"], labels=batch["labels"]).backward()
        optimizer.step()


def test_temporary_directory_holding_a_live_dump_cleans_up_after_training_and_reading(slow_writer):
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=1, d_ff=32, seq_len=8))
    manager = SubscriberManager()
    with tempfile.TemporaryDirectory() as tmp:
        subscriber = FinishedSteps(Path(tmp) / "dump")
        manager.subscribe(model, [subscriber])
        train(model, STEPS)
        # Closes a step the manager may still hold open; the writer stays live, no next forward.
        manager.flush()
        assert subscriber.finished == list(range(STEPS))
        assert sorted({r["step"] for r in load_dump(Path(tmp) / "dump")}) == list(range(STEPS))
        assert compare_dumps(Path(tmp) / "dump", Path(tmp) / "dump").agrees
    assert not os.path.exists(tmp)  # removed without error while the writer was live
    manager.unsubscribe()


def test_steps_the_manager_finished_are_all_visible_right_after_training(tmp_path, slow_writer):
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=1, d_ff=32, seq_len=8))
    manager = SubscriberManager()
    subscriber = FinishedSteps(tmp_path / "dump")
    manager.subscribe(model, [subscriber])
    train(model, STEPS)
    seen = sorted({r["step"] for r in load_dump(tmp_path / "dump")})
    assert seen == subscriber.finished and len(seen) >= STEPS - 1  # the last one closes with its backward
    manager.unsubscribe()
    assert finished(tmp_path / "dump") == list(range(STEPS))


# ------------------------------------------------------------------------------------ removed directory


def test_close_after_the_directory_was_removed_says_so_once(tmp_path):
    import shutil

    writer = DumpWriter(tmp_path / "d")
    write_steps(writer, [0])
    write_record(writer, 1, record(0))
    flush_writers(tmp_path / "d")
    shutil.rmtree(tmp_path / "d")
    with pytest.raises(DumpWriteError, match=r"dump directory .*d.* was removed"):
        writer.close()
    writer.close()  # idempotent


def run_script(source: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Runs ``source`` in a fresh interpreter: argv[1] is the dump directory."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-c", textwrap.dedent(source), str(tmp_path / "dump")]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def warnings_of(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "RuntimeWarning: probes: " in line]


def assert_one_clean_warning(result: subprocess.CompletedProcess, directory: Path, steps: str) -> None:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    lines = warnings_of(result)
    assert len(lines) == 1, result.stderr
    assert str(directory) in lines[0] and "was removed" in lines[0] and steps in lines[0], lines[0]


WRITER_SCRIPT = IMPORT_DUMP_WITHOUT_TORCH + """
import shutil
writer = DumpWriter(sys.argv[1])
for step in (0, 1):
    write_record(writer, step, {"name": "a", "phase": "forward", "seq": 0})
    writer.finish_step(step)
write_record(writer, 2, {"name": "a", "phase": "forward", "seq": 0})
writer.flush()
shutil.rmtree(sys.argv[1])
if "{more}" == "yes":  # a record after the removal: the writer thread fails on it
    write_record(writer, 3, {"name": "a", "phase": "forward", "seq": 0})
"""


@pytest.mark.parametrize("more,steps", [("no", "step 2 was not written"), ("yes", "steps 2, 3 were not written")])
def test_exit_with_a_live_writer_whose_directory_was_removed(tmp_path, more, steps):
    result = run_script(WRITER_SCRIPT.replace("{more}", more), tmp_path)
    assert_one_clean_warning(result, tmp_path / "dump", steps)


MANAGER_SCRIPT = """
import shutil, sys
import torch
from probes import StatisticsSubscriber, SubscriberManager
from probes.dump.live import flush_writers
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
SubscriberManager.subscribe(model, [StatisticsSubscriber(sys.argv[1])])
for step in range(2):
    model(torch.randn(3, 4)).sum().backward()
with torch.no_grad():
    model(torch.randn(3, 4))  # an evaluation step: open until the next forward, a flush or unsubscribe
flush_writers(sys.argv[1])
shutil.rmtree(sys.argv[1])
# no unsubscribe(): the manager's atexit hook finishes the open step into a directory that is gone
"""


def test_exit_with_a_subscribed_model_whose_dump_directory_was_removed(tmp_path):
    result = run_script(MANAGER_SCRIPT, tmp_path)
    assert_one_clean_warning(result, tmp_path / "dump", "step 2 was not written")


CLOSED_BY_HAND_SCRIPT = """
import sys
import torch
from probes import StatisticsSubscriber, SubscriberManager
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
subscriber = StatisticsSubscriber(sys.argv[1])
SubscriberManager.subscribe(model, [subscriber])
model(torch.randn(3, 4)).sum().backward()
with torch.no_grad():
    model(torch.randn(3, 4))
subscriber.close()  # by hand, before unsubscribe(): it finishes the open step itself
"""


def test_exit_after_the_subscriber_was_closed_by_hand(tmp_path):
    result = run_script(CLOSED_BY_HAND_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    assert warnings_of(result) == []  # nothing was lost
    assert list_steps(tmp_path / "dump")[0] == {"finished": [0, 1], "unfinished": []}


def test_on_step_written_sees_each_finished_step_off_the_training_thread(tmp_path, capfd, caplog):
    seen = []

    def listener(step, path):
        # Reads the finished file on the writer's own thread (wait=False: waiting would wait for itself).
        seen.append((step, path.name, [r["name"] for r in DumpReader(path, wait=False).records()],
                     threading.current_thread() is threading.main_thread()))

    with DumpWriter(tmp_path / "d", rank=0, on_step_written=listener) as writer:
        for step in range(3):
            write_record(writer, step, {"name": f"n{step}", "phase": "forward", "seq": 0})
            writer.finish_step(step)
    assert seen == [(s, f"step_{s:06d}.parquet", [f"n{s}"], False) for s in range(3)]

    def broken(step, path):
        raise RuntimeError("tensorboard is gone")

    with DumpWriter(tmp_path / "e", rank=0, on_step_written=broken) as writer:
        for step in range(3):
            write_record(writer, step, {"name": "n", "phase": "forward", "seq": 0})
            writer.finish_step(step)
    logged = [r.getMessage() for r in caplog.records if r.name == "probes.dump.writer" and r.levelname == "WARNING"]
    assert len(logged) == 1 and "on_step_written" in logged[0] and "RuntimeError: tensorboard is gone" in logged[0]
    assert "tensorboard is gone" not in capfd.readouterr().err.replace(logged[0], "")  # logged, not printed
    assert list_steps(tmp_path / "e") == {0: {"finished": [0, 1, 2], "unfinished": []}}
