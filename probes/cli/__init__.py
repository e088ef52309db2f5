"""The command line: ``probes {show,compare,export,tensorboard,merge} ...`` (also ``python -m probes ...``).

    probes show run --step 3                       # a dump as a table (--anomalies: only nan/inf)
    probes compare eager_out ort_out --html r.html # the first divergence between two runs
    probes export run --format csv --output run.csv
    probes tensorboard run --logdir tb
    probes merge --pt_dir A --ort_dir B --output_dir OUT    # = python -m probes.merge_activation_summary

``probes <command> --help`` shows each command's options with examples. Exit codes: 0 success
(compare: the runs agree), 1 a negative answer (compare: the runs differ; merge: the output exists),
2 bad input; errors are one line on stderr, never a traceback (``common``).
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Callable, Sequence

from .common import EXIT_BAD_INPUT, EXIT_OK, PROG, fail
from .compare import compare
from .export import export, tensorboard
from .merge import merge
from .show import show

__all__: list[str] = []

COMMANDS: dict[str, tuple[Callable[[Sequence[str] | None], int], str]] = {
    "show": (show, "print a dump's records as a table; --anomalies: where the first nan/inf was"),
    "compare": (compare, "compare two dumps and report the first divergence"),
    "export": (export, "write a dump as JSON Lines, CSV or the original onnxruntime hooks' files"),
    "tensorboard": (tensorboard, "write a dump's statistics as TensorBoard scalars"),
    "merge": (merge, "per-step text summaries of two runs (onnxruntime's merge_activation_summary)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} <command> [options]   ({PROG} <command> --help for each)", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "exit codes: 0 success (compare: the runs agree), 1 a negative answer (compare: the runs differ; "
                  "merge: the output exists), 2 bad input (one line on stderr)"]
    return "\n".join(lines)


def _version() -> str:
    try:
        return metadata.version("probes")
    except metadata.PackageNotFoundError:
        return "unknown (not installed; run from a checkout)"


def main(argv: Sequence[str] | None = None) -> int:
    """The ``probes`` console script and ``python -m probes``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return EXIT_OK if argv else EXIT_BAD_INPUT
    if argv[0] == "--version":
        print(f"{PROG} {_version()}")
        return EXIT_OK
    if argv[0] not in COMMANDS:
        return fail(None, f"unknown command {argv[0]!r}; expected one of {', '.join(COMMANDS)} (see {PROG} --help)")
    return COMMANDS[argv[0]][0](argv[1:])
