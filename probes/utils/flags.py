"""Options declared once, as the fields of a keyword-only dataclass: a Python function's keywords, a command's
flags, their help and their checks all come from the field.

    @dataclass(frozen=True, kw_only=True)
    class Options:
        path: str = option(positional=True, metavar="PATH", help="the input")   # positional in both
        output: Path = option(positional=True, flag="--output", help="...")   # positional in Python, a flag here
        rtol: float | None = option(None, help="relative tolerance", check=lambda v: ...)
        names: tuple[str, ...] = option((), flag="--name", many="append", metavar="GLOB", convert=tuple, help="...")
        def __post_init__(self) -> None: settle(self)      # converted, then checked

    add_flags(parser, Options)                            # --rtol, --name (repeatable), their help
    Options(**given(Options, parser.parse_args(argv)))    # the flags used; the others keep the field's default
    check_keywords(Options, keywords, "compare_dumps")    # TypeError for an unknown keyword (with a suggestion)
                                                          # or a missing required one, as Python's own

A message that names options names them as the reader wrote them: ``OptionError(Options, lambda say: ...)``
says ``rtol`` (``ranks=True`` for a switch) in Python and ``--rtol`` on the command line
(``error.spelled(COMMAND_LINE)``); help texts write ``{rtol}`` for the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from .checks import int_problem

PYTHON, COMMAND_LINE = "python", "command line"
_KEY = "probes.option"
_PARSERS: dict[str, Callable[[str], Any]] = {"float": float, "int": int, "str": str, "Path": Path}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """How one field is given: as a flag (or a positional argument), its help, its conversion and check."""

    help: str  # may name other options as {field}: spelled for the reader
    flag: str | None = None  # None: --the-field-name
    positional: bool = False  # a positional parameter in Python; on the command line a positional argument (its
    #                           metavar names it), or the flag ``flag`` where one is given (``--output``)
    command_line: bool = True  # False: a Python keyword only
    metavar: str | None = None
    choices: Sequence[Any] | None = None
    parse: Callable[[str], Any] | None = None  # a flag's text as a value (default: the field's type: int, float...)
    many: Literal["append", "extend"] | None = None  # repeatable; "extend": each use adds every value it parses to
    nargs: str | None = None  # e.g. "+": one use takes several values
    command_line_default: Any = None  # where the command's default differs from the function's
    convert: Callable[[Any], Any] | None = None  # a given value (not None) as the field holds it
    check: Callable[[Any], str | None] | None = None  # the value's problem ("must be ..., got x"), None when fine


def option(default: Any = dataclasses.MISSING, *, help: str, **how: Any) -> Any:
    """A dataclass field declared as an option (see ``Option`` for ``how``); no default: a required one."""
    return dataclasses.field(default=default, metadata={_KEY: Option(help=help, **how)})


def declared(cls: type, view: str = PYTHON) -> list[tuple[dataclasses.Field, Option]]:
    """The option fields of ``cls`` in declaration order; ``COMMAND_LINE``: only those the command line has."""
    found = [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]
    return [(f, how) for f, how in found if view == PYTHON or how.command_line]


def _positional_argument(how: Option) -> bool:
    """Whether the option is a positional argument of the command (not a flag)."""
    return how.positional and how.flag is None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING


def _is_switch(f: dataclasses.Field) -> bool:
    return f.type in (bool, "bool")


def flag_of(f: dataclasses.Field, how: Option) -> str:
    return how.flag or "--" + f.name.replace("_", "-")


def spelling(cls: type, name: str, view: str) -> str:
    """How ``view`` names the option ``name``: ``rtol``/``ranks=True`` in Python, ``--rtol``/``BASE`` on the
    command line."""
    f, how = next((f, how) for f, how in declared(cls) if f.name == name)
    if view == COMMAND_LINE:
        return (how.metavar or f.name.upper()) if _positional_argument(how) else flag_of(f, how)
    return f"{name}=True" if _is_switch(f) else name


def help_of(cls: type, how: Option, view: str) -> str:
    """An option's help text, naming other options as ``view`` does."""
    return how.help.format(**{f.name: spelling(cls, f.name, view) for f, _ in declared(cls)})


class OptionError(ValueError):
    """Bad options; its message names them as the caller wrote them (Python keywords unless spelled otherwise).

    ``text(say)`` writes the message; ``say("rtol")`` is the option's name in the caller's words.
    """

    def __init__(self, cls: type, text: Callable[[Callable[[str], str]], str]) -> None:
        self.cls, self.text = cls, text
        super().__init__(self.spelled(PYTHON))

    def spelled(self, view: str) -> str:
        return self.text(lambda name: spelling(self.cls, name, view))

    def __reduce__(self) -> tuple[Any, ...]:  # from a worker process: the message, as a plain ValueError
        return ValueError, (str(self),)


def settle(options: Any) -> None:
    """For ``__post_init__`` of a frozen dataclass: each given option converted (``convert``), then checked
    (``check``); the first problem is an OptionError naming the option."""
    for f, how in declared(type(options)):
        value = getattr(options, f.name)
        if how.convert is not None and value is not None:
            value = how.convert(value)
            object.__setattr__(options, f.name, value)
        problem = how.check(value) if how.check is not None else None
        if problem:
            raise OptionError(type(options), lambda say, name=f.name, problem=problem: f"{say(name)} {problem}")


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """The command-line arguments of ``cls``'s options, with their help; a flag not used is None (``given``), a
    field without a default a required flag (unless a positional argument)."""
    for f, how in declared(cls, COMMAND_LINE):
        text = help_of(cls, how, COMMAND_LINE).replace("%", "%%")
        if _positional_argument(how):
            parser.add_argument(f.name, metavar=how.metavar, help=text,
                                **({} if _required(f) else {"nargs": "?"}))
        elif _is_switch(f):
            parser.add_argument(flag_of(f, how), dest=f.name, action="store_true", help=text)
        else:
            parser.add_argument(flag_of(f, how), dest=f.name, type=how.parse or _parser_of(f),
                                default=how.command_line_default,
                                action=how.many or "store", nargs=how.nargs, choices=how.choices,
                                metavar=how.metavar, required=_required(f), help=text)


def _parser_of(f: dataclasses.Field) -> Callable[[str], Any]:
    named = str(f.type).replace(" | None", "").strip()
    if named.startswith("tuple[") and named.endswith(", ...]"):  # a repeatable option: its items' type
        named = named[len("tuple["):-len(", ...]")]
    if named not in _PARSERS:
        raise TypeError(f"option {f.name}: no parse for the type {f.type!r}; give parse= in its option()")
    return _PARSERS[named]


def given(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """The options of ``cls`` the command line gave (flags not used keep the field's default)."""
    found = {f.name: getattr(namespace, f.name, None) for f, _ in declared(cls, COMMAND_LINE)}
    return {name: value for name, value in found.items() if value is not None and value is not False}


def keywords(cls: type) -> list[str]:
    """The keyword options of ``cls`` (its positional ones are a function's positional parameters)."""
    return [f.name for f, how in declared(cls) if not how.positional]


def keyword_values(options: Any, cls: type | None = None) -> dict[str, Any]:
    """The keyword options (of ``cls``, default: its own class) ``options`` holds, to pass on as keywords."""
    return {name: getattr(options, name) for name in keywords(cls or type(options))}


def check_keywords(cls: type, options: Mapping[str, Any], caller: str) -> None:
    """A TypeError, as Python's own, for a keyword ``cls`` lacks (with the close name and the known ones) or a
    required one (no default) not given."""
    known = keywords(cls)
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; {hint}"
                            f"the keywords are {', '.join(known)}")
    missing = [repr(f.name) for f, how in declared(cls)
               if not how.positional and _required(f) and f.name not in options]
    if missing:
        n = len(missing)
        listed = missing[0] if n == 1 else f"{', '.join(missing[:-1])}{',' * (n > 2)} and {missing[-1]}"
        raise TypeError(f"{caller}() missing {n} required keyword-only argument{'s' * (n > 1)}: {listed}")


def takes_options(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """For a function ``f(positional..., **options)``: its signature (``help()``, ``inspect``) shows ``cls``'s
    keywords with their defaults, and its docstring ends with each one's help."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(function)
        parameters = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        options = [(f, how) for f, how in declared(cls) if not how.positional]
        parameters += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                         default=inspect.Parameter.empty if _required(f) else f.default)
                       for f, _ in options]
        function.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        lines = [textwrap.fill(f"{f'``{f.name}`` (required)' if _required(f) else f'``{f.name}={f.default!r}``'}: "
                               f"{help_of(cls, how, PYTHON)}", 116, initial_indent="    ", subsequent_indent="        ")
                 for f, how in options]
        heading = f"\n\n    Keywords ({cls.__name__}):\n\n"
        function.__doc__ = (function.__doc__ or "").rstrip() + heading + "\n".join(lines)
        return function

    return decorate


def positive_int(text: str) -> int:
    """A flag's whole number of at least 1 (``100_000`` too); argparse's one-line error otherwise."""
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def positive(value: Any) -> str | None:
    """``check`` of an option that is an int of at least 1."""
    return int_problem(value, minimum=1)


def positive_or_none(value: Any) -> str | None:
    """``check`` of an option that is None or an int of at least 1."""
    return None if value is None else int_problem(value, minimum=1)
