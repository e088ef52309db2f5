"""The end-to-end demo: the same training in eager PyTorch and in ORTModule, probed and compared.

    python -m probes.demo [--steps 5] [--out demo_out]      (``./dev demo`` runs this)

Trains the built-in TinyTransformer with identical weights and data twice, once eagerly and once
wrapped in ORTModule, each with a StatisticsSubscriber on every module, then compares the two dumps
record by record and prints the verdict.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # never silently run PyTorch

import torch

from . import SubscriberManager
from .compare import compare_dumps
from .dump import list_steps
from .models import TinyTransformer, TransformerConfig, make_batch
from .statistics import StatisticsSubscriber

CONFIG = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=128, seq_len=32, dropout=0.0)


def train(model: torch.nn.Module, output_dir: Path, steps: int, label: str) -> list[float]:
    """Trains ``steps`` SGD steps with a StatisticsSubscriber dumping to ``output_dir``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = SubscriberManager()
    losses = []
    with manager.subscribe(model, [StatisticsSubscriber(output_dir, override_output_dir=True)]):
        for step in range(steps):
            batch = make_batch(CONFIG, batch_size=8, seed=step)
            started = time.perf_counter()
            loss = model(batch["tokens"], labels=batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            print(f"  [{label}] step {step}: loss {loss.item():.6f}  ({(time.perf_counter() - started) * 1e3:.0f} ms)")
        assert manager.step == steps, f"{label}: step counter {manager.step} != {steps}"
    return losses


def ort_wrap(model: torch.nn.Module) -> torch.nn.Module | None:
    try:
        from onnxruntime.training.ortmodule import ORTModule
    except Exception as error:  # ImportError or ORT's extension check
        print(f"ORTModule is not available here ({type(error).__name__}: {error}); run ./dev demo (ort lane).")
        return None
    return ORTModule(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probes.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    eager_model, ort_inner = model, copy.deepcopy(model)
    print(f"probes demo: {type(model).__name__} {CONFIG}, torch {torch.__version__}")

    print(f"eager PyTorch -> {args.out / 'eager'}")
    eager_losses = train(eager_model, args.out / "eager", args.steps, "eager")

    ort_model = ort_wrap(ort_inner)
    if ort_model is None:
        return 1
    print(f"ORTModule -> {args.out / 'ort'}  (first step exports the model)")
    ort_losses = train(ort_model, args.out / "ort", args.steps, "ort")

    for label in ("eager", "ort"):
        steps = list_steps(args.out / label)[0]
        print(f"{label}: finished steps {steps['finished']}, unfinished {steps['unfinished']}")
    report = compare_dumps(args.out / "eager", args.out / "ort", rtol=1e-3, atol=1e-5)
    worst_loss = max(abs(a - b) / abs(a) for a, b in zip(eager_losses, ort_losses))
    print(f"compared {report.matched} records; only in eager: {len(report.only_in_base)}, "
          f"only in ort: {len(report.only_in_other)}; worst relative loss difference {worst_loss:.2e}")
    if report.first_divergence is None and not report.only_in_base and not report.only_in_other:
        print("verdict: eager and ORT runs agree (rtol 1e-3, atol 1e-5) on every record")
        return 0
    print(f"verdict: DIVERGENCE. first: {report.first_divergence}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
