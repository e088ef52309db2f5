"""Shared benchmark plumbing: interleaved timing, environment description, markdown tables.

    times = interleaved({"baseline": f0, "probes": f1}, repeats=20)   # name -> list of seconds
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from typing import Callable

import torch


def interleaved(cases: dict[str, Callable[[], None]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Times each case ``repeats`` times, round-robin, so machine noise hits all cases alike."""
    for _ in range(warmup):
        for run in cases.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
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
    return (f"{datetime.date.today().isoformat()}, {platform.python_implementation()} {platform.python_version()}, "
            f"{os.cpu_count()} cores ({cpu}), torch threads {torch.get_num_threads()}, " + ", ".join(versions))


def table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
