"""``probes compare BASE OTHER``: the first divergence between two runs (terminal, JSON, HTML).

    probes compare eager_out ort_out --html report.html        # exit 0 agree, 1 diverged, 2 bad input
    probes compare run rerun --exact                           # bit-identical or not (records of hash=True)
    probes compare ddp_out --ranks --exact                     # every rank against rank 0 (grad, param, optim)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

from ..compare import Report, compare_dumps, format_report, load_name_map, write_html
from ..compare.options import DEFAULT_ATOL, DEFAULT_NOISE_FACTOR, DEFAULT_RTOL, DEFAULT_WINDOW
from ..compare.terminal import parse_steps
from ..dump.trainer_steps import TrainerStep
from ..utils.phases import PHASES
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


def parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "compare", "Compare two statistics dumps record by record and report the first divergence "
                   "(and where each run saw its first non-finite value).", examples=EXAMPLES)
    parser.add_argument("base", metavar="BASE", help="the reference dump (directory, rank_<r> directory or step file)")
    parser.add_argument("other", metavar="OTHER", nargs="?", help="the dump to check against BASE (not with --ranks)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="one fixed rule atol + rtol*|x| for every record (default: each record's per-dtype "
                             f"tolerance, docs/compare.md; with --atol alone rtol is {DEFAULT_RTOL:g})")
    parser.add_argument("--atol", type=float, default=None,
                        help=f"absolute tolerance of the fixed rule (with --rtol alone: {DEFAULT_ATOL:g})")
    parser.add_argument("--noise", action="extend", nargs="+", metavar="CALIBRATION",
                        help="calibration runs: BASE again under probes.testing.perturbed_rounding (repeatable); each "
                             "statistic's tolerance is then max(its default or fixed tolerance, k*noise), k*noise its "
                             "noise floor (docs/compare.md, Noise floor)")
    parser.add_argument("--noise-factor", type=float, default=DEFAULT_NOISE_FACTOR, metavar="K",
                        help=f"k of the noise floor (default {DEFAULT_NOISE_FACTOR:g})")
    parser.add_argument("--step", action="append", type=parse_steps, metavar="STEPS",
                        help="only these steps: N, A-B or a comma list (repeatable)")
    parser.add_argument("--name", action="append", default=[], metavar="GLOB",
                        help="only records whose name matches this glob, e.g. 'blocks.1.*' (repeatable)")
    parser.add_argument("--map", type=Path, metavar="FILE",
                        help="a YAML or JSON name map: regular expressions rewriting OTHER's names into BASE's "
                             "(docs/names.md)")
    parser.add_argument("--fuzzy", action="store_true",
                        help="pair the records still found in one run only by module class, shape and execution "
                             "order, and list the pairs with their confidence")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the JSON report (docs/compare.md) here")
    parser.add_argument("--html", type=Path, metavar="OUT", help="write the self-contained HTML report here")
    parser.add_argument("--top", type=int, default=10, help="rows in the table of worst records (default 10)")
    parser.add_argument("--window", type=_positive, default=DEFAULT_WINDOW, metavar="RECORDS",
                        help=f"records of a dump read and compared at a time, whole steps (default {DEFAULT_WINDOW:,}); "
                             "bounds the memory a comparison takes, whatever the dumps' size")
    parser.add_argument("--jobs", type=_positive, default=os.cpu_count() or 1, metavar="N",
                        help="processes comparing windows at once (default: the cores there are)")
    parser.add_argument("--skip-damaged", action="store_true",
                        help="leave damaged step files out (of both runs) and list them as a note "
                             "(default: they are an error naming every one)")
    parser.add_argument("--exact", action="store_true",
                        help="a record agrees only when bit-identical (its hash; both runs recorded with hash=True); "
                             "tolerances are not used")
    parser.add_argument("--ranks", action="store_true",
                        help="compare every rank of the one dump BASE with its rank 0 (data-parallel runs); by "
                             "default the phases that must agree across ranks: grad, param, optim")
    parser.add_argument("--phase", action="append", choices=PHASES, metavar="PHASE",
                        help=f"only records of this phase ({', '.join(PHASES)}; repeatable); with --ranks it "
                             "replaces grad, param, optim")
    parser.add_argument("--strict-zero-grads", action="store_true",
                        help="a gradient exactly zero in one run and absent in the other is a divergence "
                             "(default: a note)")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def compare(argv: Sequence[str] | None = None) -> int:
    """``probes compare``: exit 0 agree, 1 diverged (or records on one side only), 2 bad input."""
    return run_command("compare", parser(), argv, _compare)


def _compare(args: argparse.Namespace) -> int:
    if args.ranks and args.other is not None:
        raise CommandError(f"--ranks compares the ranks of one dump: give BASE only, not {args.other!r}")
    if args.ranks and (args.noise or args.map or args.fuzzy):
        raise CommandError("--ranks compares the ranks of one dump: --noise, --map and --fuzzy do not apply")
    if not args.ranks and args.other is None:
        raise CommandError("give the dump OTHER to compare with BASE, or --ranks to compare the ranks of BASE")
    for path in (args.base, args.other, *(args.noise or ())):
        if path is not None:
            open_dump(path)  # a path that is not a dump, empty, or still being written: one clear line
    name_map = load_name_map(args.map) if args.map is not None else None  # a bad map: one line, before reading
    steps = frozenset().union(*args.step) if args.step else None
    report = compare_dumps(args.base, args.other, rtol=args.rtol, atol=args.atol, noise=args.noise,
                           noise_factor=args.noise_factor, steps=steps, names=args.name, progress=True,
                           strict_zero_grads=args.strict_zero_grads, name_map=name_map, fuzzy=args.fuzzy,
                           window=args.window, jobs=args.jobs, skip_damaged=args.skip_damaged, exact=args.exact,
                           ranks=args.ranks, phases=args.phase)
    _check_common_records(report, args)
    if args.ranks and not report.matched and not report.only_in_base and not report.only_in_other:
        phases = ", ".join(report.config.phases or ())
        raise CommandError(f"{args.base} has no records of the phases compared ({phases}) on its ranks; record them "
                           "(parameters=True) or choose others with --phase")
    print(format_report(report, top=args.top))
    trainer_steps = _trainer_steps_of_first_divergence(report, args)
    for run, entry in trainer_steps.items():
        print(f"first divergence in the {run} run's trainer numbering: {TrainerStep(**entry).describe()}")
    try:
        if args.json is not None:
            document = {**report.to_json(), **({"first_divergence_trainer_steps": trainer_steps} if trainer_steps else {})}
            args.json.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n", encoding="utf-8")
            print(f"JSON report: {args.json}")
        if args.html is not None:
            write_html(report, args.html)
            print(f"HTML report: {args.html}")
    except OSError as error:
        raise CommandError(f"cannot write the report: {error}") from None
    return EXIT_OK if report.agrees else EXIT_NEGATIVE


def _trainer_steps_of_first_divergence(report: Report, args: argparse.Namespace) -> dict[str, dict]:
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


def _check_common_records(report: Report, args: argparse.Namespace) -> None:
    """Two dumps without one record in common are not two runs of one model (or the names changed)."""
    if report.matched or not (report.only_in_base and report.only_in_other):
        return
    filters = " after --step/--name" if args.step or args.name else ""
    hint = "check the --map patterns" if args.map is not None else "map the names that changed (--map FILE, --fuzzy)"
    example_base, example_other = report.only_in_base[0][3], report.only_in_other[0][3]
    raise CommandError(
        f"{args.base} and {args.other} have no record in common{filters} ({len(report.only_in_base)} records "
        f"only in BASE such as {example_base!r}, {len(report.only_in_other)} only in OTHER such as "
        f"{example_other!r}); compare two runs of the same model, or {hint}")
