"""Training-step cost of the StatisticsSubscriber vs no probes vs the original onnxruntime hooks.

    python -m benchmarks.step_overhead [--quick]

Eager PyTorch on the CPU, one thread: the 4-layer transformer of shared/ENVIRONMENT.md (d_model 256,
seq 128, batch 8). Every case trains its own copy of the same model; the cases are timed
round-robin and reported as the median step time relative to the unprobed step.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import warnings
from pathlib import Path

import torch

from benchmarks.common import environment, interleaved, median, table
from probes import StatisticsSubscriber, SubscriberManager
from probes.models import TinyTransformer, TransformerConfig, make_batch

FULL = TransformerConfig(vocab_size=1024, d_model=256, n_heads=8, n_layers=4, d_ff=1024, seq_len=128)
QUICK = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=256, seq_len=32)


def _original_subscribe(model: torch.nn.Module, output_dir: Path) -> object | None:
    """Subscribes onnxruntime's own StatisticsSubscriber; None where it is not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from onnxruntime.training.utils.hooks import StatisticsSubscriber as Original
            from onnxruntime.training.utils.hooks._subscriber_manager import SubscriberManager as OriginalManager
    except Exception:
        return None
    manager = OriginalManager()
    manager.subscribe(model, [Original(str(output_dir), override_output_dir=True)])
    return manager


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    config = QUICK if quick else FULL
    repeats = 3 if quick else 15
    torch.manual_seed(0)
    base = TinyTransformer(config)
    batch = make_batch(config, batch_size=8, seed=0)
    work = Path(tempfile.mkdtemp(prefix="probes-bench-"))

    models = {"no probes": base, "probes StatisticsSubscriber": copy.deepcopy(base)}
    manager = SubscriberManager()
    manager.subscribe(models["probes StatisticsSubscriber"], [StatisticsSubscriber(work / "ours")])
    original_model = copy.deepcopy(base)
    if _original_subscribe(original_model, work / "original") is not None:
        models["original onnxruntime StatisticsSubscriber"] = original_model

    def step(model: torch.nn.Module):
        def run_step() -> None:
            model.zero_grad(set_to_none=True)
            model(batch["tokens"], labels=batch["labels"]).backward()
        return run_step

    times = interleaved({name: step(model) for name, model in models.items()}, repeats=repeats)
    manager.unsubscribe()
    baseline = median(times["no probes"])
    rows = [[name, f"{median(t) * 1e3:.1f}", f"{min(t) * 1e3:.1f}", f"{median(t) / baseline:.2f}x"]
            for name, t in times.items()]
    modules = len(list(base.modules()))
    return (f"### Training step, eager ({'quick' if quick else 'full'}: d_model {config.d_model}, "
            f"layers {config.n_layers}, seq {config.seq_len}, batch 8, {modules} modules probed, "
            f"{repeats} interleaved repeats)\n\n{environment()}\n\n"
            + table(["case", "median ms", "min ms", "median / no probes"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))
