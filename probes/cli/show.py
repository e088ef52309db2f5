"""``probes show DUMP``: a dump's records as a table, each step's global gradient norm, and the first non-finite
value across ranks.

    probes show run --step 3 --rank 0
    probes show run --anomalies --max-abs 65504     # only the records holding nan/inf (or |x| > 65504)

Its options are declared once, with their help and checks: ``ShowOptions`` (``probes.utils.flags``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Sequence

from ..dump import first_anomaly
from ..dump.anomaly import max_abs_problem, record_anomaly
from ..dump.reader import DumpArgument
from ..dump.statistics import global_grad_norms
from ..dump.table import format_records
from ..utils.flags import add_flags, given, option, settle
from .common import (EXIT_OK, CommandError, command_parser, damaged_note, open_dump, run_command,
                     trainer_steps_or_note)

EXAMPLES = [
    "probes show run                      # every record of every finished step",
    "probes show run --step 3 --rank 1    # one step of one rank",
    "probes show run/rank_0/step_000003.jsonl",
    "probes show run --anomalies          # only records with nan/inf, and where the first one was",
]


@dataclass(frozen=True, kw_only=True)
class ShowOptions(DumpArgument):
    """``probes show``'s arguments: the flags, their help and their checks."""

    step: int | None = option(None, help="only this step")
    rank: int | None = option(None, help="only this rank")
    include_partial: bool = option(False, help="also show the complete records of unfinished steps")
    skip_damaged: bool = option(False, help=(
        "show the steps that can be read; damaged step files are listed in a note (default: a damaged step file "
        "the selection needs is an error)"))
    anomalies: bool = option(False, help="only the records holding nan or inf (or values beyond {max_abs})")
    max_abs: float | None = option(None, metavar="X", check=max_abs_problem, help=(
        "a finite |value| above X counts as an anomaly too (e.g. 65504, float16's largest)"))

    def __post_init__(self) -> None:
        settle(self)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("show", "Print the statistics records of a probes dump as a table.", examples=EXAMPLES)
    add_flags(parser, ShowOptions)
    return parser


def show(argv: Sequence[str] | None = None) -> int:
    """``probes show``: exit 0 when something was shown, 2 for bad input (see ``probes.cli.common``)."""
    return run_command("show", parser(), argv, _show)


def _show(namespace: argparse.Namespace) -> int:
    args = ShowOptions(**given(ShowOptions, namespace))  # bad options: one line naming the flags
    reader = open_dump(args.dump, include_partial=args.include_partial)
    steps = reader.steps()

    def wanted(rank: int | None, step: int) -> bool:
        return (args.rank is None or rank == args.rank) and (args.step is None or step == args.step)

    # Only the files the selection needs are read: a damaged step elsewhere does not stop this one.
    files = [f for f in reader.step_files(include_partial=args.include_partial)
             if wanted(args.rank if f.rank is None else f.rank, f.step)]  # a lone file's records say their rank
    records = reader.records(include_partial=args.include_partial, files=files, skip_damaged=args.skip_damaged)
    if reader.damaged:
        print(f"probes show: note: {damaged_note(reader.damaged)}", file=sys.stderr)

    if not args.include_partial:
        for rank, by_state in steps.items():
            for step in by_state["unfinished"]:
                if wanted(rank, step):
                    print(f"probes show: rank {rank} step {step} is unfinished (still being written, or a crash); "
                          "--include-partial shows its complete records", file=sys.stderr)
    selected = [record for record in records if wanted(record["rank"], record["step"])]
    if not selected:
        available = {rank: by_state["finished"] for rank, by_state in steps.items()}
        raise CommandError(f"no records match --step/--rank; finished steps by rank: {available}")
    first = first_anomaly(selected, max_abs=args.max_abs)
    if args.anomalies:
        selected = [record for record in selected if record_anomaly(record, max_abs=args.max_abs) is not None]
        if not selected:
            print("no anomalies: every value is finite" + (f" and |x| <= {args.max_abs:g}" if args.max_abs else ""))
            return EXIT_OK
    print(format_records(selected, trainer_steps_or_note(args.dump, "show")))
    if not args.anomalies:
        for line in _grad_norm_lines(selected):
            print(line)
    if first is not None:
        print(f"first non-finite value: {first}" if first.nan or first.inf else f"first anomaly: {first}")
    return EXIT_OK



def _grad_norm_lines(records: Sequence) -> list[str]:
    """Each step's global gradient norm (``global_grad_norms``: its grad records' norms), one line per rank and step."""
    norms = global_grad_norms(records)
    with_rank = len({rank for rank, _ in norms}) > 1
    return [f"global grad norm{f' rank {rank}' if with_rank else ''} step {step}: {norm:.6g}"
            for (rank, step), norm in sorted(norms.items(), key=lambda item: (item[0][1], item[0][0]))]
