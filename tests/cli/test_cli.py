"""The ``probes`` command: the console script, ``--help`` on each subcommand, and bad input as one line, exit 2."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from probes.cli import COMMANDS, main
from probes.dump.writer import DumpWriter
from dump_records import write_record


def record(step, name, seq, mean=0.5, rank=0):
    return {"rank": rank, "step": step, "phase": "forward", "seq": seq, "name": name, "module": name.split(".")[0],
            "tensor_index": 0, "shape": [2], "dtype": "float32", "numel": 2, "finite": 2, "nan": 0, "inf": 0,
            "min": 0.0, "max": 1.0, "mean": mean, "std": 0.7}


def write_run(path, names=("a.output.0", "b.output.0"), steps=2, finish=True):
    writer = DumpWriter(path, rank=0)
    for step in range(steps):
        for seq, name in enumerate(names):
            write_record(writer, step, record(step, name, seq))
        if finish:
            writer.finish_step(step)
    writer.flush()
    return writer


@pytest.fixture
def runs(tmp_path):
    write_run(tmp_path / "base").close()
    write_run(tmp_path / "other").close()
    return tmp_path / "base", tmp_path / "other"


def one_line_error(capsys, command):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"probes {command}: error: "), err
    return lines[0]


def test_every_subcommand_has_help_with_an_example(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert all(name in top for name in ("show", "compare", "export", "tensorboard", "merge")) and "exit codes" in top
    for name in COMMANDS:
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: probes {name}") and "examples:" in out and f"probes {name} " in out
        assert "exit codes: 0 success" in out


@pytest.mark.parametrize("command", ["show", "compare", "export", "tensorboard"])
def test_a_path_that_is_not_a_dump(tmp_path, capsys, command):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    extra = {"show": [], "compare": [str(tmp_path / "notes")], "export": ["--format", "csv", "--output",
             str(tmp_path / "o.csv")], "tensorboard": ["--logdir", str(tmp_path / "tb")]}[command]
    for path in (tmp_path / "notes", tmp_path / "notes" / "todo.txt", tmp_path / "missing"):
        assert main([command, str(path), *extra]) == 2
        line = one_line_error(capsys, command)
        assert str(path) in line and ("not a probes dump" in line or "not a step file" in line
                                      or "no such file or directory" in line)
        assert "give a dump directory" in line


def test_an_empty_dump(tmp_path, capsys):
    DumpWriter(tmp_path / "empty", rank=0).close()
    assert main(["show", str(tmp_path / "empty")]) == 2
    line = one_line_error(capsys, "show")
    assert "is an empty dump (no step files)" in line and "start_step/end_step" in line


def test_a_dump_still_being_written(tmp_path, capsys, runs):
    writer = write_run(tmp_path / "live", finish=False)  # records on disk, no step finished yet
    try:
        for argv, command in ((["show", str(tmp_path / "live")], "show"),
                              (["compare", str(runs[0]), str(tmp_path / "live")], "compare")):
            # Readers of this process wait for its live writers; another process's writer cannot be waited
            # for, so read from a child process, as a user's shell would.
            done = subprocess.run([sys.executable, "-m", "probes", *argv], capture_output=True, text=True)
            assert done.returncode == 2, done.stderr
            assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
            assert f"probes {command}: error: {tmp_path / 'live'} has only unfinished steps (2)" in done.stderr
            assert "still being written" in done.stderr and "--include-partial" in done.stderr
        assert main(["show", str(tmp_path / "live"), "--include-partial"]) == 0
    finally:
        writer.close()


def test_two_dumps_with_no_common_records(tmp_path, capsys):
    write_run(tmp_path / "a", names=("a.output.0",)).close()
    write_run(tmp_path / "b", names=("z.output.0",)).close()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    line = one_line_error(capsys, "compare")
    assert "have no record in common" in line and "'a.output.0'" in line and "'z.output.0'" in line


def test_usage_errors_are_one_line(capsys, runs):
    assert main(["compare", str(runs[0])]) == 2
    assert "give the dump OTHER to compare with BASE" in one_line_error(capsys, "compare")
    assert main(["show", str(runs[0]), "--step", "x"]) == 2
    assert "invalid int value" in one_line_error(capsys, "show")
    assert main(["show", str(runs[0]), "--step", "7"]) == 2
    assert "no records match" in one_line_error(capsys, "show")
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["probes: error: unknown command 'frobnicate'; expected one of show, compare, export, tensorboard, "
                   "merge (see probes --help)"]
    assert main([]) == 2 and "usage: probes <command>" in capsys.readouterr().err


def test_the_runs_agree_and_differ_with_exit_codes_0_and_1(tmp_path, capsys, runs):
    assert main(["compare", str(runs[0]), str(runs[1]), "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "agree"
    writer = DumpWriter(tmp_path / "changed", rank=0)
    for step in range(2):
        for seq, name in enumerate(("a.output.0", "b.output.0")):
            write_record(writer, step, record(step, name, seq, mean=0.6 if (step, name) == (1, "b.output.0") else 0.5))
        writer.finish_step(step)
    writer.close()
    assert main(["compare", str(runs[0]), str(tmp_path / "changed")]) == 1
    assert "verdict: DIVERGED at rank 0, step 1, forward, b.output.0 (mean)" in capsys.readouterr().out


def test_the_console_script(runs):
    """``probes`` on PATH is setup.cfg's entry point (./dev installs it into each lane)."""
    script = shutil.which("probes")
    if script is None:
        if os.environ.get("PROBES_LANE"):
            pytest.fail("./dev's lane has no probes command: the editable install of setup.cfg's entry point is missing")
        pytest.skip("not run through ./dev and probes is not installed")
    done = subprocess.run([script, "compare", str(runs[0]), str(runs[1])], capture_output=True, text=True)
    assert done.returncode == 0 and "verdict: AGREE" in done.stdout
    done = subprocess.run([script, "show", str(runs[0] / "nothing")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("probes show: error: ") and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["compare", "merge", "export", "tensorboard", "show"])
def test_the_flags_are_the_declared_options(command):
    """Each flag of these commands, its help and its default come from one dataclass field (probes.utils.flags)."""
    from probes.cli.compare import CompareCommand, parser as compare_parser
    from probes.cli.export import export_parser, tensorboard_parser
    from probes.cli.merge import parser as merge_parser
    from probes.cli.show import ShowOptions, parser as show_parser
    from probes.compare.summaries import MergeConfig
    from probes.sinks.output import ExportOptions
    from probes.sinks.tensorboard import TensorBoardOptions
    from probes.utils.flags import COMMAND_LINE, declared, help_of

    parser, cls = {"compare": (compare_parser, CompareCommand), "merge": (merge_parser, MergeConfig),
                   "export": (export_parser, ExportOptions), "tensorboard": (tensorboard_parser, TensorBoardOptions),
                   "show": (show_parser, ShowOptions)}[command]
    actions = {action.dest: action for action in parser()._actions if action.dest != "help"}
    fields = declared(cls, COMMAND_LINE)
    assert list(actions) == [f.name for f, _ in fields]
    for f, how in fields:
        assert actions[f.name].help.replace("%%", "%") == help_of(cls, how, COMMAND_LINE)
        assert actions[f.name].required == (f.default is dataclasses.MISSING)  # a positional one too
