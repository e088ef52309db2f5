"""What ``hash=True`` costs: the statistics row of one tensor with and without its hash, and the training step.

    python -m benchmarks.hash_overhead [--quick]

One CPU thread. Per tensor: ``StepRows.add`` of a float32 tensor (the C++ kernel, and the torch path with
``PROBES_NUMERICS_BACKEND=torch``), with the hash against without it, interleaved. Per step: the 4-layer
d_model 256 transformer (step_overhead's) eager, ``StatisticsSubscriber(hash=True)`` against the same
subscriber without it, in the same run.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from pathlib import Path

import torch

from benchmarks.common import environment, interleaved, median, table
from benchmarks.step_overhead import FULL, QUICK
from probes import StatisticsSubscriber, SubscriberManager
from probes.dump.live import flush_writers
from probes.models import TinyTransformer, make_batch
from probes.dump.rowblock import RecordNames
from probes.stats.rows import StepRows


def _rows_case(tensor: torch.Tensor, backend: str, hash: bool):
    os.environ["PROBES_NUMERICS_BACKEND"] = backend
    rows = StepRows(rank=0, sample_count=32, hash=hash)
    os.environ.pop("PROBES_NUMERICS_BACKEND")
    names = RecordNames("t", 0, "m", "Linear", "output", 1, "t", None)

    def run() -> None:
        for _ in range(8):
            rows.add_named(names, 0, "forward", 0, tensor)
        rows.clear()
    return run


def _per_tensor(quick: bool) -> list[list[object]]:
    sizes = (1 << 12, 1 << 16) if quick else (1 << 12, 1 << 16, 1 << 20)
    repeats = 3 if quick else 21
    rows = []
    for numel in sizes:
        tensor = torch.randn(numel)
        for backend in ("cpp", "torch"):
            times = interleaved({hashed: _rows_case(tensor, backend, hashed) for hashed in (False, True)},
                                repeats=repeats)
            base, hashed = median(times[False]) / 8, median(times[True]) / 8
            rows.append([f"float32 x {numel:,}", backend, f"{base * 1e6:.1f}", f"{hashed * 1e6:.1f}",
                         f"{hashed / base:.2f}x"])
    return rows


def _per_step(quick: bool) -> list[list[object]]:
    config = QUICK if quick else FULL
    repeats = 3 if quick else 15
    torch.manual_seed(0)
    base = TinyTransformer(config)
    batch = make_batch(config, batch_size=8, seed=0)
    work = Path(tempfile.mkdtemp(prefix="probes-bench-hash-"))
    managers, cases = [], {}
    for hashed in (False, True):
        model = copy.deepcopy(base)
        dump = work / f"hash-{hashed}"
        managers.append(SubscriberManager())
        managers[-1].subscribe(model, [StatisticsSubscriber(dump, hash=hashed)])

        def run_step(model: torch.nn.Module = model, dump: Path = dump) -> None:
            model.zero_grad(set_to_none=True)
            model(batch["tokens"], labels=batch["labels"]).backward()
            flush_writers(dump)
        cases[hashed] = run_step
    times = interleaved(cases, repeats=repeats)
    for manager in managers:
        manager.unsubscribe()
    base_time = median(times[False])
    return [[f"d_model {config.d_model}, {config.n_layers} layers", "statistics" + (" + hash" if hashed else ""),
             f"{median(times[hashed]) * 1e3:.1f}", f"{median(times[hashed]) / base_time:.2f}x"] for hashed in (False, True)]


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    return ("### hash=True: a record's 64-bit hash, per tensor and per training step\n\n"
            f"{environment()}\n\n"
            + table(["tensor", "backend", "row us", "row + hash us", "ratio"], _per_tensor(quick)) + "\n\n"
            + table(["model", "case", "median ms / step", "/ statistics alone"], _per_step(quick)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
