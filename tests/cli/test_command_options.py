"""export, tensorboard and show, each option declared once (``ExportOptions``, ``TensorBoardOptions``,
``ShowOptions``): the Python function's arguments, the command's flags, their help and their checks are one list,
read the same way, and fail the same way."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from probes.cli import main
from probes.cli.export import export_parser, tensorboard_parser
from probes.cli.show import ShowOptions, parser as show_parser
from probes.dump.writer import DumpWriter
from probes.sinks import LiveTensorBoard, export_dump, write_tensorboard
from probes.sinks.output import ExportOptions
from probes.sinks.tensorboard import ScalarOptions, TensorBoardOptions
from probes.utils.flags import COMMAND_LINE, OptionError, declared, given, keywords, spelling
from dump_records import write_record

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"export": (export_parser, ExportOptions), "tensorboard": (tensorboard_parser, TensorBoardOptions),
            "show": (show_parser, ShowOptions)}
FUNCTIONS = {"export": (export_dump, ExportOptions), "tensorboard": (write_tensorboard, TensorBoardOptions)}
# The flags each command had before its options were declared once: none lost, none added.
FLAGS = {"export": {"--format", "--output", "--rank", "--overwrite"},
         "tensorboard": {"--logdir", "--module", "--phase", "--overwrite"},
         "show": {"--step", "--rank", "--include-partial", "--skip-damaged", "--anomalies", "--max-abs"}}


@pytest.fixture
def dump(tmp_path):
    for rank in (0, 1):
        writer = DumpWriter(tmp_path / "run", rank=rank)
        for step in range(2):
            for seq, name in enumerate(("fc.output.0", "head.output.0")):
                write_record(writer, step, {"name": name, "phase": "forward", "seq": seq, "module": name.split(".")[0],
                                            "shape": [2], "dtype": "float32", "numel": 2, "finite": 2, "nan": 0,
                                            "inf": 0, "min": 0.0, "max": 1.0 + rank, "mean": 0.5 * step, "std": 0.7})
            writer.finish_step(step)
        writer.close()
    return tmp_path / "run"


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


@pytest.mark.parametrize("command", sorted(FUNCTIONS))
def test_every_option_is_an_argument_or_a_keyword_and_a_flag_with_its_help(command):
    function, cls = FUNCTIONS[command]
    signature = inspect.signature(function).parameters
    positional = [f.name for f, how in declared(cls) if how.positional]
    assert list(signature) == [*positional, *keywords(cls)]
    for f, how in declared(cls):
        parameter = signature[f.name]
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert parameter.default == default and parameter.kind is (
            inspect.Parameter.POSITIONAL_OR_KEYWORD if how.positional else inspect.Parameter.KEYWORD_ONLY)
        assert how.positional or f"``{f.name}" in function.__doc__, f.name


def test_live_tensorboard_takes_write_tensorboards_options_but_the_dump_and_the_progress_bar():
    live = inspect.signature(LiveTensorBoard).parameters
    written = inspect.signature(write_tensorboard).parameters
    assert list(live) == ["logdir", *keywords(ScalarOptions)] == [name for name in written if name not in
                                                                  ("dump", "progress")]
    assert all(live[name].default == written[name].default for name in keywords(ScalarOptions))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_commands_keep_their_flags_and_an_unused_flag_keeps_the_default(command):
    """The flags come from the declaration (tests/cli/test_cli.py: test_the_flags_are_the_declared_options)."""
    parser, cls = COMMANDS[command]
    actions = [action for action in parser()._actions if action.dest != "help"]
    assert {flag for action in actions for flag in action.option_strings} == FLAGS[command]
    assert [action.metavar for action in actions if not action.option_strings] == ["DUMP"]
    required = {"export": ["--format", "csv", "--output", "out"], "tensorboard": ["--logdir", "tb"], "show": []}
    unused = cls(**given(cls, parser().parse_args(["run", *required[command]])))
    assert all(getattr(unused, f.name) == f.default for f, _ in declared(cls) if f.default is not dataclasses.MISSING)


def test_the_command_line_and_python_read_the_same_options():
    argv = ["run", "--format", "csv", "--output", "out.csv", "--rank", "1", "--overwrite"]
    assert ExportOptions(**given(ExportOptions, export_parser().parse_args(argv))) == \
        ExportOptions(dump="run", output="out.csv", format="csv", rank=1, overwrite=True)
    argv = ["run", "--logdir", "tb", "--module", "fc", "--module", "re:he.*", "--phase", "forward", "--phase", "grad",
            "--overwrite"]
    assert TensorBoardOptions(**given(TensorBoardOptions, tensorboard_parser().parse_args(argv))) == \
        TensorBoardOptions(dump="run", logdir="tb", modules=["fc", "re:he.*"], phases=["forward", "grad"],
                           overwrite=True)
    argv = ["run", "--step", "3", "--rank", "1", "--include-partial", "--skip-damaged", "--anomalies", "--max-abs",
            "65504"]
    assert ShowOptions(**given(ShowOptions, show_parser().parse_args(argv))) == \
        ShowOptions(dump="run", step=3, rank=1, include_partial=True, skip_damaged=True, anomalies=True,
                    max_abs=65504.0)


def test_the_command_line_writes_what_python_writes(dump, tmp_path, capsys):
    code, out, _ = _run(capsys, ["export", str(dump), "--format", "csv", "--output", str(tmp_path / "cli.csv"),
                                 "--rank", "1"])
    summary = export_dump(dump, tmp_path / "python.csv", format="csv", rank=1)
    assert code == 0 and out.strip() == f"csv: {summary}".replace("python.csv", "cli.csv")
    assert (tmp_path / "cli.csv").read_bytes() == (tmp_path / "python.csv").read_bytes()
    assert summary.records == 4 and summary.ranks == (1,)
    pytest.importorskip("tensorboard")
    code, out, _ = _run(capsys, ["tensorboard", str(dump), "--logdir", str(tmp_path / "tb_cli"), "--module", "head"])
    summary = write_tensorboard(dump, tmp_path / "tb_python", modules=["head"])
    assert code == 0 and out.startswith(f"tensorboard: {summary}".replace("tb_python", "tb_cli"))
    # head's records of 2 ranks x 2 steps, each min, max, mean, std, nan and inf (no norm in these records)
    assert summary.records == 4 and str(summary).endswith("; 24 scalars")


@pytest.mark.parametrize("command, python, argv", [
    ("tensorboard", {"modules": ["re:("]}, ["--module", "re:("]),
    ("tensorboard", {"modules": [""]}, ["--module", ""]),
])
def test_one_check_for_both_its_error_in_the_callers_words(tmp_path, capsys, command, python, argv):
    """The options are checked before any dump is read (none exists here), in Python and on the command line."""
    function, _ = FUNCTIONS[command]
    with pytest.raises(ValueError) as caught:
        function(tmp_path / "nowhere", tmp_path / "out", **python)
    code, _, err = _run(capsys, [command, str(tmp_path / "nowhere"), "--logdir", str(tmp_path / "out"), *argv])
    assert code == 2 and err == [f"probes {command}: error: {caught.value}"]


@pytest.mark.parametrize("max_abs", [-1.0, 0.0, float("inf"), float("nan")])
def test_show_checks_max_abs_as_the_sentinel_does(tmp_path, capsys, max_abs):
    with pytest.raises(OptionError) as caught:
        ShowOptions(dump=str(tmp_path), max_abs=max_abs)
    assert str(caught.value) == f"max_abs must be a finite number > 0 (e.g. 65504.0, float16's largest value), " \
                                f"got {max_abs!r}"
    code, _, err = _run(capsys, ["show", str(tmp_path / "nowhere"), "--max-abs", str(max_abs)])
    assert code == 2 and err == [f"probes show: error: {caught.value.spelled(COMMAND_LINE)}"]
    assert err[0].startswith("probes show: error: --max-abs must be a finite number > 0")
    from probes import AnomalySentinel

    with pytest.raises(ValueError, match=re.escape(str(caught.value))):
        AnomalySentinel(max_abs=max_abs)


def test_bad_or_missing_arguments_fail_in_python_and_on_the_command_line(dump, tmp_path, capsys):
    with pytest.raises(TypeError, match=r"^export_dump\(\) missing 1 required keyword-only argument: 'format'$"):
        export_dump(dump, tmp_path / "x.csv")
    assert _run(capsys, ["export", str(dump), "--output", str(tmp_path / "x.csv")])[2] == [
        "probes export: error: the following arguments are required: --format (see probes export --help)"]
    with pytest.raises(ValueError, match=r"unknown export format 'parquet'; choose from jsonl, csv, ort"):
        export_dump(dump, tmp_path / "x", format="parquet")
    code, _, err = _run(capsys, ["export", str(dump), "--format", "parquet", "--output", str(tmp_path / "x")])
    assert code == 2 and len(err) == 1 and "invalid choice: 'parquet'" in err[0]
    for call, name in ((lambda: export_dump(dump, tmp_path / "x", format="csv", overwrit=True), "export_dump"),
                       (lambda: write_tensorboard(dump, tmp_path / "tb", module=["a"]), "write_tensorboard"),
                       (lambda: LiveTensorBoard(tmp_path / "tb", phase=["grad"]), "LiveTensorBoard")):
        with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument '\w+'; did you mean "):
            call()
    assert not (tmp_path / "x").exists() and not (tmp_path / "tb").exists()
    with pytest.raises(ValueError, match="unknown phase forwards; choose from"):
        write_tensorboard(dump, tmp_path / "tb", phases=["forwards"])
    with pytest.raises(ValueError, match=r"statistics is empty"):
        LiveTensorBoard(tmp_path / "tb", statistics=())
    assert _run(capsys, ["tensorboard"])[2] == [
        "probes tensorboard: error: the following arguments are required: DUMP, --logdir (see probes tensorboard "
        "--help)"]


def _table(page: str) -> dict[str, tuple[str, str]]:
    """The keyword | flag | default table of a docs page: {keyword: (flag, default's first word or value)}."""
    text = (ROOT / "docs" / page).read_text()
    table = re.search(r"\| keyword \| flag \| default \|\n\| --- .*?\n((?:\|.*\n)+)", text)[1]
    found = {}
    for line in table.strip().splitlines():
        keyword, flag, default = (cell.strip() for cell in line.strip().strip("|").split("|"))
        found[keyword.strip("`")] = (flag.strip("`"), re.match(r"`([^`]*)`|required", default)[1] or "required")
    return found


@pytest.mark.parametrize("page, cls", [("export.md", ExportOptions), ("tensorboard.md", TensorBoardOptions)])
def test_the_documented_options_are_the_declared_ones(page, cls):
    documented = _table(page)
    options = {f.name: (f, how) for f, how in declared(cls) if f.name != "dump"}  # the dump: every command's DUMP
    assert set(documented) == set(options)
    for name, (f, how) in options.items():
        flag, default = documented[name]
        assert flag == spelling(cls, name, COMMAND_LINE) if how.command_line else flag.startswith("("), name
        assert default == ("required" if f.default is dataclasses.MISSING else repr(f.default)), name


def test_the_flags_docs_cli_md_names_are_the_commands_own():
    text = (ROOT / "docs" / "cli.md").read_text()
    for command, (parser, _) in COMMANDS.items():
        rows = re.findall(rf"^\| `probes {command} (.*?)` \|", text, re.M)
        named = {flag for row in rows for flag in re.findall(r"--[a-z-]+", row)}
        flags = {flag for action in parser()._actions for flag in action.option_strings}
        assert rows and named and named <= flags, command
