"""The end-to-end demo: the same training in eager PyTorch and in ORTModule, probed and compared.

    python -m probes.demo [--steps 5] [--out demo_out]      (``./dev demo`` runs this)
    python -m probes.demo --inject-bug [--bug-layer blocks.1.mlp.0] [--bug-step 2] [--bug-factor 1.01]

Trains the built-in TinyTransformer with identical weights and data twice, once eagerly and once
wrapped in ORTModule, each with a StatisticsSubscriber on every module, then compares the two dumps
record by record, prints the verdict and writes an HTML report (``<out>/compare.html``).

With ``--inject-bug`` the second run multiplies one layer's output by a factor from a chosen step on
(``probes.testing.inject_bug``: an autograd Function, so it is part of ORT's graph, reading the
current step from a live object), and the demo checks that the comparison pinpoints exactly that
layer and step. ``--second eager`` runs the second run eagerly too (for machines without ORTModule).
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

from .core import SubscriberManager
from .compare import compare_dumps, format_report, write_html
from .dump import list_steps
from .models import TinyTransformer, TransformerConfig, make_batch
from .stats import StatisticsSubscriber
from .testing import BugInjection, inject_bug

CONFIG = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=128, seq_len=32, dropout=0.0)
RTOL, ATOL = 1e-3, 1e-5


def train(model: torch.nn.Module, output_dir: Path, steps: int, label: str,
          bug: BugInjection | None = None) -> list[float]:
    """Trains ``steps`` SGD steps with a StatisticsSubscriber dumping to ``output_dir``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = SubscriberManager()
    losses = []
    with manager.subscribe(model, [StatisticsSubscriber(output_dir, override_output_dir=True)]):
        for step in range(steps):
            if bug is not None:
                bug.step = step  # the bug's Function reads this live object, under ORT too
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
        print(f"ORTModule is not available here ({type(error).__name__}: {error}); run ./dev demo (ort lane), "
              "or pass --second eager.")
        return None
    return ORTModule(model)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m probes.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    parser.add_argument("--second", choices=("ort", "eager"), default="ort", help="how the second run trains")
    parser.add_argument("--inject-bug", action="store_true", help="perturb one layer of the second run")
    parser.add_argument("--bug-layer", default="blocks.1.mlp.0", help="module whose output is perturbed")
    parser.add_argument("--bug-step", type=int, default=2, help="first step with the perturbation")
    parser.add_argument("--bug-factor", type=float, default=1.01, help="the layer's output is multiplied by this")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.inject_bug and not 0 <= args.bug_step < args.steps:
        parser.error(f"--bug-step must be in [0, --steps) = [0, {args.steps})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    eager_model, second_inner = model, copy.deepcopy(model)
    print(f"probes demo: {type(model).__name__} {CONFIG}, torch {torch.__version__}")
    bug = None
    if args.inject_bug:
        try:
            bug = inject_bug(second_inner, args.bug_layer, step=args.bug_step, factor=args.bug_factor)
        except ValueError as error:
            print(f"probes demo: {error}", file=sys.stderr)
            return 2
        print(f"injected bug: {args.bug_layer} output x {args.bug_factor} from step {args.bug_step} "
              f"in the {args.second} run")

    print(f"eager PyTorch -> {args.out / 'eager'}")
    eager_losses = train(eager_model, args.out / "eager", args.steps, "eager")

    label = "ort" if args.second == "ort" else "eager2"
    if args.second == "ort":
        second_model = ort_wrap(second_inner)
        if second_model is None:
            return 1
        print(f"ORTModule -> {args.out / label}  (first step exports the model)")
    else:
        second_model = second_inner
        print(f"eager PyTorch again -> {args.out / label}")
    second_losses = train(second_model, args.out / label, args.steps, label, bug)

    for run in ("eager", label):
        steps = list_steps(args.out / run)[0]
        print(f"{run}: finished steps {steps['finished']}, unfinished {steps['unfinished']}")
    report = compare_dumps(args.out / "eager", args.out / label, rtol=RTOL, atol=ATOL)
    worst_loss = max(abs(a - b) / abs(a) for a, b in zip(eager_losses, second_losses))
    print(f"worst relative loss difference {worst_loss:.2e}")
    print()
    print(format_report(report, top=5))
    html_path = write_html(report, args.out / "compare.html")
    print(f"HTML report: {html_path.resolve()}")
    if bug is None:
        return 0 if report.agrees else 1
    expected = (0, args.bug_step, "forward", bug.record_name)
    first = report.first_divergence
    found = (first.rank, first.step, first.phase, first.name) if first is not None else None
    if found == expected:
        print(f"compare pinpointed the injected bug: step {args.bug_step}, forward, {bug.record_name}")
        return 0
    print(f"compare did NOT pinpoint the injected bug: expected {expected}, found {found}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
