"""``probes export DUMP`` (JSON Lines, CSV, the original onnxruntime layout) and ``probes tensorboard DUMP``.

    probes export run --format csv --output run.csv
    probes tensorboard run --logdir tb --module 'blocks.0.*'    # then: tensorboard --logdir tb

Their options are ``export_dump``'s and ``write_tensorboard``'s, declared once: ``ExportOptions``,
``TensorBoardOptions`` (``probes.utils.flags``).
"""

from __future__ import annotations

import argparse
from typing import Sequence

from ..sinks import export_dump, write_tensorboard
from ..sinks.output import ExportOptions
from ..sinks.tensorboard import TensorBoardOptions
from ..utils.flags import add_flags, given, keyword_values
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
    add_flags(parser, ExportOptions)
    return parser


def tensorboard_parser() -> argparse.ArgumentParser:
    parser = command_parser("tensorboard", "Write a dump's per-module statistics as TensorBoard scalars "
                                           "(tags like forward/blocks.0.attn.output.0/std).",
                            examples=TENSORBOARD_EXAMPLES)
    add_flags(parser, TensorBoardOptions)
    return parser


def export(argv: Sequence[str] | None = None) -> int:
    """``probes export``: exit 0 written, 2 bad input."""
    return run_command("export", export_parser(), argv, _export)


def tensorboard(argv: Sequence[str] | None = None) -> int:
    """``probes tensorboard``: exit 0 written, 2 bad input."""
    return run_command("tensorboard", tensorboard_parser(), argv, _tensorboard)


def _export(args: argparse.Namespace) -> int:
    options = ExportOptions(**given(ExportOptions, args), progress=True)  # bad options: one line naming the flags
    open_dump(options.dump)
    result = export_dump(options.dump, options.output, **keyword_values(options))
    print(f"{options.format}: {result}")
    return EXIT_OK


def _tensorboard(args: argparse.Namespace) -> int:
    options = TensorBoardOptions(**given(TensorBoardOptions, args), progress=True)
    open_dump(options.dump)
    try:
        result = write_tensorboard(options.dump, options.logdir, **keyword_values(options))
    except ImportError as error:
        raise CommandError(str(error)) from None
    print(f"tensorboard: {result} (open it: tensorboard --logdir {options.logdir})")
    return EXIT_OK
