"""Training-step cost of the probes inside torch.compile, against eager PyTorch and compiled without probes.

    python -m benchmarks.compile_overhead [--quick]

The 4-layer transformer of the step benchmark (d_model 256, seq 128, batch 8; CPU, one thread, inductor).
Cases, each its own copy of the same model, timed round-robin after their first step:

- eager / compiled without probes: the baselines;
- compiled + a null observer (a subscriber whose ``on_forward``/``on_backward`` do nothing): what the probes
  cost the compiler alone (each observed tensor materialised, no fusion across a probe, one opaque op call
  per site and pass);
- eager / compiled + StatisticsSubscriber: the real thing.

The first step of a compiled case is its compile time, reported beside the steady step time. It is
measured in a new process per case with inductor's caches in a new empty directory, so every case
compiles from nothing (in one process, later cases would reuse the kernels the first one compiled).
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import environment, interleaved, median, table
from benchmarks.probe_overhead import NoOp
from probes import StatisticsSubscriber, SubscriberManager
from probes.models import TinyTransformer, TransformerConfig, make_batch

FULL = TransformerConfig(vocab_size=1024, d_model=256, n_heads=8, n_layers=4, d_ff=1024, seq_len=128)
QUICK = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=256, seq_len=32)

CASES = ("eager, no probes", "eager + statistics", "compiled, no probes", "compiled + null observer",
         "compiled + statistics")


def _prepare(case: str, model: torch.nn.Module, batch: dict, work: Path,
             managers: list[SubscriberManager]) -> Callable[[], None]:
    """One training step of ``case`` on ``model`` (subscribed and compiled as the case says)."""
    if "statistics" in case or "null" in case:
        subscriber = StatisticsSubscriber(work / case.replace(" ", "_")) if "statistics" in case else NoOp()
        managers.append(SubscriberManager())
        managers[-1].subscribe(model, [subscriber])
    runner = torch.compile(model, fullgraph=True) if case.startswith("compiled") else model

    def run_step() -> None:
        model.zero_grad(set_to_none=True)
        runner(batch["tokens"], labels=batch["labels"]).backward()

    return run_step


def _first_step_seconds(case: str, quick: bool) -> float:
    """The first (compiling) step of ``case``, timed in a new process with empty inductor caches."""
    cache = tempfile.mkdtemp(prefix="probes-bench-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    command = [sys.executable, "-m", "benchmarks.compile_overhead", "--first-step", case] + (["--quick"] if quick else [])
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=900)
    return float(result.stdout.split()[-1])


def _first_step_here(case: str, quick: bool) -> None:
    torch.set_num_threads(1)
    config = QUICK if quick else FULL
    torch.manual_seed(0)
    run_step = _prepare(case, TinyTransformer(config), make_batch(config, batch_size=8, seed=0),
                        Path(tempfile.mkdtemp(prefix="probes-bench-compile-")), [])
    started = time.perf_counter()
    run_step()
    print(f"{time.perf_counter() - started:.3f}")


def _measure(config: TransformerConfig, repeats: int, work: Path, quick: bool) -> list[list[object]]:
    torch.manual_seed(0)
    base = TinyTransformer(config)
    batch = make_batch(config, batch_size=8, seed=0)
    managers: list[SubscriberManager] = []
    runners = {case: _prepare(case, copy.deepcopy(base), batch, work, managers) for case in CASES}
    first_step = {case: _first_step_seconds(case, quick) for case in CASES if case.startswith("compiled")}
    times = interleaved(runners, repeats=repeats, warmup=2)
    for manager in managers:
        manager.unsubscribe()
    eager, compiled = median(times["eager, no probes"]), median(times["compiled, no probes"])
    compile_base = first_step["compiled, no probes"]
    rows = []
    for case in CASES:
        step = median(times[case])
        is_compiled = case.startswith("compiled")
        rows.append([case, f"{step * 1e3:.1f}", f"{step / eager:.2f}x", f"{step / compiled:.2f}x",
                     f"{first_step[case]:.1f}" if is_compiled else "",
                     f"{first_step[case] / compile_base:.2f}x" if is_compiled else ""])
    return rows


def run(quick: bool = False) -> str:
    torch.set_num_threads(1)
    config = QUICK if quick else FULL
    repeats = 3 if quick else 15
    work = Path(tempfile.mkdtemp(prefix="probes-bench-compile-"))
    rows = _measure(config, repeats, work, quick)
    modules = len(list(TinyTransformer(config).modules()))
    return (f"### Training step under torch.compile ({'quick' if quick else 'full'}: d_model {config.d_model}, "
            f"layers {config.n_layers}, seq {config.seq_len}, batch 8, {modules} modules probed, inductor, "
            f"fullgraph, {repeats} interleaved repeats)\n\n{environment()}\n\n"
            + table(["case", "median ms", "/ eager no probes", "/ compiled no probes", "first step s (compile)",
                     "first step / compiled no probes"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--first-step", choices=CASES, help="only time this case's first step (a child process)")
    args = parser.parse_args()
    if args.first_step:
        _first_step_here(args.first_step, args.quick)
    else:
        print(run(args.quick))
