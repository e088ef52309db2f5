"""The end-to-end demo: the same training in eager PyTorch, in ORTModule and under torch.compile, compared.

    python -m probes.demo [--steps 5] [--out demo_out]      (``./dev demo`` runs this)
    python -m probes.demo --backends eager,compile          # any of eager, ort, compile; the first is the base
    python -m probes.demo --inject-bug [--bug-layer blocks.1.mlp.0] [--bug-step 2] [--bug-factor 1.01]

Trains the built-in TinyTransformer with identical weights and data once per backend (by default eager
PyTorch, ORTModule, and ``torch.compile(fullgraph=True)``), each with a StatisticsSubscriber on every
module, then compares every run with the first record by record, prints the verdicts and writes an
HTML report per comparison (``<out>/compare_<backend>.html``).

With ``--inject-bug`` every run but the first multiplies one layer's output by a factor from a chosen
step on (``probes.testing.inject_bug``: an autograd Function reading the current step from a live
object, so it is part of ORT's and the compiler's graphs), and the demo checks that each comparison
pinpoints exactly that layer and step. ``--second B`` is ``--backends eager,B`` (``--second eager``:
two eager runs, for machines without ORTModule).
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
from .dump.reader import list_steps
from .models import TinyTransformer, TransformerConfig, make_batch
from .stats import StatisticsSubscriber
from .testing import BugInjection, inject_bug

CONFIG = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=128, seq_len=32, dropout=0.0)
RTOL, ATOL = 1e-3, 1e-5


def train(model: torch.nn.Module, output_dir: Path, steps: int, label: str,
          bug: BugInjection | None = None) -> list[float]:
    """Trains ``steps`` SGD steps of ``model`` (or of its ORTModule / torch.compile wrapper) with a
    StatisticsSubscriber dumping to ``output_dir``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = SubscriberManager()
    losses = []
    with manager.subscribe(model, [StatisticsSubscriber(output_dir, override_output_dir=True)]):
        for step in range(steps):
            if bug is not None:
                bug.step = step  # the bug's Function reads this live object, under ORT and torch.compile too
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


BACKENDS = ("eager", "ort", "compile")


def wrap(backend: str, model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` as the backend runs it; None (after saying why) when this machine cannot."""
    if backend == "compile":
        return torch.compile(model, fullgraph=True)  # fullgraph: a graph break would be an error, not a fallback
    if backend != "ort":
        return model
    try:
        from onnxruntime.training.ortmodule import ORTModule
    except Exception as error:  # ImportError or ORT's extension check
        print(f"ORTModule is not available here ({type(error).__name__}: {error}); run ./dev demo (ort lane), "
              "or pass --backends eager,compile.")
        return None
    return ORTModule(model)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m probes.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated runs, each compared with the first (eager, ort, compile)")
    parser.add_argument("--second", choices=BACKENDS, help="same as --backends eager,SECOND")
    parser.add_argument("--inject-bug", action="store_true", help="perturb one layer of every run but the first")
    parser.add_argument("--bug-layer", default="blocks.1.mlp.0", help="module whose output is perturbed")
    parser.add_argument("--bug-step", type=int, default=2, help="first step with the perturbation")
    parser.add_argument("--bug-factor", type=float, default=1.01, help="the layer's output is multiplied by this")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.inject_bug and not 0 <= args.bug_step < args.steps:
        parser.error(f"--bug-step must be in [0, --steps) = [0, {args.steps})")
    backends = ["eager", args.second] if args.second else [name.strip() for name in args.backends.split(",")]
    unknown = [name for name in backends if name not in BACKENDS]
    if unknown or len(backends) < 2:
        parser.error(f"--backends needs two or more of {', '.join(BACKENDS)}, got {args.backends!r}")
    args.backends = backends
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    print(f"probes demo: {type(model).__name__} {CONFIG}, torch {torch.__version__}")
    labels = [backend if args.backends.index(backend) == index else f"{backend}{index + 1}"
              for index, backend in enumerate(args.backends)]  # eager,eager -> eager, eager2
    models = [model] + [copy.deepcopy(model) for _ in labels[1:]]  # copied before any run trains
    runs: dict[str, list[float]] = {}
    bugs: dict[str, BugInjection] = {}
    for index, (backend, label, inner) in enumerate(zip(args.backends, labels, models)):
        if args.inject_bug and index > 0:
            try:
                bugs[label] = inject_bug(inner, args.bug_layer, step=args.bug_step, factor=args.bug_factor)
            except ValueError as error:
                print(f"probes demo: {error}", file=sys.stderr)
                return 2
            print(f"injected bug: {args.bug_layer} output x {args.bug_factor} from step {args.bug_step} "
                  f"in the {label} run")
        runner = wrap(backend, inner)
        if runner is None:
            return 1
        first = {"ort": "  (first step exports the model)", "compile": "  (first step compiles the model)"}
        print(f"{DESCRIPTION[backend]} -> {args.out / label}{first.get(backend, '')}")
        runs[label] = train(runner, args.out / label, args.steps, label, bugs.get(label))

    base = labels[0]
    for label in labels:
        steps = list_steps(args.out / label)[0]
        print(f"{label}: finished steps {steps['finished']}, unfinished {steps['unfinished']}")
    status = 0
    for label in labels[1:]:
        status = max(status, _compare(args, base, label, runs, bugs.get(label)))
    return status


DESCRIPTION = {"eager": "eager PyTorch", "ort": "ORTModule", "compile": "torch.compile(fullgraph=True)"}


def _compare(args: argparse.Namespace, base: str, label: str, runs: dict[str, list[float]],
             bug: BugInjection | None) -> int:
    report = compare_dumps(args.out / base, args.out / label, rtol=RTOL, atol=ATOL)
    worst_loss = max(abs(a - b) / abs(a) for a, b in zip(runs[base], runs[label]))
    print(f"\n===== {base} vs {label} =====")
    print(f"worst relative loss difference {worst_loss:.2e}")
    print()
    print(format_report(report, top=5))
    html_path = write_html(report, args.out / f"compare_{label}.html")
    print(f"HTML report: {html_path.resolve()}")
    if bug is None:
        return 0 if report.agrees else 1
    expected = (0, args.bug_step, "forward", bug.record_name)
    first = report.first_divergence
    found = (first.rank, first.step, first.phase, first.name) if first is not None else None
    if found == expected:
        print(f"compare pinpointed the injected bug in the {label} run: step {args.bug_step}, forward, "
              f"{bug.record_name}")
        return 0
    print(f"compare did NOT pinpoint the injected bug in the {label} run: expected {expected}, found {found}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
