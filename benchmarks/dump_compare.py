"""Dump volume and the compare tool's time on a large dump (1,000 steps x 500 records).

    python -m benchmarks.dump_compare [--quick]

Two runs' dumps are written with DumpWriter from realistic records (statistics and 32 samples of a
random tensor), the second with a 1e-7 relative perturbation, and compared with
``compare_dumps`` (tolerance 1e-4, no divergence). Reported against the time to only read both
dumps with ``load_dump``, the floor any comparison pays.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment, table
from probes.compare import compare_dumps
from probes.dump import DumpWriter, load_dump
from probes.stats.subscriber import tensor_record

FULL = (1000, 500)  # steps, records per step
QUICK = (20, 50)


def write_run(directory: Path, steps: int, per_step: int, scale: float) -> float:
    """Writes one run's dump; returns the seconds it took (queueing, encoding, writing)."""
    torch.manual_seed(0)
    templates = [tensor_record(torch.randn(4096) * (1 + i % 7)) for i in range(8)]
    started = time.perf_counter()
    writer = DumpWriter(directory)
    for step in range(steps):
        for index in range(per_step):
            record = dict(templates[index % len(templates)])
            record["mean"] = record["mean"] * scale
            record.update(step=step, rank=0, name=f"layers.{index // 2}.output.0", seq=index,
                          phase="forward" if index % 2 == 0 else "backward")
            writer.write(step, record)
        writer.finish_step(step)
    writer.close()
    return time.perf_counter() - started


def run(quick: bool = False) -> str:
    steps, per_step = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    write_seconds = write_run(work / "base", steps, per_step, 1.0)
    write_run(work / "other", steps, per_step, 1.0 + 1e-7)
    size = sum(path.stat().st_size for path in (work / "base").rglob("*") if path.is_file())

    started = time.perf_counter()
    for name in ("base", "other"):
        load_dump(work / name)
    load_seconds = time.perf_counter() - started
    started = time.perf_counter()
    report = compare_dumps(work / "base", work / "other", rtol=1e-4, atol=1e-6)
    compare_seconds = time.perf_counter() - started
    if report.first_divergence is not None:
        raise AssertionError(f"benchmark dumps unexpectedly diverge: {report.first_divergence}")

    records = steps * per_step
    rows = [
        ["records per run", f"{records:,}"],
        ["dump size per step (KiB)", f"{size / steps / 1024:.0f}"],
        ["bytes per record", f"{size / records:.0f}"],
        ["write, µs per record (DumpWriter, one run)", f"{write_seconds / records * 1e6:.1f}"],
        ["load both dumps (s)", f"{load_seconds:.2f}"],
        ["compare both dumps (s)", f"{compare_seconds:.2f}"],
        ["compare / load", f"{compare_seconds / load_seconds:.2f}x"],
    ]
    return (f"### Dump volume and compare time ({'quick' if quick else 'full'}: {steps} steps x {per_step} records)"
            f"\n\n{environment()}\n\n" + table(["measure", "value"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
