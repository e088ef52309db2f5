"""Runs the benchmarks and writes docs/benchmarks.md.

    python -m benchmarks [--quick] [--no-write]      (./dev bench runs this)
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

BENCHMARKS = (
    "benchmarks.step_overhead",
    "benchmarks.sentinel_overhead",
    "benchmarks.compile_overhead",
    "benchmarks.stats_kernel",
    "benchmarks.probe_overhead",
    "benchmarks.probe_parts",
    "benchmarks.gpt2_overhead",
    "benchmarks.gpt2_ort_overhead",
    "benchmarks.ops_overhead",
    "benchmarks.dump_compare",
    "benchmarks.zero3_bench",
    "benchmarks.host_reads",
    "benchmarks.callback_overhead",
    "benchmarks.parameter_overhead",
    "benchmarks.hash_overhead",
)
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Written by `./dev bench` (`python -m benchmarks`). Every figure is a ratio against a baseline measured
in the same run, cases interleaved round-robin; the machines are noisy, so read ratios, not times.
Where a probe's time goes, and figures before and after each change: [performance.md](performance.md).

"""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (what CI runs)")
    parser.add_argument("--no-write", action="store_true", help="print only, do not write docs/benchmarks.md")
    args = parser.parse_args()
    sections = []
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            continue
        section = module.run(quick=args.quick)
        print(section, "\n", flush=True)
        sections.append(section)
    if not args.no_write:
        DOC.write_text(HEADER + "\n\n".join(sections) + "\n")
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
