"""Per-probe overhead: step cost vs number of probed modules (10 to 1,000).

    python -m benchmarks.probe_overhead [--quick]

A chain of N tiny Linear(8, 8) modules, so the step is dominated by per-module costs. Each case is
timed against the unprobed chain in the same run; the overhead is reported per probed module and
step (forward + backward), in microseconds, for a no-op observing subscriber (the manager's own
cost: hooks, pytree, the probe Function) and for the StatisticsSubscriber (plus statistics and dump).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import environment, interleaved, median, table
from probes import StatisticsSubscriber, SubscriberBase, SubscriberManager

FULL_COUNTS = (10, 100, 1000)
QUICK_COUNTS = (10, 100)


class NoOp(SubscriberBase):
    """Observes every tensor and does nothing with it: the manager's own cost."""

    def on_forward(self, event, tensors):
        pass

    def on_backward(self, event, grads):
        pass


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    rows = []
    for count in QUICK_COUNTS if quick else FULL_COUNTS:
        torch.manual_seed(0)
        plain = nn.Sequential(*(nn.Linear(8, 8) for _ in range(count)))
        models = {"plain": plain, "no-op": copy.deepcopy(plain), "statistics": copy.deepcopy(plain)}
        managers = [SubscriberManager(), SubscriberManager()]
        managers[0].subscribe(models["no-op"], [NoOp()])
        managers[1].subscribe(models["statistics"], [StatisticsSubscriber(work / f"stats_{count}")])
        x = torch.randn(4, 8)

        def step(model: nn.Module):
            return lambda: model(x).sum().backward()

        times = interleaved({name: step(model) for name, model in models.items()}, repeats=3 if quick else 15)
        for manager in managers:
            manager.unsubscribe()
        base = median(times["plain"])
        probes_count = count + 1  # every Linear and the Sequential itself
        rows.append([count, f"{base * 1e3:.2f}",
                     f"{(median(times['no-op']) - base) / probes_count * 1e6:.1f}",
                     f"{(median(times['statistics']) - base) / probes_count * 1e6:.1f}",
                     f"{median(times['statistics']) / base:.2f}x"])
    return (f"### Per-probe overhead ({'quick' if quick else 'full'}; chain of Linear(8, 8), batch 4)\n\n"
            f"{environment()}\n\n"
            + table(["modules", "plain step ms", "no-op subscriber µs / module", "statistics µs / module",
                     "statistics step / plain"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
