"""``probes merge``: per-step text summaries of two runs, like onnxruntime's merge_activation_summary.

    probes merge --pt_dir pt_out --ort_dir ort_out --output_dir merged [--overwrite]
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..compare.summaries import MergeConfig, generate_summaries_per_step, prepare_output_dir
from ..dump import load_dump
from ..utils.flags import add_flags, given
from .common import EXIT_NEGATIVE, EXIT_OK, command_parser, open_dump, run_command

EXAMPLES = [
    "probes merge --pt_dir pt_out --ort_dir ort_out --output_dir merged",
    "diff merged/merge_pt/step_0_.txt merged/merge_ort/step_0_.txt",
]


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser("merge", "Merge per-step summaries of a baseline and an ORT run "
                                     "(the original onnxruntime merge_activation_summary's flags).", examples=EXAMPLES)
    if prog is not None:
        parser.prog = prog
    add_flags(parser, MergeConfig)
    return parser


def merge(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Exit 0 on success, 1 when the output directory exists (without --overwrite), 2 for bad input."""
    return run_command("merge", parser(prog), argv, _merge)


def _merge(args: argparse.Namespace) -> int:
    config = MergeConfig(**given(MergeConfig, args))
    open_dump(config.pt_dir)  # a bad dump fails before the output directory is touched
    open_dump(config.ort_dir)
    base_records = load_dump(config.pt_dir)
    other_records = load_dump(config.ort_dir)
    try:
        prepare_output_dir(config)
    except FileExistsError as error:
        print(f"probes merge: {error}", file=sys.stderr)
        return EXIT_NEGATIVE
    generate_summaries_per_step(config, base_records, other_records)
    return EXIT_OK
