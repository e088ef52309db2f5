"""Command line: ``python -m probes show DIR [--step N] [--rank R]`` and ``python -m probes compare BASE OTHER``."""

from __future__ import annotations

import sys

from .compare import compare_main
from .dump import show_main

COMMANDS = {"show": show_main, "compare": compare_main}
USAGE = ("usage: python -m probes {show,compare} ...   "
         "(python -m probes show --help, python -m probes compare --help)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
