"""Cost of the anomaly sentinel while nothing is found, against the same step without it.

    python -m benchmarks.sentinel_overhead [--quick]

Eager PyTorch and ORTModule on the CPU, one thread, the 4-layer transformer of the step benchmark
(d_model 256, seq 128, batch 8). Cases: no probes; ``AnomalySentinel`` alone (a counting pass per
tensor, nothing written); ``StatisticsSubscriber``; the same with ``on_anomaly="raise"`` and a ring
buffer (``keep_last=4``), whose check reads the records' counts. Cases are timed round-robin; the
ratios are medians against the unprobed step of the same backend and against statistics without check.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from pathlib import Path
from typing import Callable

os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # a failed export must not time PyTorch

import torch

from benchmarks.common import environment, interleaved, median, table
from benchmarks.step_overhead import FULL, QUICK, _ortmodule
from probes import AnomalySentinel, StatisticsSubscriber, SubscriberBase, SubscriberManager
from probes.models import TinyTransformer, TransformerConfig, make_batch

CASES: dict[str, Callable[[Path], list[SubscriberBase]]] = {
    "no probes": lambda dump: [],
    "AnomalySentinel": lambda dump: [AnomalySentinel(action="raise")],
    "StatisticsSubscriber": lambda dump: [StatisticsSubscriber(dump)],
    "StatisticsSubscriber(on_anomaly='raise', keep_last=4)":
        lambda dump: [StatisticsSubscriber(dump, on_anomaly="raise", keep_last=4)],
}


def _measure(config: TransformerConfig, repeats: int, work: Path) -> list[list[object]]:
    torch.manual_seed(0)
    base = TinyTransformer(config)
    batch = make_batch(config, batch_size=8, seed=0)
    managers, cases = [], {}
    for backend in ("eager", "ortmodule"):
        for case, subscribers in CASES.items():
            model = copy.deepcopy(base)
            chosen = subscribers(work / f"{backend}-{len(cases)}")
            if chosen:
                managers.append(SubscriberManager())
                managers[-1].subscribe(model, chosen)
            if backend == "ortmodule" and (model := _ortmodule(model)) is None:
                break
            cases[(backend, case)] = model

    def step(model: torch.nn.Module) -> Callable[[], None]:
        def run_step() -> None:
            model.zero_grad(set_to_none=True)
            model(batch["tokens"], labels=batch["labels"]).backward()
        return run_step

    times = interleaved({key: step(model) for key, model in cases.items()}, repeats=repeats)
    for manager in managers:
        manager.unsubscribe()
    rows = []
    for (backend, case), samples in times.items():
        plain = median(times[(backend, "no probes")])
        statistics = median(times[(backend, "StatisticsSubscriber")])
        rows.append([backend, case, f"{median(samples) * 1e3:.1f}", f"{median(samples) / plain:.2f}x",
                     f"{median(samples) / statistics:.2f}x" if "Statistics" in case else ""])
    return rows


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    config = QUICK if quick else FULL
    repeats = 3 if quick else 15
    rows = _measure(config, repeats, Path(tempfile.mkdtemp(prefix="probes-bench-")))
    modules = len(list(TinyTransformer(config).modules()))
    return (f"### Anomaly sentinel, nothing found ({'quick' if quick else 'full'}: d_model {config.d_model}, layers "
            f"{config.n_layers}, seq {config.seq_len}, batch 8, {modules} modules, {repeats} interleaved repeats)\n\n"
            f"{environment()}\n\n"
            + table(["backend", "case", "median ms", "/ no probes (same backend)", "/ statistics without check"],
                    rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
