"""``probes export DUMP`` (JSON Lines, CSV, the original onnxruntime layout) and ``probes tensorboard DUMP``.

    probes export run --format csv --output run.csv
    probes tensorboard run --logdir tb --module 'blocks.0.*'    # then: tensorboard --logdir tb
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from ..sinks import FORMATS, export_dump, write_tensorboard
from ..sinks.tensorboard import PHASES
from .common import EXIT_OK, CommandError, command_parser, open_dump, run_command

EXPORT_EXAMPLES = [
    "probes export run --format jsonl --output run.jsonl     # one JSON object per record",
    "probes export run --format csv --output run.csv         # one row per record, named columns",
    "probes export run --format ort --output ort_layout      # the original onnxruntime hooks' files",
]
TENSORBOARD_EXAMPLES = [
    "probes tensorboard run --logdir tb                       # then: tensorboard --logdir tb",
    "probes tensorboard run --logdir tb --module 'blocks.0.*' --phase backward",
]


def export_parser() -> argparse.ArgumentParser:
    parser = command_parser("export", "Write a probes dump in another format.", examples=EXPORT_EXAMPLES)
    parser.add_argument("path", metavar="DUMP", help="a dump directory, one of its rank_<r> directories, or a step file")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the output format")
    parser.add_argument("--output", required=True, type=Path, metavar="PATH",
                        help="the output file (jsonl, csv) or directory (ort)")
    parser.add_argument("--rank", type=int, help="only this rank (ort: default the lowest)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return parser


def tensorboard_parser() -> argparse.ArgumentParser:
    parser = command_parser("tensorboard", "Write a dump's per-module statistics as TensorBoard scalars "
                                           "(tags like forward/blocks.0.attn.output.0/std).",
                            examples=TENSORBOARD_EXAMPLES)
    parser.add_argument("path", metavar="DUMP", help="a dump directory, one of its rank_<r> directories, or a step file")
    parser.add_argument("--logdir", required=True, type=Path, help="TensorBoard's log directory (rank_<r> inside)")
    parser.add_argument("--module", action="append", default=[], metavar="GLOB",
                        help="only modules (or record names) matching this glob (repeatable)")
    parser.add_argument("--phase", action="append", choices=PHASES, help="only this phase (repeatable)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the event files already in LOGDIR/rank_<r> (default: refuse)")
    return parser


def export(argv: Sequence[str] | None = None) -> int:
    """``probes export``: exit 0 written, 2 bad input."""
    return run_command("export", export_parser(), argv, _export)


def tensorboard(argv: Sequence[str] | None = None) -> int:
    """``probes tensorboard``: exit 0 written, 2 bad input."""
    return run_command("tensorboard", tensorboard_parser(), argv, _tensorboard)


def _export(args: argparse.Namespace) -> int:
    open_dump(args.path)
    result = export_dump(args.path, args.output, format=args.format, overwrite=args.overwrite, rank=args.rank,
                         progress=True)
    print(f"{args.format}: {result}")
    return EXIT_OK


def _tensorboard(args: argparse.Namespace) -> int:
    open_dump(args.path)
    try:
        result = write_tensorboard(args.path, args.logdir, modules=args.module, phases=args.phase,
                                   overwrite=args.overwrite, progress=True)
    except ImportError as error:
        raise CommandError(str(error)) from None
    print(f"tensorboard: {result} (open it: tensorboard --logdir {args.logdir})")
    return EXIT_OK
