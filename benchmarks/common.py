"""Shared benchmark plumbing: interleaved timing, environment description, markdown tables.

    times = interleaved({"baseline": f0, "probes": f1}, repeats=20)   # name -> list of seconds
    peak = peak_rss("benchmarks.parameter_overhead", case, config_json, steps=10, dump=work / "rss")  # bytes
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch


def interleaved(cases: dict[str, Callable[[], None]], repeats: int, warmup: int = 2,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Times each case ``repeats`` times, round-robin, so machine noise hits all cases alike (``clock``: e.g.
    ``time.thread_time_ns`` for the CPU time of this thread, in its units)."""
    for _ in range(warmup):
        for run in cases.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            started = clock()
            run()
            times[name].append(clock() - started)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio_spread(case: list[float], base: list[float]) -> str:
    """The median of per-round ratios ``case / base`` (rounds of ``interleaved``: the same moment of the
    machine), with their interquartile range: ``"1.05x (1.02-1.09)"``."""
    ratios = sorted(c / b for c, b in zip(case, base))
    if len(ratios) < 4:
        return f"{statistics.median(ratios):.2f}x"
    quartiles = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):.2f}x ({quartiles[0]:.2f}-{quartiles[2]:.2f})"


def environment() -> str:
    versions = [f"torch {torch.__version__}"]
    for package in ("onnxruntime", "deepspeed", "numpy"):
        try:
            versions.append(f"{package} {__import__(package).__version__}")
        except Exception:
            pass
    cpu = platform.processor() or platform.machine()
    from probes.core.native import probe_backend
    return (f"{datetime.date.today().isoformat()}, {platform.python_implementation()} {platform.python_version()}, "
            f"{os.cpu_count()} cores ({cpu}), torch threads {torch.get_num_threads()}, " + ", ".join(versions)
            + f", eager probe Function: {probe_backend()}")


@contextlib.contextmanager
def python_probes() -> Iterator[None]:
    """Subscriptions made inside use the Python probe Function in eager calls (``PROBES_PROBE_BACKEND=python``),
    for a case beside the default (the C++ probe where it is built) in the same run."""
    previous = os.environ.get("PROBES_PROBE_BACKEND")
    os.environ["PROBES_PROBE_BACKEND"] = "python"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PROBES_PROBE_BACKEND"]
        else:
            os.environ["PROBES_PROBE_BACKEND"] = previous


def table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def peak_rss(module: str, case: str, config: str, steps: int, dump: Path) -> int:
    """Peak resident memory (bytes) of a fresh process while it trains ``steps`` steps of one case (Linux).

    The process calls ``<module>._case_from_json(config, case, dump)``, which returns ``(step, manager)``; the peak
    (``VmHWM``) is taken from after the first step (whose allocations every case has alike) to the last.
    """
    script = (
        "import importlib, sys, torch\n"
        "from pathlib import Path\n"
        "torch.set_num_threads(1)\n"
        "bench = importlib.import_module(sys.argv[1])\n"
        "step, manager = bench._case_from_json(sys.argv[2], sys.argv[3], Path(sys.argv[4]))\n"
        "step()\n"
        "Path('/proc/self/clear_refs').write_text('5')\n"
        "for _ in range(int(sys.argv[5])): step()\n"
        "if manager is not None: manager.unsubscribe()\n"
        "status = dict(line.split(':', 1) for line in Path('/proc/self/status').read_text().splitlines())\n"
        "print(int(status['VmHWM'].split()[0]) * 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, module, config, case, str(dump), str(steps)], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return int(out.stdout.strip().splitlines()[-1])
