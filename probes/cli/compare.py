"""``probes compare BASE OTHER``: the first divergence between two runs (terminal, JSON, HTML).

    probes compare eager_out ort_out --html report.html        # exit 0 agree, 1 diverged, 2 bad input
    probes compare run rerun --exact                           # bit-identical or not (records of hash=True)
    probes compare ddp_out --ranks --exact                     # every rank against rank 0 (grad, param, optim)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..compare import Report, compare_dumps, format_report, write_html
from ..compare.engine import CompareOptions
from ..dump.trainer_steps import TrainerStep
from ..utils.flags import add_flags, given, keyword_values, option
from .common import (EXIT_NEGATIVE, EXIT_OK, CommandError, command_parser, open_dump, run_command,
                     trainer_steps_or_note)

EXAMPLES = [
    "probes compare eager_out ort_out",
    "probes compare eager_out ort_out --rtol 1e-3 --atol 1e-5 --json r.json --html r.html",
    "probes compare eager_out ort_out --noise noise_1 noise_2   # tolerance at least the noise floor of calibration runs",
    "probes compare eager_out ort_out --step 3-5 --name 'blocks.1.*'",
    "probes compare eager_out refactored_out --map names.yaml   # names.yaml: {'\\.ffn\\.': '.mlp.'}",
    "probes compare eager_out refactored_out --fuzzy            # pair renamed modules by class, shape, order",
    "probes compare big_a big_b --window 100000 --jobs 8         # bounded memory, eight processes",
    "probes compare run rerun --exact                          # bit-identical? (recorded with hash=True)",
    "probes compare ddp_out --ranks --exact                    # each rank against rank 0: grad, param, optim",
    "probes compare ddp_out --ranks --phase backward           # other phases instead",
]


@dataclass(frozen=True, kw_only=True)
class CompareCommand(CompareOptions):
    """``probes compare``'s arguments: every option of ``compare_dumps``, and where the report goes."""

    json: Path | None = option(None, metavar="OUT", help="write the JSON report (docs/compare.md) here")
    html: Path | None = option(None, metavar="OUT", help="write the self-contained HTML report here")
    top: int = option(10, help="rows in the table of worst records (default 10)")


def parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "compare", "Compare two statistics dumps record by record and report the first divergence "
                   "(and where each run saw its first non-finite value).", examples=EXAMPLES)
    add_flags(parser, CompareCommand)
    return parser


def compare(argv: Sequence[str] | None = None) -> int:
    """``probes compare``: exit 0 agree, 1 diverged (or records on one side only), 2 bad input."""
    return run_command("compare", parser(), argv, _compare)


def _compare(args: argparse.Namespace) -> int:
    command = CompareCommand(**given(CompareCommand, args))  # bad options: one line naming the flags
    for path in (command.base, command.other, *(command.noise or ())):
        if path is not None:
            open_dump(path)  # a path that is not a dump, empty, or still being written: one clear line
    options = keyword_values(command, CompareOptions)
    report = compare_dumps(command.base, command.other, **{**options, "progress": True})
    _check_common_records(report, command)
    if command.ranks and not report.matched and not report.only_in_base and not report.only_in_other:
        phases = ", ".join(report.config.phases or ())
        raise CommandError(f"{command.base} has no records of the phases compared ({phases}) on its ranks; record "
                           "them (parameters=True) or choose others with --phase")
    print(format_report(report, top=command.top))
    trainer_steps = _trainer_steps_of_first_divergence(report, command)
    for run, entry in trainer_steps.items():
        print(f"first divergence in the {run} run's trainer numbering: {TrainerStep(**entry).describe()}")
    try:
        if command.json is not None:
            document = {**report.to_json(), **({"first_divergence_trainer_steps": trainer_steps} if trainer_steps else {})}
            command.json.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n", encoding="utf-8")
            print(f"JSON report: {command.json}")
        if command.html is not None:
            write_html(report, command.html)
            print(f"HTML report: {command.html}")
    except OSError as error:
        raise CommandError(f"cannot write the report: {error}") from None
    return EXIT_OK if report.agrees else EXIT_NEGATIVE


def _trainer_steps_of_first_divergence(report: Report, args: CompareCommand) -> dict[str, dict]:
    """Where a trainer callback wrote the step map: the trainer's step of the first divergence, per run."""
    first = report.first_divergence
    found: dict[str, dict] = {}
    if first is None:
        return found
    for run, path in (("base", args.base), ("other", args.other or args.base)):
        entry = trainer_steps_or_note(path, "compare", f"{run} run's ").get(first.rank, {}).get(first.step)
        if entry is not None:
            found[run] = dataclasses.asdict(entry)
    return found


def _check_common_records(report: Report, args: CompareCommand) -> None:
    """Two dumps without one record in common are not two runs of one model (or the names changed)."""
    if report.matched or not (report.only_in_base and report.only_in_other):
        return
    filters = " after --step/--name" if args.steps is not None or args.names else ""
    hint = ("check the --map patterns" if args.name_map is not None
            else "map the names that changed (--map FILE, --fuzzy)")
    example_base, example_other = report.only_in_base[0][3], report.only_in_other[0][3]
    raise CommandError(
        f"{args.base} and {args.other} have no record in common{filters} ({len(report.only_in_base)} records "
        f"only in BASE such as {example_base!r}, {len(report.only_in_other)} only in OTHER such as "
        f"{example_other!r}); compare two runs of the same model, or {hint}")
