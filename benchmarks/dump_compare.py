"""Dump size, write and load speed, and `probes compare` end to end on two runs of a million records each.

    python -m benchmarks.dump_compare [--quick]

Stages: write two runs with DumpWriter (records of 4,096-element tensors with 32 samples each, the
samples of every record and step different, as a real run's are; the second run's means off by a
relative 1e-7), then load both as tables (``load_table``), then run the command a user runs, ``probes
compare BASE OTHER --json --html`` (read, match, check, report; no divergence at the default
tolerance), timed as a whole. The same records written as JSON Lines (format version 1) give the size
and load-speed baseline, on a slice of the steps.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import environment, table
from probes.cli import main as probes_main
from probes.dump import load_dump, load_table
from probes.dump.writer import DumpWriter

FULL = (1000, 1000)  # steps, records per step: a million records per run
QUICK = (20, 100)
TEXT_STEPS = 20  # steps written as JSON Lines too, for the baseline


def write_run(directory: Path, steps: int, per_step: int, scale: float, *, format: str = "parquet") -> float:
    """Writes one run's dump; returns the seconds it took (records built, queued, encoded, written)."""
    rng = np.random.default_rng(0)
    shape = rng.standard_normal((per_step, 32)).astype(np.float32).astype(np.float64)
    indices = list(range(0, 4096, 128))
    started = time.perf_counter()
    with DumpWriter(directory, format=format) as writer:
        for step in range(steps):
            samples = (shape + 0.01 * rng.standard_normal((per_step, 32))).astype(np.float32).astype(np.float64)
            for index in range(per_step):
                values = samples[index]
                writer.write(step, {
                    "step": step, "rank": 0, "name": f"layers.{index // 2}.output.0",
                    "phase": "forward" if index % 2 == 0 else "backward", "seq": index, "tensor_index": 0,
                    "module": f"layers.{index // 2}", "module_class": "Linear", "kind": "output", "depth": 2,
                    "legacy_name": f"Linear_{index // 2}_0th_output", "shape": [8, 512], "dtype": "float32",
                    "numel": 4096, "finite": 4096, "mean": float(values.mean()) * scale,
                    "m2": float(values.var()) * 4096, "min": float(values.min()), "max": float(values.max()),
                    "nan": 0, "inf": 0, "neg": 2048, "pos": 2048, "zero": 0, "std": float(values.std()),
                    "samples": values.tolist(), "sample_indices": indices})
            writer.finish_step(step)
    return time.perf_counter() - started


def size(directory: Path, suffix: str) -> int:
    return sum(path.stat().st_size for path in directory.rglob(f"*{suffix}"))


def run(quick: bool = False) -> str:
    steps, per_step = QUICK if quick else FULL
    records = steps * per_step
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    write_seconds = write_run(work / "base", steps, per_step, 1.0)
    write_run(work / "other", steps, per_step, 1.0 + 1e-7)
    text_steps = min(TEXT_STEPS, steps)
    text_seconds = write_run(work / "text", text_steps, per_step, 1.0, format="jsonl")
    text_records = text_steps * per_step

    started = time.perf_counter()
    rows = sum(load_table(work / name).num_rows for name in ("base", "other"))
    table_seconds = time.perf_counter() - started
    started = time.perf_counter()
    text_loaded = len(load_dump(work / "text"))
    text_load_seconds = time.perf_counter() - started
    assert rows == 2 * records and text_loaded == text_records

    output = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(io.StringIO()):
        code = probes_main(["compare", str(work / "base"), str(work / "other"), "--json", str(work / "r.json"),
                            "--html", str(work / "r.html")])
    compare_seconds = time.perf_counter() - started
    if code != 0:
        raise AssertionError(f"benchmark dumps unexpectedly differ (exit {code}):\n{output.getvalue()}")

    parquet_bytes = size(work / "base", ".parquet") / records
    text_bytes = size(work / "text", ".jsonl") / text_records
    rows_out = [
        ["records per run", f"{records:,}"],
        ["bytes per record: Parquet (default) / JSON Lines", f"{parquet_bytes:.0f} / {text_bytes:.0f}"],
        ["write, µs per record (DumpWriter): Parquet / JSON Lines",
         f"{write_seconds / records * 1e6:.1f} / {text_seconds / text_records * 1e6:.1f}"],
        ["load_table, records per second (both runs)", f"{rows / table_seconds:,.0f}"],
        ["load_dump of JSON Lines, records per second", f"{text_loaded / text_load_seconds:,.0f}"],
        ["`probes compare --json --html` of the two runs, end to end (s)", f"{compare_seconds:.1f}"],
        ["HTML report size (KiB)", f"{(work / 'r.html').stat().st_size / 1024:.0f}"],
    ]
    return (f"### Dump size, load and compare at scale ({'quick' if quick else 'full'}: {steps} steps x {per_step} "
            f"records per run)\n\n{environment()}\n\n" + table(["measure", "value"], rows_out))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
