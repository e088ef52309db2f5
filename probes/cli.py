"""The command line: ``python -m probes {show,compare,merge} ...`` (``--help`` on each).

    python -m probes show DUMP --step 3
    python -m probes compare BASE OTHER --html report.html
    python -m probes merge --pt_dir A --ort_dir B --output_dir OUT    # = python -m probes.merge_activation_summary

Exit codes: 0 success (compare: the runs agree), 1 nothing to show / the runs diverged / the merge's
output exists, 2 bad input. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

from .compare import (DEFAULT_ATOL, DEFAULT_NOISE_FACTOR, DEFAULT_RTOL, compare_dumps, format_report, parse_steps,
                      write_html)
from .compare.merge import MergeConfig, generate_summaries_per_step, prepare_output_dir
from .dump import DumpReader, format_records, load_dump

EXIT_AGREE, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2  # compare's exit status (docs/compare.md)


def show(argv: Sequence[str] | None = None) -> int:
    """``show DIR [--step N] [--rank R] [--include-partial]``: prints a dump as a table."""
    parser = argparse.ArgumentParser(
        prog="python -m probes show", description="Print the statistics records of a probes dump as a table."
    )
    parser.add_argument("path", metavar="DIR", help="a dump directory, one of its rank_<r> directories, or a step file")
    parser.add_argument("--step", type=int, help="only this step")
    parser.add_argument("--rank", type=int, help="only this rank")
    parser.add_argument(
        "--include-partial", action="store_true", help="also show the complete records of unfinished steps"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help and on usage errors; report a code instead
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        reader = DumpReader(args.path)  # one wait for live writers, one listing
        records = reader.records(include_partial=args.include_partial)
        steps = reader.steps()
    except (OSError, ValueError) as error:
        print(f"probes show: error: {error}", file=sys.stderr)
        return 1

    def wanted(rank: int | None, step: int) -> bool:
        return (args.rank is None or rank == args.rank) and (args.step is None or step == args.step)

    if not args.include_partial:
        for rank, by_state in steps.items():
            for step in by_state["unfinished"]:
                if wanted(rank, step):
                    print(
                        f"probes show: rank {rank} step {step} is unfinished (still being written, or a crash); "
                        "--include-partial shows its complete records",
                        file=sys.stderr,
                    )
    selected = [record for record in records if wanted(record["rank"], record["step"])]
    if not selected:
        available = {rank: by_state["finished"] for rank, by_state in steps.items()}
        print(f"probes show: no records match; finished steps by rank: {available}", file=sys.stderr)
        return 1
    print(format_records(selected))
    return 0


def compare(argv: Sequence[str] | None = None) -> int:
    """``compare BASE OTHER [options]``: exit 0 agree, 1 diverged, 2 bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m probes compare",
        description="Compare two statistics dumps record by record and report the first divergence. "
                    "Exit status: 0 agree, 1 diverged (or records on one side only), 2 bad input.")
    parser.add_argument("base", metavar="BASE", help="the reference dump (directory, rank_<r> directory or step file)")
    parser.add_argument("other", metavar="OTHER", help="the dump to check against BASE")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                        help=f"relative tolerance (default {DEFAULT_RTOL:g})")
    parser.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                        help=f"absolute tolerance (default {DEFAULT_ATOL:g})")
    parser.add_argument("--noise", metavar="BASE2",
                        help="a second run of the baseline: per-record tolerance max(atol + rtol*|x|, k*noise)")
    parser.add_argument("--noise-factor", type=float, default=DEFAULT_NOISE_FACTOR, metavar="K",
                        help=f"k of the noise tolerance (default {DEFAULT_NOISE_FACTOR:g})")
    parser.add_argument("--step", action="append", type=parse_steps, metavar="STEPS",
                        help="only these steps: N, A-B or a comma list (repeatable)")
    parser.add_argument("--name", action="append", default=[], metavar="GLOB",
                        help="only records whose name matches this glob, e.g. 'blocks.1.*' (repeatable)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the JSON report (docs/compare.md) here")
    parser.add_argument("--html", type=Path, metavar="OUT", help="write the self-contained HTML report here")
    parser.add_argument("--top", type=int, default=10, help="rows in the table of worst records (default 10)")
    parser.add_argument("--strict-zero-grads", action="store_true",
                        help="a gradient exactly zero in one run and absent in the other is a divergence "
                             "(default: a note)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help and on usage errors; report a code instead
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT
    steps = frozenset().union(*args.step) if args.step else None
    try:
        report = compare_dumps(args.base, args.other, rtol=args.rtol, atol=args.atol, noise=args.noise,
                               noise_factor=args.noise_factor, steps=steps, names=args.name, progress=True,
                               strict_zero_grads=args.strict_zero_grads)
    except (OSError, ValueError) as error:  # DumpFormatError is a ValueError naming file and line
        print(f"probes compare: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(report, top=args.top))
    try:
        if args.json is not None:
            args.json.write_text(json.dumps(report.to_json(), indent=1, allow_nan=False) + "\n", encoding="utf-8")
            print(f"JSON report: {args.json}")
        if args.html is not None:
            write_html(report, args.html)
            print(f"HTML report: {args.html}")
    except OSError as error:
        print(f"probes compare: error: cannot write the report: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_AGREE if report.agrees else EXIT_DIVERGED


def merge(argv: Sequence[str] | None = None, prog: str = "python -m probes merge") -> int:
    """Exit status 0 on success, 1 when the output directory exists (without --overwrite), 2 for bad input."""
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Merge per-step summaries of a baseline and an ORT run.")
    parser.add_argument("--pt_dir", required=True, help="Root of the PyTorch (baseline) run's probes dump.")
    parser.add_argument("--ort_dir", required=True, help="Root of the ORTModule run's probes dump.")
    parser.add_argument("--output_dir", required=True, help="Where merge_pt/ and merge_ort/ are written.")
    parser.add_argument("--overwrite", action="store_true", help="Replace merge_pt/ and merge_ort/ if present.")
    parser.add_argument("--rank", type=int, help="The rank to merge (default: the baseline's lowest rank).")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s: %(message)s")
    config = MergeConfig(pt_dir=Path(args.pt_dir), ort_dir=Path(args.ort_dir), output_dir=Path(args.output_dir),
                         overwrite=args.overwrite, rank=args.rank)
    try:  # a bad dump fails before the output directory is touched
        base_records = load_dump(config.pt_dir)
        other_records = load_dump(config.ort_dir)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        prepare_output_dir(config)
    except FileExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    generate_summaries_per_step(config, base_records, other_records)
    return 0


COMMANDS = {"show": show, "compare": compare, "merge": merge}
USAGE = ("usage: python -m probes {show,compare,merge} ...   "
         "(python -m probes show --help, python -m probes compare --help, python -m probes merge --help)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
