"""What every subcommand shares: its parser, one-line errors with exit code 2, opening a dump.

    parser = command_parser("show", "Print a dump as a table.", examples=["probes show run --step 3"])
    return run_command("show", parser, argv, body)      # body(args) -> exit code; CommandError -> 2

Exit codes (the same for every subcommand): 0 success (compare: the runs agree), 1 a negative answer
(compare: the runs differ; merge: the output exists), 2 bad input: a bad option, a path that is not a
dump, an empty dump, a dump still being written, two dumps with no common records, a bad ``--map``
file. Errors are one line on stderr, ``probes <command>: error: <what is wrong>; <what to do>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

from ..dump import DumpFormatError, DumpReader
from ..dump.reader import StepFile
from ..dump.trainer_steps import TrainerStep, read_trainer_steps
from ..utils.flags import COMMAND_LINE, OptionError

EXIT_OK, EXIT_NEGATIVE, EXIT_BAD_INPUT = 0, 1, 2
PROG = "probes"  # also ``python -m probes``


class CommandError(Exception):
    """Bad input to a command: its message is the one line the user sees (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the usage block, then the error)."""

    def error(self, message: str) -> NoReturn:
        raise CommandError(f"{message} (see {self.prog} --help)")


def command_parser(name: str, description: str, *, examples: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of ``probes <name>``; ``--help`` ends with the examples and the exit codes."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples) + (
        "\n\nexit codes: 0 success, 1 a negative answer (compare: the runs differ), 2 bad input "
        "(one line on stderr)")
    return _Parser(prog=f"{PROG} {name}", description=description, epilog=epilog,
                   formatter_class=argparse.RawDescriptionHelpFormatter)


def run_command(name: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                body: Callable[[argparse.Namespace], int]) -> int:
    """Parses ``argv`` and runs ``body``; bad input of any kind is one line on stderr and exit code 2."""
    try:
        args = parser.parse_args(argv)
        return body(args)
    except SystemExit as exit_:  # --help (0); argparse's own exits
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG} {name}: interrupted", file=sys.stderr)
        return 130
    except CommandError as error:
        return fail(name, str(error))
    except OptionError as error:  # bad options, named as flags
        return fail(name, error.spelled(COMMAND_LINE))
    except FileNotFoundError as error:
        return fail(name, f"{error.filename or error}: no such file or directory")
    except (OSError, ValueError) as error:  # DumpFormatError is a ValueError naming file and line
        return fail(name, str(error))


def fail(name: str | None, message: str) -> int:
    """Prints the one-line error of ``probes <name>`` (or of ``probes``) and returns exit code 2."""
    line = " ".join(message.split())  # one line, whatever the message held
    print(f"{PROG}{f' {name}' if name else ''}: error: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT


def damaged_note(damaged: Sequence[tuple[StepFile, DumpFormatError]]) -> str:
    """The note of ``--skip-damaged``: which steps were left out and why, in one line."""
    listed = "; ".join(str(error) for _, error in damaged)
    return f"{len(damaged)} damaged step file{'s' if len(damaged) > 1 else ''} left out (--skip-damaged): {listed}"


def open_dump(path: str | Path, *, include_partial: bool = False) -> DumpReader:
    """The dump at ``path``, or a CommandError saying why it cannot be read and what to do."""
    if not Path(path).exists():
        raise CommandError(f"{path}: no such file or directory; give a dump directory written by "
                           "StatisticsSubscriber, one of its rank_<r> directories or a step file")
    try:
        reader = DumpReader(path)
    except DumpFormatError as error:
        raise CommandError(f"{error}; give a dump directory written by StatisticsSubscriber, one of its "
                           "rank_<r> directories or a step file") from None
    steps = reader.steps()
    finished = sum(len(by_state["finished"]) for by_state in steps.values())
    unfinished = sum(len(by_state["unfinished"]) for by_state in steps.values())
    if finished + unfinished == 0:
        raise CommandError(f"{path} is an empty dump (no step files): the run has not finished a step yet, or "
                           "its subscriber recorded nothing (check start_step/end_step and that the model ran)")
    if finished == 0 and not include_partial:
        raise CommandError(f"{path} has only unfinished steps ({unfinished}): it is still being written, or the "
                           "run crashed; wait for a step to finish, or read what is there with --include-partial")
    return reader


def trainer_steps_or_note(path: str | Path, command: str, run: str = "") -> dict[int, dict[int, TrainerStep]]:
    """``read_trainer_steps(path)``; a damaged map is a note on stderr and {} (reports go on without it)."""
    try:
        return read_trainer_steps(path)
    except (DumpFormatError, OSError) as error:
        print(f"probes {command}: note: the {run}trainer step map is not readable, shown without it ({error})",
              file=sys.stderr)
        return {}
