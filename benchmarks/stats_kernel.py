"""Statistics-kernel throughput and extra peak memory, against one ``tensor.sum()`` pass.

    python -m benchmarks.stats_kernel [--quick]

For fp32 CPU tensors from 1e3 to 1e8 elements (one thread): the time of ``probes.stats.numerics.summarize``
and of the original onnxruntime ``_summarize_tensor`` (its per-bucket statistics, into a string
buffer), each as throughput relative to ``tensor.sum()`` on the same tensor in the same run (1.0 means
as fast as one sum pass). Extra peak memory is measured in a fresh subprocess per case: the
peak resident set (VmHWM) is reset once the tensor exists, so its growth is what the operation
itself allocated.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import warnings

import torch

from benchmarks.common import environment, interleaved, median, table
from probes.stats import numerics

FULL_SIZES = (10**3, 10**4, 10**5, 10**6, 10**7, 10**8)
QUICK_SIZES = (10**3, 10**5)

_MEMORY_PROBE = """
import json, sys, torch
torch.set_num_threads(1)
size, case = int(sys.argv[1]), sys.argv[2]

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

from probes.stats import numerics
numerics.summarize(torch.randn(10))  # load the kernel before measuring
x = torch.randn(size)
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current resident set
    f.write("5")
before = status("VmHWM")
if case == "summarize":
    numerics.summarize(x)
elif case == "clone":
    x.clone().sum()
print(json.dumps({"extra_kib": status("VmHWM") - before}))
"""


def _original_summarize():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from onnxruntime.training.utils.hooks._statistics_subscriber import _summarize_tensor
    except Exception:
        return None
    return lambda x: _summarize_tensor("x", x, io.StringIO())


def extra_peak_kib(size: int, case: str) -> int:
    result = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(size), case], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["extra_kib"]


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    original = _original_summarize()
    rows = []
    for size in QUICK_SIZES if quick else FULL_SIZES:
        x = torch.randn(size)
        cases = {"sum": lambda: x.sum(), "probes": lambda: numerics.summarize(x)}
        if original is not None:
            cases["original"] = lambda: original(x)
        repeats = 3 if quick else max(3, min(50, 10**8 // (size * 4)))
        times = interleaved(cases, repeats=repeats, warmup=1)
        base = median(times["sum"])
        gbps = 4 * size / base / 1e9
        row = [f"{size:.0e}", f"{gbps:.1f}", f"{base / median(times['probes']):.2f}",
               f"{base / median(times['original']):.4f}" if original is not None else "n/a"]
        if size >= 10**6 or quick:
            row += [f"{extra_peak_kib(size, 'summarize') / 1024:.1f}", f"{extra_peak_kib(size, 'clone') / 1024:.1f}"]
        else:
            row += ["", ""]
        rows.append(row)
    return (f"### Statistics kernel, fp32 CPU, 1 thread (backend: {numerics.backend()})\n\n{environment()}\n\n"
            + table(["elements", "sum GB/s", "probes / sum throughput", "original / sum throughput",
                     "probes extra peak MiB", "clone extra peak MiB"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
