"""The trainer step map beside a dump: written per update, read back, shown by ``probes show``."""

from __future__ import annotations

import pytest

from probes.cli import main
from probes.dump import DumpFormatError
from probes.dump.trainer_steps import TrainerStep, TrainerStepLog, read_trainer_steps
from probes.dump.writer import DumpWriter
from dump_records import write_record


def write_dump(path, steps=3, rank=0):
    writer = DumpWriter(path, rank=rank)
    for step in range(steps):
        write_record(writer, step, {"rank": rank, "step": step, "phase": "forward", "seq": 0, "name": "fc.output.0",
                            "mean": 0.5})
        writer.finish_step(step)
    writer.close()


def test_entries_round_trip_per_rank_from_any_path_the_readers_take(tmp_path):
    write_dump(tmp_path / "d", rank=0)
    write_dump(tmp_path / "d", rank=1)
    for rank in (0, 1):
        log = TrainerStepLog(tmp_path / "d", rank=rank)
        log.append([TrainerStep(step=0, trainer_step=1, micro_step=0, epoch=0.5),
                    TrainerStep(step=1, trainer_step=1, micro_step=1, epoch=0.5)])
        log.append([TrainerStep(step=2, trainer_step=None, micro_step=0)])
    both = read_trainer_steps(tmp_path / "d")
    assert set(both) == {0, 1}
    assert both[1][1] == TrainerStep(step=1, trainer_step=1, micro_step=1, epoch=0.5)
    assert both[0][2].describe() == "before any trainer step ended, micro-batch 0"
    assert set(read_trainer_steps(tmp_path / "d" / "rank_1")) == {1}
    assert set(read_trainer_steps(tmp_path / "d" / "rank_0" / "step_000001.parquet")) == {0}
    assert read_trainer_steps(tmp_path / "nowhere") == {}


def test_a_cut_last_line_is_skipped_and_a_bad_line_is_an_error_naming_it(tmp_path):
    write_dump(tmp_path / "d")
    log = TrainerStepLog(tmp_path / "d", rank=0)
    log.append([TrainerStep(step=0, trainer_step=1, micro_step=0)])
    with open(log.path, "a") as f:
        f.write('{"step": 1, "trainer_st')  # a crash while appending
    assert list(read_trainer_steps(tmp_path / "d")[0]) == [0]
    log.path.write_text('{"step": 0, "trainer_step": 1, "micro_step": 0}\nnot json\n')
    with pytest.raises(DumpFormatError, match=r"trainer_steps\.jsonl, line 2: not a trainer step entry"):
        read_trainer_steps(tmp_path / "d")


def test_show_prints_the_trainer_step_beside_each_step(tmp_path, capsys):
    write_dump(tmp_path / "d")
    TrainerStepLog(tmp_path / "d", rank=0).append(
        [TrainerStep(step=0, trainer_step=1, micro_step=0), TrainerStep(step=1, trainer_step=1, micro_step=1)])
    assert main(["show", str(tmp_path / "d")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["step", "trainer_step", "micro_step", "phase"]
    assert [line.split()[:3] for line in lines[1:4]] == [["0", "1", "0"], ["1", "1", "1"], ["2", "-", "-"]]


def test_show_without_a_map_has_no_trainer_columns_and_a_damaged_map_is_a_note(tmp_path, capsys):
    write_dump(tmp_path / "d")
    assert main(["show", str(tmp_path / "d")]) == 0
    assert "trainer_step" not in capsys.readouterr().out
    TrainerStepLog(tmp_path / "d", rank=0).path.write_text("garbage\n")
    assert main(["show", str(tmp_path / "d"), "--step", "1"]) == 0
    captured = capsys.readouterr()
    assert "trainer_step" not in captured.out and "fc.output.0" in captured.out
    assert "note: the trainer step map is not readable" in captured.err and "Traceback" not in captured.err


def test_compare_names_the_trainer_step_of_the_first_divergence(tmp_path, capsys):
    import json

    write_dump(tmp_path / "a")
    writer = DumpWriter(tmp_path / "b", rank=0)
    for step in range(3):
        write_record(writer, step, {"rank": 0, "step": step, "phase": "forward", "seq": 0, "name": "fc.output.0",
                            "mean": 0.5 if step < 2 else 0.9})
        writer.finish_step(step)
    writer.close()
    TrainerStepLog(tmp_path / "b", rank=0).append(
        [TrainerStep(step=step, trainer_step=step // 2 + 1, micro_step=step % 2) for step in range(3)])
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert "first divergence in the other run's trainer numbering: trainer step 2, micro-batch 0" in out
    assert "base run's trainer numbering" not in out  # the base run has no map
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["first_divergence_trainer_steps"] == {
        "other": {"step": 2, "trainer_step": 2, "micro_step": 0, "epoch": None}}
