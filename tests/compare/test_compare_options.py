"""compare's options, declared once (``CompareConfig``, ``CompareOptions``): ``compare_dumps``' keywords, ``probes
compare``'s flags and their help are the same list, read the same way, and fail the same way."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from probes.cli import main
from probes.cli.compare import CompareCommand, parser
from probes.compare import compare_dumps
from probes.compare.options import CompareConfig
from probes.compare.engine import CompareOptions
from probes.utils.flags import COMMAND_LINE, OptionError, declared, given, spelling

PYTHON_ONLY = {"progress"}  # the command always shows progress
REPORT_FLAGS = {"json", "html", "top"}  # where the command writes the report; compare_dumps returns it


def test_every_option_is_a_keyword_and_a_flag_with_its_help():
    init = [f.name for f in dataclasses.fields(CompareOptions) if f.init]
    config = [f.name for f in dataclasses.fields(CompareConfig) if f.init]
    assert set(config) < set(init) and all(f.name in {g.name for g, _ in declared(CompareOptions)}
                                           for f in dataclasses.fields(CompareOptions) if f.init)
    signature = inspect.signature(compare_dumps).parameters
    assert list(signature) == ["base", "other", *config, *(name for name in init[len(config):]
                                                            if name not in ("base", "other"))]
    for f in dataclasses.fields(CompareOptions):
        if f.init and f.name not in ("base", "other"):
            assert signature[f.name].default == f.default and signature[f.name].kind is inspect.Parameter.KEYWORD_ONLY
            assert f"``{f.name}=" in compare_dumps.__doc__, f.name
    actions = {action.dest: action for action in parser()._actions if action.dest != "help"}
    assert set(actions) == set(init) - PYTHON_ONLY | REPORT_FLAGS
    # The flags the command always had, each still there.
    flags = {flag for action in actions.values() for flag in action.option_strings}
    assert flags == {"--rtol", "--atol", "--noise", "--noise-factor", "--step", "--name", "--map", "--fuzzy", "--json",
                     "--html", "--top", "--window", "--jobs", "--skip-damaged", "--exact", "--ranks", "--phase",
                     "--strict-zero-grads", "--strict-drift"}


def test_the_command_line_and_python_read_the_same_options(tmp_path):
    argv = ["base", "other", "--rtol", "0", "--atol", "1e-5", "--noise", "n1", "n2", "--noise", "n3", "--noise-factor",
            "3", "--step", "1-2", "--step", "5", "--name", "a*", "--name", "re:b.*", "--map", "m.yaml", "--fuzzy",
            "--window", "1_000", "--jobs", "2", "--skip-damaged", "--exact", "--phase", "grad", "--phase", "param",
            "--strict-zero-grads", "--strict-drift"]
    command = CompareCommand(**given(CompareCommand, parser().parse_args(argv)))
    in_python = CompareOptions(base="base", other="other", rtol=0.0, atol=1e-5, noise=["n1", "n2", "n3"],
                               noise_factor=3, steps=[1, 2, 5],
                               names=["a*", "re:b.*"], name_map=Path("m.yaml"), fuzzy=True,
                               window=1000, jobs=2, skip_damaged=True, exact=True, phases=["grad", "param"],
                               strict_zero_grads=True, strict_drift=True)
    assert {f.name: getattr(command, f.name) for f in dataclasses.fields(CompareOptions) if f.init} == \
        {f.name: getattr(in_python, f.name) for f in dataclasses.fields(CompareOptions) if f.init}
    assert in_python.steps == frozenset({1, 2, 5}) and in_python.noise == ("n1", "n2", "n3")
    assert in_python.config() == CompareConfig(**in_python.fields())
    default = CompareCommand(**given(CompareCommand, parser().parse_args(["base", "other"])))
    assert default.config() == CompareConfig() and default.window == CompareOptions(base="b", other="o").window
    assert default.jobs >= 1 and CompareOptions(base="b", other="o").jobs == 1  # the command: every core


@pytest.mark.parametrize("python, argv, said, flagged", [
    ({"other": "o", "rtol": -1.0}, ["o", "--rtol", "-1"], "rtol must be a finite number >= 0, got -1.0",
     "--rtol must be a finite number >= 0, got -1.0"),
    ({"ranks": True, "fuzzy": True}, ["--ranks", "--fuzzy"],
     "ranks=True compares the ranks of one dump: noise, name_map and fuzzy=True do not apply",
     "--ranks compares the ranks of one dump: --noise, --map and --fuzzy do not apply"),
    ({"other": "o", "ranks": True}, ["o", "--ranks"], "ranks=True compares the ranks of one dump: give base only",
     "--ranks compares the ranks of one dump: give BASE only"),
    ({}, [], "give the dump other to compare with base, or ranks=True",
     "give the dump OTHER to compare with BASE, or --ranks"),
])
def test_one_check_for_both_its_error_in_the_callers_words(tmp_path, capsys, python, argv, said, flagged):
    """The checks run before any dump is read (none exists here), in Python and on the command line alike."""
    with pytest.raises(OptionError) as caught:
        compare_dumps(tmp_path / "nowhere", **python)
    assert str(caught.value).startswith(said)
    assert main(["compare", str(tmp_path / "nowhere"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"probes compare: error: {flagged}"), err


def test_an_unknown_keyword_is_a_type_error_naming_the_close_one(tmp_path):
    with pytest.raises(TypeError, match=r"compare_dumps\(\) got an unexpected keyword argument 'rtl'; did you mean "
                                        r"'rtol'\?"):
        compare_dumps(tmp_path, tmp_path, rtl=1e-3)
    with pytest.raises(ValueError, match="jobs must be a positive int, got 0"):
        compare_dumps(tmp_path, tmp_path, jobs=0)


def test_the_documented_options_are_the_declared_ones():
    text = (Path(__file__).resolve().parents[2] / "docs" / "compare.md").read_text()
    table = re.search(r"\| keyword \| flag \| default \|\n\| --- .*?\n((?:\|.*\n)+)", text)[1]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.strip().splitlines()]
    documented = {keyword.strip("`"): (flag.strip("`"), default.split()[0].strip("`"))
                  for keyword, flag, default in rows}
    expected = {f.name: (spelling(CompareOptions, f.name, COMMAND_LINE) if how.command_line else "(always on)",
                         repr(f.default)) for f, how in declared(CompareOptions) if not how.positional}
    assert documented == expected


def test_assert_parity_takes_compare_dumps_options_and_passes_them_on(tmp_path):
    from probes.testing import assert_parity

    parity = inspect.signature(assert_parity).parameters
    compare = inspect.signature(compare_dumps).parameters
    assert [name for name in parity if name not in ("base_dir", "other_dir", "html")] == \
        [name for name in compare if name not in ("base", "other")]
    with pytest.raises(TypeError, match="rtoll"):
        assert_parity(tmp_path, tmp_path, rtoll=1e-3)
    with pytest.raises(ValueError, match="rtol"):
        assert_parity(tmp_path, tmp_path, rtol=-1.0)
