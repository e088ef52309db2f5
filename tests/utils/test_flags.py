"""Options declared once (``probes.utils.flags``): one dataclass field gives the keyword, the flag, the help
and the check, and the errors name the option as the reader wrote it."""

from __future__ import annotations

import argparse
import inspect
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from probes.utils.flags import (COMMAND_LINE, PYTHON, OptionError, add_flags, check_keywords, given, keywords, option,
                                positive_int, settle, spelling, takes_options, positive)


def _at_most_ten(value):
    return None if value <= 10 else f"must be at most 10, got {value!r}"


@dataclass(frozen=True, kw_only=True)
class Example:
    path: str = option(positional=True, metavar="PATH", help="the input")
    scale: float = option(1.5, check=_at_most_ten, help="a factor (default 1.5; with {loud} it doubles)")
    names: tuple[str, ...] = option((), flag="--name", many="append", metavar="GLOB", convert=tuple,
                                    help="a name (repeatable)")
    steps: frozenset[int] | None = option(None, flag="--step", many="extend", parse=lambda text: {int(text)},
                                          convert=frozenset, help="a step (repeatable)")
    count: int = option(1, parse=positive_int, check=positive, command_line_default=4, help="how many")
    loud: bool = option(False, convert=bool, help="louder than {path}")
    stream: object = option(None, command_line=False, help="Python only")

    def __post_init__(self) -> None:
        settle(self)
        if self.loud and self.steps is not None:
            raise OptionError(Example, lambda say: f"{say('loud')} takes no {say('steps')}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="example")
    add_flags(parser, Example)
    return parser


def test_one_field_is_a_flag_and_a_keyword_with_its_default() -> None:
    parsed = Example(**given(Example, _parser().parse_args(["in", "--scale", "2", "--name", "a", "--name", "b",
                                                            "--step", "3", "--step", "1"])))
    assert parsed == Example(path="in", scale=2.0, names=["a", "b"], steps=[3, 1], count=4)
    assert parsed.names == ("a", "b") and parsed.steps == frozenset({1, 3})  # converted: lists given in Python too
    plain = Example(**given(Example, _parser().parse_args(["in"])))
    assert plain == Example(path="in", count=4)  # the command's own default; every other flag keeps the field's
    assert Example(path="in").count == 1 and plain.scale == 1.5 and plain.names == () and plain.steps is None
    actions = {action.dest: action for action in _parser()._actions}
    assert set(actions) == {"help", "path", "scale", "names", "steps", "count", "loud"}  # stream: Python only
    assert actions["scale"].help == "a factor (default 1.5; with --loud it doubles)"
    assert actions["loud"].help == "louder than PATH" and actions["names"].option_strings == ["--name"]
    assert keywords(Example) == ["scale", "names", "steps", "count", "loud", "stream"]


def test_errors_name_the_option_as_the_caller_wrote_it() -> None:
    with pytest.raises(OptionError) as caught:
        Example(path="in", scale=11.0)
    assert str(caught.value) == "scale must be at most 10, got 11.0"
    assert caught.value.spelled(COMMAND_LINE) == "--scale must be at most 10, got 11.0"
    with pytest.raises(OptionError) as caught:
        Example(path="in", loud=True, steps=[1])
    assert str(caught.value) == caught.value.spelled(PYTHON) == "loud=True takes no steps"
    assert caught.value.spelled(COMMAND_LINE) == "--loud takes no --step"
    again = pickle.loads(pickle.dumps(caught.value))  # from a worker process: the message survives
    assert isinstance(again, ValueError) and str(again) == "loud=True takes no steps"
    with pytest.raises(ValueError, match=r"count must be a positive int, got 0"):
        Example(path="in", count=0)
    with pytest.raises(TypeError, match=r"f\(\) got an unexpected keyword argument 'scal'; did you mean 'scale'\?"):
        check_keywords(Example, {"scale": 1.0, "scal": 2.0}, "f")
    check_keywords(Example, {"scale": 1.0, "stream": None}, "f")
    with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number of at least 1, got '0'"):
        positive_int("0")
    assert positive_int("100_000") == 100_000


def test_a_function_taking_the_options_shows_them() -> None:
    @takes_options(Example)
    def run(path: str, **options: object) -> Example:
        """Runs."""
        check_keywords(Example, options, "run")
        return Example(path=path, **options)

    parameters = inspect.signature(run).parameters
    assert list(parameters) == ["path", *keywords(Example)]
    assert parameters["scale"].default == 1.5 and parameters["scale"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "``scale=1.5``: a factor (default 1.5; with loud=True it doubles)" in run.__doc__
    assert run("in", scale=2.0).scale == 2.0


@dataclass(frozen=True, kw_only=True)
class Copy:
    source: str = option(positional=True, metavar="SOURCE", help="what to copy")
    target: Path = option(positional=True, flag="--target", parse=Path, convert=Path, help="where {source} goes")
    mode: str = option(choices=("fast", "safe"), help="how (no default: required)")
    level: int = option(1, help="how hard")

    def __post_init__(self) -> None:
        settle(self)


def test_a_positional_parameter_may_be_a_flag_of_the_command() -> None:
    parser = argparse.ArgumentParser(prog="copy")
    add_flags(parser, Copy)
    actions = {action.dest: action for action in parser._actions if action.dest != "help"}
    assert actions["source"].option_strings == [] and actions["target"].option_strings == ["--target"]
    assert actions["target"].required and actions["mode"].required and not actions["level"].required
    assert actions["target"].help == "where SOURCE goes" and spelling(Copy, "target", COMMAND_LINE) == "--target"
    parsed = Copy(**given(Copy, parser.parse_args(["a", "--target", "b", "--mode", "safe"])))
    assert parsed == Copy(source="a", target="b", mode="safe") and parsed.target == Path("b")
    assert keywords(Copy) == ["mode", "level"]

    @takes_options(Copy)
    def copy(source: str, target: str | Path, **options: object) -> Copy:
        """Copies."""
        check_keywords(Copy, options, "copy")
        return Copy(source=source, target=target, **options)

    parameters = inspect.signature(copy).parameters
    assert list(parameters) == ["source", "target", "mode", "level"]
    assert parameters["mode"].default is inspect.Parameter.empty and parameters["mode"].kind is parameters["level"].kind
    assert "``mode`` (required): how" in copy.__doc__ and "``level=1``: how hard" in copy.__doc__
    assert copy("a", "b", mode="fast") == Copy(source="a", target=Path("b"), mode="fast")


@dataclass(frozen=True, kw_only=True)
class Three:
    a: int = option(help="a")
    b: int = option(help="b")
    c: int = option(help="c")
    d: int = option(0, help="d")


def _reference(*, a: int, b: int, c: int, d: int = 0) -> None:
    """Python's own keyword-only parameters, whose errors check_keywords repeats."""


@pytest.mark.parametrize("options", [{}, {"a": 1}, {"a": 1, "b": 2}, {"a": 1, "d": 2}])
def test_a_missing_required_keyword_is_pythons_own_type_error(options) -> None:
    with pytest.raises(TypeError) as python:
        _reference(**options)
    with pytest.raises(TypeError) as ours:
        check_keywords(Three, options, "_reference")
    assert str(ours.value) == str(python.value)
