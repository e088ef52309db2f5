"""Cost of parameter, gradient and optimizer-state records over activation statistics alone.

    python -m benchmarks.parameter_overhead [--quick]

The 4-layer transformer (d_model 256, seq 128, batch 8) trained eagerly on the CPU, one thread, with
``torch.optim.Adam``: a timed step is ``zero_grad``, forward, backward, ``optimizer.step()`` and the dump
writer's work for that step. Cases, each on its own copy of the same model, timed round-robin:
- no probes;
- ``StatisticsSubscriber(out)``: activation and activation-gradient statistics (the baseline);
- ``parameters=True``: plus a ``grad`` and a ``param`` record per parameter;
- ``parameters=True, optimizer_state=True``: plus ``optim`` records (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``).
The figure that matters is each case / activation statistics alone. Peak memory: each case trains alone in
a fresh process; after its first step the kernel's peak counter is reset (``/proc/self/clear_refs``), so the
peak resident memory (``VmHWM``) is that of training, beside that of no probes.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import environment, interleaved, median, peak_rss, table
from probes import StatisticsSubscriber, SubscriberManager
from probes.dump.live import flush_writers
from probes.models import TinyTransformer, TransformerConfig, make_batch

FULL = TransformerConfig(vocab_size=1024, d_model=256, n_heads=8, n_layers=4, d_ff=1024, seq_len=128)
QUICK = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=256, seq_len=32)
CASES: dict[str, dict | None] = {
    "no probes": None,
    "activation statistics": {},
    "+ parameters=True": {"parameters": True},
    "+ parameters, optimizer_state": {"parameters": True, "optimizer_state": True},
}
BASELINE = "activation statistics"


def _case(config: TransformerConfig, options: dict | None, dump: Path) -> tuple[Callable[[], None], SubscriberManager | None]:
    """One case's step function (and its manager, to unsubscribe)."""
    torch.manual_seed(0)
    model = TinyTransformer(config)
    batch = make_batch(config, batch_size=8, seed=0)
    manager = None
    if options is not None:
        manager = SubscriberManager()
        manager.subscribe(model, [StatisticsSubscriber(dump, **options)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(batch["tokens"], labels=batch["labels"]).backward()
        optimizer.step()
        if manager is not None:  # the writer's work for this step (finished after the update) is counted here
            flush_writers(dump)
    return step, manager


def _case_from_json(config: str, case: str, dump: Path) -> tuple[Callable[[], None], SubscriberManager | None]:
    """``_case`` from its arguments as text (``common.peak_rss``'s fresh process)."""
    return _case(TransformerConfig(**json.loads(config)), CASES[case], dump)


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    config = QUICK if quick else FULL
    repeats = 3 if quick else 15
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))
    built = {name: _case(config, options, work / f"case-{index}") for index, (name, options) in enumerate(CASES.items())}
    times = interleaved({name: step for name, (step, _) in built.items()}, repeats=repeats, warmup=2)
    for _, manager in built.values():
        if manager is not None:
            manager.unsubscribe()
    fields = {key: getattr(config, key) for key in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "seq_len")}
    rss = {name: peak_rss("benchmarks.parameter_overhead", name, json.dumps(fields), 3 if quick else 10, work / f"rss-{index}")
           for index, name in enumerate(CASES)}
    shutil.rmtree(work, ignore_errors=True)
    plain, base = median(times["no probes"]), median(times[BASELINE])
    rows = [[name, f"{median(samples) * 1e3:.1f}", f"{median(samples) / plain:.3f}x", f"{median(samples) / base:.3f}x",
             f"{rss[name] / 2**20:.1f}", f"{(rss[name] - rss['no probes']) / 2**20:+.1f}"]
            for name, samples in times.items()]
    parameters = sum(p.numel() for p in TinyTransformer(config).parameters())
    return (f"### Parameter, gradient and optimizer-state records ({'quick' if quick else 'full'}: "
            f"d_model {config.d_model}, {config.n_layers} layers, seq {config.seq_len}, batch 8, "
            f"{parameters / 1e6:.2f}M parameters, Adam, {repeats} interleaved repeats)\n\n"
            + table(["case", "median ms per step", "vs no probes", "vs activation statistics",
                     "peak RSS MiB", "vs no probes MiB"], rows)
            + f"\n\nA step includes optimizer.step() and the writer's work for the step. {environment()}\n")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parameter_overhead")
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))


if __name__ == "__main__":
    main()
