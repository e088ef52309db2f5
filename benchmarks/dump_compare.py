"""Dump size, write and load speed, and `probes compare` end to end on two runs of a million records each,
and of ten million (``--large``; ``--large-steps 5000`` for 5M), with the peak memory of every process.

    python -m benchmarks.dump_compare [--quick] [--large]

Stages: write two runs with DumpWriter (records of 4,096-element tensors with 32 samples each, the
samples of every record and step different, as a real run's are; the second run's means off by a
relative 1e-7; handed over as the subscriber hands them, a RowBlock of statistics rows per step, which the
writer thread turns into Arrow and Parquet), then load both as tables (``load_table``), then run the command a user runs, ``probes
compare BASE OTHER --json --html`` (read, match, check, report; no divergence at the default
tolerance), timed as a whole in its own process, beside its peak memory: the command's and every process
it started, summed, sampled every 20 ms, as resident memory (RSS; pages the forked workers share with the
command count once per process, so this over-counts) and as proportional memory (PSS; shared pages split
between the processes sharing them: the memory the machine gives the command). The one-window, one-process run is
what compare did before windows (the whole of both dumps as one table). The same records written as JSON
Lines (format version 1) give the size and load-speed baseline, on a slice of the steps. The large runs are
written step file by step file from one step's table (``write_copies``): DumpWriter at 55 µs a record would
take minutes for them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from benchmarks.common import environment, table
from probes.dump import load_dump, load_table
from probes.dump.columns import read_parquet, write_parquet
from probes.dump.layout import DumpLayout
from probes.dump.rowblock import Described, Entry, RowBlock
from probes.dump.statistics import ACCUMULATED
from probes.dump.writer import DumpWriter

FULL = (1000, 1000)  # steps, records per step: a million records per run
QUICK = (20, 100)
LARGE_STEPS = 10_000  # x 1,000 records: ten million records per run
TEXT_STEPS = 20  # steps written as JSON Lines too, for the baseline
ROOT = Path(__file__).resolve().parents[1]


def write_run(directory: Path, steps: int, per_step: int, scale: float, *, format: str = "parquet") -> float:
    """Writes one run's dump; returns the seconds it took (rows built, handed over, turned into Arrow, written)."""
    rng = np.random.default_rng(0)
    shape = rng.standard_normal((per_step, 32)).astype(np.float32).astype(np.float64)
    indices = list(range(0, 4096, 128))
    described = Described(("shape", "dtype"), [8, 512], "float32", numel=4096)
    names = [(f"layers.{index // 2}.output.0", 0, f"layers.{index // 2}", "Linear", "output", 2,
              f"Linear_{index // 2}_0th_output", None) for index in range(per_step)]
    slot = {stat.name: position for position, stat in enumerate(ACCUMULATED)}
    started = time.perf_counter()
    with DumpWriter(directory, format=format) as writer:
        for step in range(steps):
            samples = (shape + 0.01 * rng.standard_normal((per_step, 32))).astype(np.float32).astype(np.float64)
            rows = np.zeros((per_step, len(ACCUMULATED) + 32))
            for name, value in (("numel", 4096), ("finite", 4096), ("mean", samples.mean(axis=1) * scale),
                                ("m2", samples.var(axis=1) * 4096), ("min", samples.min(axis=1)),
                                ("max", samples.max(axis=1)), ("neg", 2048), ("pos", 2048)):
                rows[:, slot[name]] = value
            rows[:, len(ACCUMULATED):] = samples
            entries = [Entry(names[index], "forward" if index % 2 == 0 else "backward", index, described, 0, index, step)
                       for index in range(per_step)]
            writer.write(step, RowBlock(step=step, rank=0, sample_count=32, parts=[rows], entries=entries,
                                        indices=lambda numel: indices))
            writer.finish_step(step)
    return time.perf_counter() - started


def write_copies(directory: Path, steps: int, per_step: int, scale: float) -> None:
    """A run of ``steps`` steps written from its first step's table: each step's means and samples new, as
    ``write_run`` makes them, the files the writer's (``write_parquet``: the record count in the footer)."""
    write_run(directory, 1, per_step, scale)
    layout = DumpLayout(directory)
    first = read_parquet(layout.step_file(0, 0))
    rng = np.random.default_rng(1)
    samples = np.asarray(first.column("samples").combine_chunks().values).reshape(per_step, -1)
    offsets = first.column("samples").combine_chunks().offsets
    for step in range(1, steps):
        values = (samples + 0.01 * rng.standard_normal(samples.shape)).astype(np.float32).astype(np.float64)
        table = first.set_column(first.schema.get_field_index("step"), "step", pa.array(np.full(per_step, step)))
        table = table.set_column(table.schema.get_field_index("mean"), "mean", pa.array(values.mean(axis=1) * scale))
        table = table.set_column(table.schema.get_field_index("samples"), "samples",
                                 pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1))))
        write_parquet(layout.step_file(0, step), table)


def measured(command: list[str]) -> tuple[int, float, tuple[int, int], str]:
    """(exit code, seconds, peak (RSS, PSS) bytes of the command and its processes together, stdout)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    peak = [0, 0]

    def sample() -> None:
        while process.poll() is None:
            rss, pss = _tree_memory(process.pid)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    seconds = time.perf_counter() - started
    sampler.join()
    return process.returncode, seconds, (peak[0], peak[1]), out.decode()


def _tree_memory(root: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of ``root`` and its descendants, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    parents[int(entry)] = int(file.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    rss = pss = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as file:
                for line in file:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            pass
        stack += [child for child, parent in parents.items() if parent == pid]
    return rss, pss


def compare_rows(work: Path, label: str, cases: list[tuple[str, list[str]]]) -> list[list[str]]:
    """One row per case: `probes compare --json --html` end to end, its peak memory and its HTML's size."""
    rows = []
    for name, options in cases:
        for report in ("r.json", "r.html"):
            (work / report).unlink(missing_ok=True)
        code, seconds, peak, out = measured([sys.executable, "-m", "probes", "compare", str(work / "base"),
                                             str(work / "other"), "--json", str(work / "r.json"), "--html",
                                             str(work / "r.html"), *options])
        if code != 0:
            raise AssertionError(f"benchmark dumps unexpectedly differ (exit {code}):\n{out}")
        rows.append([f"{label}: {name}", f"{seconds:.1f}", f"{peak[0] / 2**30:.2f}", f"{peak[1] / 2**30:.2f}",
                     f"{(work / 'r.html').stat().st_size / 1024:.0f}"])
    return rows


def size(directory: Path, suffix: str) -> int:
    return sum(path.stat().st_size for path in directory.rglob(f"*{suffix}"))


def run(quick: bool = False, large_steps: int | None = None) -> str:
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

    cases = [("one window, 1 process (compare before windows)", ["--window", "1000000000", "--jobs", "1"]),
             ("default window, 1 process", ["--jobs", "1"]),
             ("default window, 2 processes", ["--jobs", "2"])]
    compared = compare_rows(work, f"{records:,} x 2", cases)
    parquet_bytes = size(work / "base", ".parquet") / records
    text_bytes = size(work / "text", ".jsonl") / text_records
    rows_out = [
        ["records per run", f"{records:,}"],
        ["bytes per record: Parquet (default) / JSON Lines", f"{parquet_bytes:.0f} / {text_bytes:.0f}"],
        ["write, µs per record (DumpWriter): Parquet / JSON Lines",
         f"{write_seconds / records * 1e6:.1f} / {text_seconds / text_records * 1e6:.1f}"],
        ["load_table, records per second (both runs)", f"{rows / table_seconds:,.0f}"],
        ["load_dump of JSON Lines, records per second", f"{text_loaded / text_load_seconds:,.0f}"],
    ]
    if large_steps:
        shutil.rmtree(work)
        work.mkdir()
        write_copies(work / "base", large_steps, per_step, 1.0)
        write_copies(work / "other", large_steps, per_step, 1.0 + 1e-7)
        compared += compare_rows(work, f"{large_steps * per_step:,} x 2", cases[1:])
    shutil.rmtree(work)
    return (f"### Dump size, load and compare at scale ({'quick' if quick else 'full'}: {steps} steps x {per_step} "
            f"records per run)\n\n{environment()}\n\n" + table(["measure", "value"], rows_out) + "\n\n"
            + table(["`probes compare --json --html`, records", "seconds", "peak RSS (GiB), processes summed",
                     "peak PSS (GiB), processes summed", "HTML (KiB)"], compared))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--large", action="store_true", help=f"also two runs of {LARGE_STEPS:,} steps")
    parser.add_argument("--large-steps", type=int, help="also two runs of this many steps (5000: 5M records)")
    args = parser.parse_args()
    print(run(args.quick, args.large_steps or (LARGE_STEPS if args.large else None)))
