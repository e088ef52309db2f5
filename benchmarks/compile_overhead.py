"""Training-step cost of the probes inside torch.compile, against eager PyTorch and compiled without probes.

    python -m benchmarks.compile_overhead [--quick]           (both tables)
    python -m benchmarks.compile_overhead --small [--quick]   (only the small-modules table)

The 4-layer transformer of the step benchmark (d_model 256, seq 128, batch 8; CPU, one thread, inductor).
Cases, each its own copy of the same model, timed round-robin after their first step:

- eager / compiled without probes: the baselines;
- compiled + a null observer (a subscriber whose ``on_event`` does nothing): what the probes
  cost the compiler alone (each observed tensor materialised, no fusion across a probe, one opaque op call
  per site and pass);
- eager / compiled + StatisticsSubscriber: the real thing;
- compiled + StatisticsSubscriber in a step it leaves out (``steps=[never]``): what a step no subscriber
  records costs in the same compiled graph (the probe ops still run; a step cadence never recompiles).

The second table (``run_small``) has the same compiled cases on models of many small modules, where the
per-call cost of the probe ops shows: a chain of Linear(8, 8) and Hugging Face GPT-2 (6 layers x 128, built
from a config, as in ``gpt2_overhead``; skipped without transformers), each case timed round-robin with the
per-round ratio against the compiled model without probes.

The first step of a compiled case is its compile time, reported beside the steady step time. It is
measured in a new process per case with inductor's caches in a new empty directory, so every case
compiles from nothing (in one process, later cases would reuse the kernels the first one compiled). The
quick form times only the compiled statistics case's first step so (it is a test that the benchmark runs).
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
from torch import nn

from benchmarks.common import environment, interleaved, median, ratio_spread, table
from benchmarks.probe_overhead import NoOp
from probes import StatisticsSubscriber, SubscriberBase, SubscriberManager
from probes.dump.live import flush_writers
from probes.models import TinyTransformer, TransformerConfig, make_batch

FULL = TransformerConfig(vocab_size=1024, d_model=256, n_heads=8, n_layers=4, d_ff=1024, seq_len=128)
QUICK = TransformerConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=256, seq_len=32)

LEFT_OUT = "compiled + statistics, a left-out step (steps=[never])"
CASES = ("eager, no probes", "eager + statistics", "compiled, no probes", "compiled + null observer",
         "compiled + statistics", LEFT_OUT)
QUICK_FIRST_STEP = "compiled + statistics"
NEVER = [10**12]  # a step no run reaches
CHAIN, QUICK_CHAIN = 100, 10
STEPS_PER_TIMING = 4  # back to back, as in training: the dump writer works while the next step runs


def _prepare(case: str, model: torch.nn.Module, batch: dict, work: Path,
             managers: list[SubscriberManager]) -> Callable[[], None]:
    """One training step of ``case`` on ``model`` (subscribed and compiled as the case says)."""
    if "statistics" in case or "null" in case:
        managers.append(SubscriberManager())
        managers[-1].subscribe(model, [_subscriber(case, work)])
    runner = torch.compile(model, fullgraph=True) if case.startswith("compiled") else model

    def run_step() -> None:
        model.zero_grad(set_to_none=True)
        runner(batch["tokens"], labels=batch["labels"]).backward()

    return run_step


def _dump(case: str, work: Path) -> Path:
    return work / "".join(c if c.isalnum() else "_" for c in case)


def _subscriber(case: str, work: Path) -> SubscriberBase:
    if "statistics" not in case:
        return NoOp()
    return StatisticsSubscriber(_dump(case, work), steps=NEVER if case == LEFT_OUT else None)


def _first_step_seconds(case: str, quick: bool) -> float:
    """The first (compiling) step of ``case``, timed in a new process with empty inductor caches."""
    cache = tempfile.mkdtemp(prefix="probes-bench-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    command = [sys.executable, "-m", "benchmarks.compile_overhead", "--first-step", case] + (["--quick"] if quick else [])
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=900)
    return float(result.stdout.split()[-1])


def _first_step_cells(seconds: float | None, base: float | None) -> list[str]:
    """A compiled case's first step: its seconds, and their ratio to ``base`` (the first step of the compiled
    model without probes); a step the quick form did not time says so."""
    untimed = "not timed in the quick form"
    return [untimed if seconds is None else f"{seconds:.1f}",
            untimed if seconds is None or base is None else f"{seconds / base:.2f}x"]


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
    # The quick form (a test that the benchmark runs) compiles one case in a child process, not four: each
    # compiles from nothing, minutes on two cores.
    timed_first = (QUICK_FIRST_STEP,) if quick else [case for case in CASES if case.startswith("compiled")]
    first_step = {case: _first_step_seconds(case, quick) for case in timed_first}
    times = interleaved(runners, repeats=repeats, warmup=2)
    for manager in managers:
        manager.unsubscribe()
    eager, compiled = median(times["eager, no probes"]), median(times["compiled, no probes"])
    compile_base = first_step.get("compiled, no probes")
    rows = []
    for case in CASES:
        step = median(times[case])
        is_compiled = case.startswith("compiled")
        rows.append([case, f"{step * 1e3:.1f}", f"{step / eager:.2f}x", f"{step / compiled:.2f}x",
                     ratio_spread(times[case], times["compiled, no probes"]) if is_compiled else "",
                     *(_first_step_cells(first_step.get(case), compile_base) if is_compiled else ["", ""])])
    return rows


# The left-out step before the statistics, as in gpt2_overhead: a case right after the statistics shares the
# machine with the end of its dump writer's work.
SMALL_CASES = ("compiled, no probes", "compiled + null observer", LEFT_OUT, "compiled + statistics")


def _small_models(quick: bool) -> dict[str, tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor], bool]]:
    """name -> (model, its loss, whether it compiles as one graph): the chain, and GPT-2 where transformers is."""
    torch.manual_seed(0)
    count = QUICK_CHAIN if quick else CHAIN
    x = torch.randn(4, 8)
    models = {f"chain of {count} Linear(8, 8)": (nn.Sequential(*(nn.Linear(8, 8) for _ in range(count))),
                                                 lambda model: model(x).sum(), True)}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return models
    from benchmarks.gpt2_overhead import FULL as GPT2, QUICK as GPT2_QUICK, _model

    shape = GPT2_QUICK if quick else GPT2
    tokens = torch.randint(0, 256, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))

    def gpt2_loss(model: torch.nn.Module) -> torch.Tensor:
        # The loss outside the model: transformers' own loss path breaks torch 2.4's graph, probes or not.
        logits = model(input_ids=tokens).logits
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    models[f"GPT-2 {shape['n_layer']} x {shape['n_embd']}, seq {shape['seq']}, batch {shape['batch']}"] = (
        _model(shape), gpt2_loss, False)
    return models


def run_small(quick: bool = False) -> str:
    """The compiled cases on many small modules: per-round ratios against the compiled model without probes."""
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="probes-bench-compile-small-"))
    rows = []
    for model_name, (base, loss, fullgraph) in _small_models(quick).items():
        managers: list[SubscriberManager] = []
        runners = {}
        for case in SMALL_CASES:
            model, dumps = copy.deepcopy(base), work / model_name.split()[0]
            if case != "compiled, no probes":
                managers.append(SubscriberManager())
                managers[-1].subscribe(model, [_subscriber(case, dumps)])
            runners[case] = _steps(model, torch.compile(model, fullgraph=fullgraph), loss, _dump(case, dumps))
        times = {case: [value / STEPS_PER_TIMING for value in values]
                 for case, values in interleaved(runners, repeats=3 if quick else 15).items()}
        for manager in managers:
            manager.unsubscribe()
        plain = times["compiled, no probes"]
        probes = len(list(base.modules()))
        for case in SMALL_CASES:
            extra = (median(times[case]) - median(plain)) / probes
            rows.append([model_name, case, f"{median(times[case]) * 1e3:.2f}", ratio_spread(times[case], plain),
                         "" if case == "compiled, no probes" else f"{extra * 1e6:.1f}"])
        torch._dynamo.reset()  # the next model compiles from nothing, its graphs not beside these
    return (f"### Small modules under torch.compile ({'quick' if quick else 'full'}; inductor, "
            f"{STEPS_PER_TIMING} steps per timing, {3 if quick else 15} interleaved rounds)\n\n"
            "`python -m benchmarks.compile_overhead --small`: every module probed; the µs are per probed module and "
            "step (forward and backward: two probe ops), over the compiled step without probes.\n\n"
            f"{environment()}\n\n"
            + table(["model", "case", "median ms / step", "/ compiled no probes, per round: median (quartiles)",
                     "µs / module over no probes"], rows))


def _steps(model: torch.nn.Module, runner: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor],
           dump: Path) -> Callable[[], None]:
    def run_steps() -> None:
        for _ in range(STEPS_PER_TIMING):
            model.zero_grad(set_to_none=True)
            loss(runner).backward()
        flush_writers(dump)  # the dump writer's work for these steps is counted here, not in the next case
    return run_steps


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
            + table(["case", "median ms", "/ eager no probes", "/ compiled no probes",
                     "/ compiled no probes, per round: median (quartiles)", "first step s (compile)",
                     "first step / compiled no probes"], rows)
            + "\n\n" + run_small(quick))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--first-step", choices=CASES, help="only time this case's first step (a child process)")
    parser.add_argument("--small", action="store_true", help="only the small-modules table")
    args = parser.parse_args()
    if args.first_step:
        _first_step_here(args.first_step, args.quick)
    elif args.small:
        print(run_small(args.quick))
    else:
        print(run(args.quick))
